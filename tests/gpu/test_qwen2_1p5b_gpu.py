"""(b) A real-size model on one GPU: a random-weight Qwen2 with Qwen2.5-1.5B's shapes (28 layers, hidden
1536, MLP 8960, 12 heads / 2 KV heads, vocab 151936, tied embeddings; ``qwen2.5-1.5b.json``), made
offline with ``hybridrl make-tiny-model`` (fp32 weights, ~6 GB; ``run_all.sh`` starts making it in the
background while the first check runs).

``test_rl_step``: two RL steps (``qwen2_1p5b_overrides``: bf16, ``param/grad/optimizer_offload`` and the
ref's ``param_offload`` on, 16 prompts × 8 samples × ≤ 256 tokens), built and run in this process so
the engine and the memory can be watched. Figures of step 2 (step 1 carries the warm-up): tokens/s of
the whole step; MFU of the actor update = 6·N·tokens / (update time − its offload reload) / the H200's
dense bf16 peak (989 TFLOP/s, datasheet); peak memory (``torch.cuda.max_memory_allocated`` of this
process over both steps; with sglang the engine's own memory is in its process); memory in use while
the engine generates (what offload leaves on the device); the weight sync (time, GB/s) and whether it
was in place (the engine's parameter ``data_ptr``s unchanged). With ``sglang`` (``--full``, TE spec):
also the device memory around ``release_memory`` and the engine's swap time.

``test_verify_model``: ``hybridrl verify-model`` of the same model. It launches its own rank with
torchrun; on a CUDA machine that rank uses NCCL and builds the Megatron model (fp32) on the GPU,
while transformers' reference logits are computed in fp32 on the CPU; then the bucketed weight
export is compared bit for bit with the safetensors file.
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_checks import (  # tests/gpu is on sys.path under pytest
    H200_BF16_PEAK_TFLOPS,
    REPO,
    check_named,
    last_error,
    qwen2_1p5b_model,
    qwen2_1p5b_overrides,
    read_metrics,
    report,
    verify_command,
    work_dir,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: GPU checks run with tests/gpu/run_all.sh on a GPU machine"),
]
GiB = 2**30
# what offload may leave on the device while the engine generates, besides the engine's own weights
# (in this process only with the hf engine): RNG states, rotary tables, small buffers
RESIDUAL_WHILE_GENERATING = 2 * GiB


@pytest.fixture(scope="module")
def model() -> Path:
    return qwen2_1p5b_model(work_dir())


def spy(obj: Any, name: str, before: Callable[[], None] | None = None,
        after: Callable[[float], None] | None = None) -> None:
    """Wrap ``obj.name``: ``before()`` ahead of each call, ``after(seconds)`` once it returned."""
    inner = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        if after is not None:
            after(time.perf_counter() - t0)
        return out

    setattr(obj, name, wrapped)


def device_used() -> int:
    """Bytes in use on the device by every process (the sglang engine's too)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.mark.parametrize("engine", ["hf", pytest.param("sglang", marks=pytest.mark.sglang)])
def test_rl_step(model: Path, engine: str) -> None:
    name = "qwen2_1p5b_rl_step" if engine == "hf" else "qwen2_1p5b_rl_step_sglang_te"
    if engine == "sglang":
        missing = [m for m in ("sglang", "transformer_engine") if importlib.util.find_spec(m) is None]
        if missing:
            report(check=name, figure=f"not run: {' and '.join(missing)} not installed (a full GPU environment: "
                                      "pip install 'hybridrl[sglang,te]')")
            pytest.fail(f"{name} needs {missing}")
    # imported here, not at the top: collecting this file on CPU CI then costs no Megatron import
    from safetensors import safe_open

    from hybridrl.bootstrap import write_arithmetic_task
    from hybridrl.config.compose import compose_config
    from hybridrl.config.validate import validate
    from hybridrl.megatron.model import use_transformer_engine
    from hybridrl.megatron.parallel import destroy_parallel
    from hybridrl.trainers.components import build_components
    from hybridrl.trainers.rl import fit

    work = work_dir()
    if not (work / "data" / "train.parquet").exists():
        (work / "data").mkdir(parents=True, exist_ok=True)
        write_arithmetic_task(work / "data" / "train.parquet")
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        n_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    cfg = compose_config(qwen2_1p5b_overrides(work, engine))
    plan = validate(cfg, world_size=1)
    spec = "TE spec" if use_transformer_engine() else "local spec"
    t0 = time.perf_counter()
    try:
        c = build_components(cfg, plan)
    except Exception as e:
        report(check=name, figure=f"building actor, ref and engine failed: {type(e).__name__}: {e}"[:400])
        raise
    build_s = time.perf_counter() - t0
    seen: dict[str, Any] = {"gen_alloc": [], "gen_used": [], "reload_s": [], "release": []}
    try:
        eng = c.rollout.workers.engines.engine  # the single-turn rollout's colocated engine
        assert eng is not None
        in_update = [False]
        spy(eng, "generate", before=lambda: (seen["gen_alloc"].append(torch.cuda.memory_allocated()),
                                             seen["gen_used"].append(device_used())))
        spy(c.hybrid, "update_actor", before=lambda: in_update.__setitem__(0, True),
            after=lambda s: in_update.__setitem__(0, False))
        spy(c.hybrid.actor_offload, "reload",
            after=lambda s: seen["reload_s"].append(s) if in_update[0] else None)
        if engine == "sglang":
            before_release: list[int] = []
            spy(eng, "release_memory", before=lambda: before_release.append(device_used()),
                after=lambda s: seen["release"].append((before_release[-1], device_used())))
        storage_before = _engine_storage(eng, engine)
        probe = "model.layers.0.self_attn.q_proj.weight"
        weight_before = eng.params[probe].detach().clone() if engine == "hf" else None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        try:
            last = fit(c)
        except Exception as e:
            report(check=name, figure=f"the RL steps failed: {type(e).__name__}: {e}"[:400])
            raise
        peak = torch.cuda.max_memory_allocated()
        storage_after = _engine_storage(eng, engine)
        changed = None if weight_before is None else not torch.equal(weight_before, eng.params[probe])
        version = eng.version
    finally:
        c.close()
        destroy_parallel()

    rows = [r for r in read_metrics(Path(cfg.trainer.output_dir)) if "reward/mean" in r]
    tokens = last["perf/tokens_per_s"] * last["timing/step"]
    reload_s = seen["reload_s"][-1] if seen["reload_s"] else 0.0  # step 2's reload inside update_actor
    update_s = last["timing/update_actor"] - reload_s
    mfu = 6 * n_params * tokens / update_s / (H200_BF16_PEAK_TFLOPS * 1e12)
    sync_gb = last["perf/weight_sync_mb"] / 1024
    in_place = storage_before == storage_after
    engine_bytes = 2 * n_params if engine == "hf" else 0  # the hf engine's bf16 weights live in this process
    gen_alloc = seen["gen_alloc"][-1]
    figure = (f"{n_params / 1e9:.2f}B params, {spec}, bf16, all offload on, {engine} engine | step 2: "
              f"{last['perf/tokens_per_s']:,.0f} tokens/s ({tokens:,.0f} tokens in {last['timing/step']:.1f} s), "
              f"update MFU {100 * mfu:.0f}% of {H200_BF16_PEAK_TFLOPS:.0f} TFLOP/s (H200 dense bf16 peak) in "
              f"{update_s:.2f} s + {reload_s:.2f} s reload | peak {peak / GiB:.1f} GiB, {gen_alloc / GiB:.1f} GiB "
              f"allocated while generating | weight sync {sync_gb:.2f} GiB in {last['timing/sync_weights']:.2f} s "
              f"({sync_gb / last['timing/sync_weights']:.1f} GiB/s), {'in place' if in_place else 'NOT in place'} | "
              f"logprob_abs_diff {last['rollout/logprob_abs_diff']:.1e} | build {build_s:.0f} s")
    details: dict[str, Any] = {}
    if engine == "sglang":
        used_before, used_after = seen["release"][-1]
        details = dict(release_freed_gib=(used_before - used_after) / GiB, swap_s=eng.last_update.get("seconds"))
        figure += (f" | release_memory: {used_before / GiB:.1f} → {used_after / GiB:.1f} GiB in use on the device, "
                   f"swap {details['swap_s']:.2f} s, weight_version {version}")
    report(check=name, figure=figure, params=n_params, tokens=tokens, tokens_per_s=last["perf/tokens_per_s"],
           mfu=mfu, peak_gib=peak / GiB, allocated_while_generating_gib=gen_alloc / GiB,
           device_used_while_generating_gib=seen["gen_used"][-1] / GiB, sync_s=last["timing/sync_weights"],
           sync_gib=sync_gb, in_place=in_place, weights_changed=changed, spec=spec, **details)

    assert len(rows) == 2 and all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float)), rows
    assert in_place, "the weight sync reallocated the engine's parameters (data_ptr changed)"
    assert [r["rollout/weight_version"] for r in rows] == [0, 1] and version == 2
    assert changed is not False, f"the synced engine weights equal the start weights ({probe})"
    assert gen_alloc <= engine_bytes + RESIDUAL_WHILE_GENERATING, (
        f"{gen_alloc / GiB:.1f} GiB stay allocated while the engine generates: offload left the actor/ref state "
        f"on the device (expected ≤ {(engine_bytes + RESIDUAL_WHILE_GENERATING) / GiB:.1f} GiB)")
    if engine == "sglang":
        assert spec == "TE spec", f"expected Transformer Engine's layer spec, got the {spec}"
        assert details["release_freed_gib"] > 1, "release_memory freed (almost) nothing with enable_memory_saver"


