"""The ``sglang`` rollout engine with the real SGLang engine on CPU (``launch/install_sglang_cpu.sh``).

One engine (tiny model A, with the storage probe of ``sglang_probes``) serves the module; a second one
(model B) is started once as the "fresh load" reference for the in-place swap. Process-lifecycle cases
run as small scripts in subprocesses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import process_marks
import pytest
import torch
from partial_checks import interrupted_generation
from safetensors.torch import load_file
from sglang_probes import SERVER_ARGS, parameter_storage
from transformers import AutoModelForCausalLM

from hybridrl.interfaces import Generation, SamplingParams
from hybridrl.models.tiny import make_tiny_model
from hybridrl.registry import PluginConfigError, Registry
from hybridrl.rollout.engines import sglang_compat as compat

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed: run `bash launch/install_sglang_cpu.sh` (CI's test command does)",
                allow_module_level=True)

from hybridrl.rollout.engines.sglang import CONFIG_KEY, SGLangEngineError, SGLangRolloutEngine  # noqa: E402

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def build(path: Path, **kw: object) -> SGLangRolloutEngine:
    return Registry("rollout_engines").build("sglang", kw, key=CONFIG_KEY, model_path=str(path),
                                             device=torch.device("cpu"))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("sglang_engine")
    kw = dict(hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    return make_tiny_model(tmp / "a", seed=1, **kw), make_tiny_model(tmp / "b", seed=2, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(models: tuple[Path, Path]) -> Iterator[SGLangRolloutEngine]:
    eng = build(models[0], server_args=SERVER_ARGS)
    yield eng
    eng.shutdown()


def forward_logprobs(model: torch.nn.Module, prompt: list[int], g: Generation, temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + g.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logp.gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_match_a_full_transformers_forward(engine: SGLangRolloutEngine, models: tuple[Path, Path],
                                                    temperature: float) -> None:
    out = engine.generate(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=8, n=2), seeds=[3, 4, 5])
    ref = AutoModelForCausalLM.from_pretrained(models[0]).eval()
    for g in out:  # log_softmax(logits / T): what the Megatron actor recomputes
        want = forward_logprobs(ref, PROMPTS[g.prompt_index], g, temperature)
        assert torch.allclose(torch.tensor(g.logprobs), want, atol=1e-4), (g.logprobs, want)


def test_greedy_tokens_and_logprobs_match_the_hf_engine(engine: SGLangRolloutEngine, models: tuple[Path, Path]) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    hf = Registry("rollout_engines").build("hf", {}, key=CONFIG_KEY, model_path=str(models[0]))
    want = hf.generate(PROMPTS, params)
    got = engine.generate(PROMPTS, params)
    for g, w in zip(got, want, strict=True):
        assert (g.prompt_index, g.token_ids, g.finish_reason) == (w.prompt_index, w.token_ids, w.finish_reason)
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)


def test_score_equals_the_hf_engines_and_input_logprobs_stay_untempered(engine: SGLangRolloutEngine,
                                                                      models: tuple[Path, Path]) -> None:
    """A teacher served by SGLang (``score``: its input log-probs from ``logprob_start_len``) scores as the hf engine
    does at T = 1 — each token's log-prob and the top-k ids in order. sglang_compat item 11 (still needed): a request
    at T = 0.7 gets the untempered input log-probs, so a tempered score is refused (fails once SGLang tempers them)."""
    from score_checks import SEQS, STARTS, scores_like_hf

    from hybridrl.rollout.engines.hf import HFRolloutEngine

    scores_like_hf(engine, models[0])
    seqs, starts = SEQS, STARTS
    hf = HFRolloutEngine(HFRolloutEngine.Config(), model_path=str(models[0]))
    outs = engine._call(engine.engine.async_generate(
        input_ids=[seqs[0]], sampling_params=[{"temperature": 0.7, "max_new_tokens": 1}], return_logprob=True,
        logprob_start_len=[4]), what="probe")
    meta = (outs if isinstance(outs, list) else [outs])[0]["meta_info"]
    got = torch.tensor([float(lp) for lp, _, _ in meta["input_token_logprobs"][-3:]])
    untempered, tempered = (hf.score(seqs[:1], starts=[5], temperature=t)[0].logprobs for t in (1.0, 0.7))
    assert torch.allclose(got, untempered, atol=1e-5) and not torch.allclose(got, tempered, atol=1e-3)
    with pytest.raises(SGLangEngineError, match="untempered softmax only"):
        engine.score(seqs, starts=starts, temperature=0.7)


def test_n_samples_stop_tokens_and_finish_reasons(engine: SGLangRolloutEngine) -> None:
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=5, n=3), seeds=[7, 8, 9])
    assert [g.prompt_index for g in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len({tuple(g.token_ids) for g in out[:3]}) > 1  # n samples of one prompt differ
    for g in out:
        stopped = bool(set(g.token_ids) & set(engine.stop_ids))
        assert g.finish_reason == ("stop" if stopped else "length")
        assert len(g.token_ids) == len(g.logprobs) and (stopped or len(g.token_ids) == 5)
    first = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=4))[0].token_ids[0]
    stopped = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=[first]))
    assert stopped[0].token_ids == [first] and stopped[0].finish_reason == "stop"
    assert engine.generate([], SamplingParams()) == []


def test_a_samples_sglang_seed_depends_on_its_prompts_seed_and_index_alone(
        engine: SGLangRolloutEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[list[dict[str, object]]] = []  # sampling params of each generate call, per request
    real = engine.engine.async_generate

    def spy(**kw: object) -> object:
        sent.append(kw["sampling_params"])  # type: ignore[arg-type]
        return real(**kw)

    monkeypatch.setattr(engine.engine, "async_generate", spy)
    params = SamplingParams(temperature=1.0, max_new_tokens=2, n=2)
    engine.generate(PROMPTS, params, seeds=[11, 12, 13])
    engine.generate(PROMPTS[::-1], params, seeds=[13, 12, 11])  # the same prompts at other positions
    engine.generate(PROMPTS[1:], params, seeds=[12, 13])  # fewer prompts in the call
    engine.generate(PROMPTS, params)  # no seeds: the engine's own randomness
    s = [[r.get("sampling_seed") for r in call] for call in sent]
    assert len(set(s[0])) == 6  # prompt-major: (11, 0), (11, 1), (12, 0), (12, 1), (13, 0), (13, 1)
    assert s[1] == s[0][4:] + s[0][2:4] + s[0][:2]
    assert s[2] == s[0][2:]
    assert s[3] == [None] * 6
    with pytest.raises(ValueError, match="3 prompts; pass one seed per prompt"):
        engine.generate(PROMPTS, params, seeds=[1])


def test_memory_phases_are_harmless_on_cpu(engine: SGLangRolloutEngine) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS, params)
    engine.config.free_cache_engine = True  # SGLang's release/resume_memory_occupation run (no-ops on CPU)
    try:
        for _ in range(3):  # right after a generate: waits for an idle scheduler, which SGLang asserts
            engine.release_memory()
            engine.release_memory()  # idempotent
            assert engine._released == {"kv_cache"}
            engine.resume_memory()
            assert engine._released == set()
            assert [g.token_ids for g in engine.generate(PROMPTS, params)] == [g.token_ids for g in before]
    finally:
        engine.config.free_cache_engine = None


def test_swap_in_place_equals_a_fresh_engine(engine: SGLangRolloutEngine, models: tuple[Path, Path]) -> None:
    a, b = models
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, params)
    storage = parameter_storage(engine)
    version = engine.version + 1
    weights = load_file(b / "model.safetensors")
    names = sorted(weights)
    engine.update_weights(([(n, weights[n]) for n in names[i:i + 3]] for i in range(0, len(names), 3)),
                          version=version)
    assert engine.last_update["buckets"] == -(-len(names) // 3)
    swapped, swapped_sampled = engine.generate(PROMPTS, params), engine.generate(PROMPTS, sampled, seeds=[1, 2, 3])
    fresh = build(b)
    contexts = compat.ipc_contexts(fresh.engine)
    try:
        want = fresh.generate(PROMPTS, params)
    finally:
        fresh.shutdown()
    assert len(contexts) == 2 and all(c.closed for c in contexts)  # sglang_compat item 9
    # a random tiny model's greedy path can repeat the prompt: compare the log-probs too
    assert [g.token_ids for g in swapped] == [g.token_ids for g in want]
    assert torch.allclose(torch.tensor(sum((g.logprobs for g in swapped), [])),
                          torch.tensor(sum((g.logprobs for g in want), [])), atol=1e-6)
    ref_b = AutoModelForCausalLM.from_pretrained(b).eval()
    for g in swapped_sampled:  # sampled tokens too: scored by model B
        want_lp = forward_logprobs(ref_b, PROMPTS[g.prompt_index], g, 1.0)
        assert torch.allclose(torch.tensor(g.logprobs), want_lp, atol=1e-4)
    assert [g.logprobs for g in swapped] != [g.logprobs for g in before]
    assert parameter_storage(engine) == storage  # same storage: swapped in place
    assert {g.weight_version for g in swapped + swapped_sampled} == {version}
    # and back to A (one bucket), version incremented again: the original outputs return
    weights_a = load_file(a / "model.safetensors")
    engine.update_weights([list(weights_a.items())], version=version + 1)
    back = engine.generate(PROMPTS, params)
    assert [(g.token_ids, g.weight_version) for g in back] == [(g.token_ids, version + 1) for g in before]
    assert parameter_storage(engine) == storage


def test_an_interrupted_generation_continues_after_a_weight_update(engine: SGLangRolloutEngine,
                                                                    models: tuple[Path, Path]) -> None:
    """``async_training.partial_rollout`` on SGLang: ``abort()`` from another thread cuts the running requests short
    (SGLang's abort keeps their tokens), the weights are updated while paused, and every sample then continues to
    its own end on the new version — its tokens sampled by both. The weights streamed are A's own (the module's
    engine stays A); the version is new."""
    started = threading.Event()
    call = engine._call

    def watched(coroutine: object, *, what: str) -> object:
        if what == "generate":
            started.set()
        return call(coroutine, what=what)

    engine._call = watched  # type: ignore[method-assign]
    try:  # 48 samples decoding together: the interruption finds them running
        interrupted_generation(engine, PROMPTS * 8, started=started,
                               weights=list(load_file(models[0] / "model.safetensors").items()))
    finally:
        engine._call = call  # type: ignore[method-assign]


def test_a_refused_update_raises_with_the_engines_message(engine: SGLangRolloutEngine) -> None:
    ok, _ = compat.run(engine.engine, compat.weight_update_session(engine.engine, "begin"), 60)
    assert ok  # a session is open: SGLang refuses a second one with (False, message)
    try:
        with pytest.raises(SGLangEngineError, match="a weight-update session is already open"):
            engine.update_weights([[("model.norm.weight", torch.ones(64))]], version=99)
    finally:
        compat.run(engine.engine, compat.weight_update_session(engine.engine, "end"), 60)
    # outside a session the engine refuses any tensor update: our error carries its message
    payloads = engine._payloads([("model.norm.weight", torch.ones(64))])
    request = compat.update_weights_from_tensor(engine.engine, payloads, load_format="flattened_bucket",
                                                flush_cache=True, weight_version=None)
    with pytest.raises(SGLangEngineError, match="must run between begin_weight_update"):
        engine._ok(compat.run(engine.engine, request, 60))
    assert engine.version != 99


def test_unknown_names_and_shapes_are_rejected_before_sglang_sees_them(engine: SGLangRolloutEngine) -> None:
    # SGLang itself skips an unknown name silently and dies (AssertionError in its scheduler) on a bad shape
    with pytest.raises(KeyError, match="model.layers.99"):
        engine.update_weights([[("model.layers.99.mlp.up_proj.weight", torch.zeros(1))]], version=98)
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.update_weights([[("model.norm.weight", torch.zeros(3))]], version=98)
    assert engine.version != 98
    assert len(engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=2))) == 1


def test_generate_timeout_names_the_config_key(engine: SGLangRolloutEngine) -> None:
    saved = engine.config.request_timeout_s
    engine.config.request_timeout_s = 1e-4
    try:
        with pytest.raises(SGLangEngineError, match=f"{CONFIG_KEY}.request_timeout_s"):
            engine.generate(PROMPTS * 8, SamplingParams(temperature=1.0, max_new_tokens=64, n=4))
    finally:
        engine.config.request_timeout_s = saved
    engine._wait_until_idle()  # the aborted requests are gone
    assert len(engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=4))) == 3


def test_start_failure_names_the_config_key(models: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(SGLangEngineError, match="actor_rollout_ref.model.path") as e:
        build(tmp_path / "no-such-model")
    assert CONFIG_KEY in str(e.value)
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    for f in models[0].iterdir():
        (unreadable / f.name).write_bytes(b"not safetensors" if f.suffix == ".safetensors" else f.read_bytes())
    with pytest.raises(SGLangEngineError, match="cannot read the weights") as e:
        build(unreadable)
    assert CONFIG_KEY in str(e.value)


def test_start_failure_inside_the_engine_raises_and_leaves_no_process(engine: SGLangRolloutEngine,
                                                                      models: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    # model A's config with the weights of a narrower model: SGLang's scheduler fails while loading them
    broken = make_tiny_model(tmp_path / "broken", hidden=32, layers=2, heads=4, kv_heads=2, max_positions=128)
    (broken / "config.json").write_bytes((models[0] / "config.json").read_bytes())
    before = {p.pid for p in compat.new_children(set())}
    with compat.contexts_made() as made, \
            pytest.raises(SGLangEngineError, match="the SGLang engine failed to start") as e:
        build(broken)  # SGLang's own SIGQUIT handler would SIGKILL this (the trainer's) process
    assert CONFIG_KEY in str(e.value)
    # its IPC contexts are destroyed now, not by a later garbage collection (which can hang: compat item 9)
    assert made and [c for c in made if not c.closed] == []
    time.sleep(1)
    assert compat.new_children(before) == []
    assert len(engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=2))) == 1


def test_config_is_validated_by_the_plugin(models: tuple[Path, Path]) -> None:
    for kw, message in [({"dtype": "fp8"}, "dtype='fp8'; valid: auto, float32, bfloat16, float16"),
                        ({"release_weights": True, "enable_memory_saver": False},
                         "release_weights=true needs enable_memory_saver"),
                        ({"server_args": {"tp_size": 2}}, "server_args may not set \\['tp_size'\\]"),
                        ({"request_timeout_s": 0}, "request_timeout_s=0 must be > 0"),
                        ({"cpu_threads": 0}, "cpu_threads=0 must be ≥ 1"),
                        ({"update_weights_load_format": "disk"}, "valid: flattened_bucket, tensors")]:
        with pytest.raises(PluginConfigError, match=message):
            build(models[0], **kw)
    with pytest.raises(SGLangEngineError, match=f"{CONFIG_KEY}.enable_memory_saver=true needs a CUDA device"):
        build(models[0], enable_memory_saver=True)
    with pytest.raises(SGLangEngineError, match="enable_deterministic_inference=true needs a CUDA/XPU device"):
        build(models[0], enable_deterministic_inference=True)


# ---- the engine's processes never outlive the trainer: scripts in subprocesses ----
MARK = "HYBRIDRL_SGLANG_TEST_MARK"  # inherited by the script's engine processes: finds any survivor
SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from hybridrl.interfaces import SamplingParams
    from hybridrl.registry import Registry

    if __name__ == "__main__":
        mode, model = sys.argv[1], sys.argv[2]
        eng = Registry("rollout_engines").build("sglang", {}, key="actor_rollout_ref.rollout.engine_kwargs",
                                                model_path=model, device=torch.device("cpu"))
        print("PIDS", json.dumps([p.pid for p in eng.procs]), flush=True)
        eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=4))
        if mode == "crash":  # the scheduler dies under a call: the call fails with a clear error
            os.kill(eng.procs[0].pid, 9)
            eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=4))
        if mode == "sigterm":
            print("READY", flush=True)
            while True:  # "training": not inside an engine call
                sum(i * i for i in range(10**5))
""")