def _engine_storage(eng: Any, engine: str) -> dict[str, int]:
    """``{name: data_ptr}`` of the engine's parameters (the sglang engine's read in its scheduler process)."""
    if engine == "hf":
        return {n: p.data_ptr() for n, p in eng.params.items()}
    from rollout.engines.sglang_probes import STORAGE_REPORTER, parameter_storage  # tests/ is on sys.path

    assert STORAGE_REPORTER == "rollout.engines.sglang_probes.report_parameter_storage", STORAGE_REPORTER
    return parameter_storage(eng)


def test_verify_model(model: Path) -> None:
    cmd = verify_command(model)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False,
                          timeout=check_named("qwen2_1p5b_verify").timeout_s - 10)
    seconds = time.perf_counter() - t0
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    found = re.search(r"^max_abs_logit_diff=(\S+) roundtrip=(\S+)$", proc.stdout, re.M)
    if found is None:
        report(check="qwen2_1p5b_verify", figure=f"verify-model exited {proc.returncode}: "
                                                 f"{last_error(proc.stderr + proc.stdout)}")
        pytest.fail(f"{' '.join(cmd)} printed no result line")
    figure = (f"max |Δlogit| {float(found[1]):.1e} (Megatron fp32 on the GPU, one NCCL rank, vs transformers fp32 "
              f"on the CPU; limit 1e-4), round trip {found[2]}, {seconds:.0f} s")
    report(check="qwen2_1p5b_verify", figure=figure, max_abs_logit_diff=float(found[1]), roundtrip=found[2],
           seconds=seconds)
    assert proc.returncode == 0, f"verify-model exited {proc.returncode}"