Result = tuple[subprocess.CompletedProcess[str], list[int]]


def run_script(tmp: Path, modes_models: dict[str, Path]) -> dict[str, Result]:
    """Run SCRIPT once per mode, concurrently; SIGTERM the ``sigterm`` one once its engine is up."""
    script = tmp / "lifecycle.py"
    script.write_text(SCRIPT)
    procs = {m: subprocess.Popen([sys.executable, str(script), m, str(p)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", MARK: f"{os.getpid()}-{m}"})
             for m, p in modes_models.items()}
    if "sigterm" in procs:
        proc = procs["sigterm"]
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY"):
                break
        proc.send_signal(signal.SIGTERM)
    results = {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if mode == "sigterm":
            out = "".join(lines) + out
        pids = next((json.loads(line[5:]) for line in out.splitlines() if line.startswith("PIDS ")), [])
        results[mode] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), pids)
    return results


def survivors(mode: str) -> list[int]:
    """Processes still running that inherited the script's marker variable (its engine's children did)."""
    def marked() -> list[int]:
        return process_marks.marked(MARK, f"{os.getpid()}-{mode}")

    deadline = time.time() + 10
    while time.time() < deadline and marked():
        time.sleep(0.5)
    return marked()


def test_no_engine_process_outlives_the_trainer(models: tuple[Path, Path], tmp_path: Path) -> None:
    """``sigterm`` mid-"training" and a ``crash`` of the scheduler under a call: no engine process is left. (A
    trainer that raises shuts its engines down on the way out: tests/faults/test_engine_faults.py; a third engine
    process here made the test slow and flaky on two busy cores: 129 s and a failed engine start in one CI run.)"""
    results = run_script(tmp_path, {"sigterm": models[0], "crash": models[0]})
    for mode, (proc, pids) in results.items():
        assert len(pids) >= 2, (mode, proc.stdout, proc.stderr[-3000:])  # scheduler + detokenizer
        assert survivors(mode) == [], (mode, proc.stderr[-3000:])
    assert results["sigterm"][0].returncode == -signal.SIGTERM, results["sigterm"][0].stderr[-3000:]
    crashed, _ = results["crash"]
    assert crashed.returncode == 1, crashed.stderr[-3000:]  # not -9: SGLang's own handler SIGKILLs the trainer
    assert "SGLangEngineError" in crashed.stderr and "died" in crashed.stderr and CONFIG_KEY in crashed.stderr
