"""SGLang engine checks that need a CUDA device; run by hand with ``bash tests/gpu/run_all.sh``.

- a real colocated swap: the engine shares the GPU with the "actor" (a transformers copy of the new
  weights, on the same device), releases its KV cache and weights with ``enable_memory_saver``, takes
  the actor's CUDA tensors in place, and then samples exactly like a fresh engine on the new weights;
- the time of one in-place swap per GB (bf16, 512 MB buckets, CUDA IPC);
- per-sample seeds (``enable_deterministic_inference``, which the CPU engine lacks): a prompt's samples
  depend on its seed alone, not on where it sits in the call or on the other prompts.
Each test reports one record (``gpu_checks.report``: its line in ``run_all.sh --full``'s table). The
trainer-level checks with the sglang engine (Transformer Engine's spec, offload, a real-size model) are
the ``sglang`` cases of ``test_grpo_tiny_gpu.py`` and ``test_qwen2_1p5b_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_checks import report  # tests/gpu is on sys.path under pytest
from rollout.engines.sglang_probes import SERVER_ARGS, parameter_storage  # tests/ is on sys.path (tests/conftest.py)
from safetensors.torch import load_file

from hybridrl.interfaces import SamplingParams, WeightBucket
from hybridrl.models.tiny import make_tiny_model
from hybridrl.registry import Registry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: GPU tests run by hand with tests/gpu/run_all.sh on a GPU machine"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason="SGLang is not installed: on a GPU machine `pip install 'hybridrl[sglang]'`"),
]
KEY = "actor_rollout_ref.rollout.engine_kwargs"
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def build(path: Path, gpu_memory_utilization: float = 0.5, **kw: Any) -> Any:
    return Registry("rollout_engines").build("sglang", kw, key=KEY, model_path=str(path),
                                             device=torch.device("cuda", 0),
                                             gpu_memory_utilization=gpu_memory_utilization)


def buckets_of(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> Iterator[WeightBucket]:
    bucket: WeightBucket = []
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        if bucket and size + t.numel() * t.element_size() > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("gpu_small")
    kw: dict[str, Any] = dict(hidden=256, layers=4, heads=8, kv_heads=4, max_positions=256)
    return make_tiny_model(tmp / "a", seed=1, **kw), make_tiny_model(tmp / "b", seed=2, **kw)


def test_colocated_swap_with_memory_saver(small: tuple[Path, Path]) -> None:
    a, b = small
    actor = {n: t.cuda() for n, t in load_file(b / "model.safetensors").items()}  # the trainer's copy, same GPU
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    eng = build(a, dtype="float32", enable_memory_saver=True, release_weights=True, gpu_memory_utilization=0.3,
                server_args=SERVER_ARGS)
    try:
        before = eng.generate(PROMPTS, params)
        storage = parameter_storage(eng)
        torch.cuda.synchronize()
        free_0 = torch.cuda.mem_get_info()[0]
        eng.release_memory()  # KV cache, then weights
        free_1 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        eng.update_weights(buckets_of(actor, 1 << 20), version=1)  # resumes the weights first, then loads
        swap_s = time.perf_counter() - t0
        eng.resume_memory()
        after = eng.generate(PROMPTS, params)
        parameter_storage_kept = parameter_storage(eng) == storage  # the memory saver keeps virtual addresses
    finally:
        eng.shutdown()
    fresh = build(b, dtype="float32")
    try:
        want = fresh.generate(PROMPTS, params)
    finally:
        fresh.shutdown()
    freed_gb = (free_1 - free_0) / 2**30
    diff = max(abs(x - y) for g, w in zip(after, want, strict=True)
               for x, y in zip(g.logprobs, w.logprobs, strict=False))
    report(check="sglang_swap_memory_saver",
           figure=f"release_memory freed {freed_gb:.2f} GiB; swap {swap_s:.3f} s, "
                  f"{'in place' if parameter_storage_kept else 'NOT in place'}; max |Δ logprob| vs a fresh engine "
                  f"{diff:.1e}; weight_version {sorted({g.weight_version for g in after})}",
           freed_gb=round(freed_gb, 3), swap_s=round(swap_s, 4), max_logprob_diff_vs_fresh=diff)
    assert parameter_storage_kept, "the swap reallocated the engine's parameters (data_ptr changed)"
    assert freed_gb > 0.1, "release_memory freed (almost) nothing with enable_memory_saver"
    assert [g.token_ids for g in after] == [g.token_ids for g in want]
    assert all(abs(x - y) <= 1e-4 for g, w in zip(after, want, strict=True)
               for x, y in zip(g.logprobs, w.logprobs, strict=True))
    assert [g.token_ids for g in after] != [g.token_ids for g in before] or \
        [g.logprobs for g in after] != [g.logprobs for g in before]
    assert {g.weight_version for g in after} == {1}


def test_swap_time_per_gb(tmp_path: Path) -> None:
    # ~0.5 B parameters: ~1 GB in bf16 (a char vocabulary keeps the embedding tiny)
    model = make_tiny_model(tmp_path / "big", hidden=2048, layers=10, heads=16, kv_heads=4, intermediate=5632,
                            max_positions=256)
    actor = {n: t.to("cuda", torch.bfloat16) for n, t in load_file(model / "model.safetensors").items()}
    gb = sum(t.numel() * t.element_size() for t in actor.values()) / 2**30
    eng = build(model, dtype="bfloat16", enable_memory_saver=True, gpu_memory_utilization=0.5)
    try:
        start_s = eng.start_seconds
        times = []
        for version in range(1, 5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.update_weights(buckets_of(actor, 512 << 20), version=version)
            times.append(time.perf_counter() - t0)
        out = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=4))
    finally:
        eng.shutdown()
    median = statistics.median(times[1:])  # the first includes warm-up
    report(check="sglang_swap_time_per_gb",
           figure=f"{median / gb:.3f} s per GiB ({gb:.2f} GiB bf16 in {median:.3f} s, median of swaps 2-4); "
                  f"engine start {start_s:.0f} s",
           gb=round(gb, 3), seconds=[round(t, 4) for t in times], seconds_per_gb=round(median / gb, 4),
           engine_start_s=round(start_s, 1))
    assert {g.weight_version for g in out} == {4}


def test_per_sample_seeds_fix_each_prompts_samples(small: tuple[Path, Path]) -> None:
    eng = build(small[0], enable_deterministic_inference=True, gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, n=2)
    try:
        first = [g.token_ids for g in eng.generate(PROMPTS, params, seeds=[11, 12, 13])]
        moved = [g.token_ids for g in eng.generate(PROMPTS[::-1], params, seeds=[13, 12, 11])]
        fewer = [g.token_ids for g in eng.generate(PROMPTS[1:], params, seeds=[12, 13])]
        other = [g.token_ids for g in eng.generate(PROMPTS, params, seeds=[21, 22, 23])]
    finally:
        eng.shutdown()
    same_moved, same_fewer = moved == first[4:] + first[2:4] + first[:2], fewer == first[2:]
    report(check="sglang_per_sample_seeds",
           figure=f"same samples when a prompt moves: {same_moved}; with fewer prompts: {same_fewer}",
           same_when_moved=same_moved, same_with_fewer_prompts=same_fewer)
    assert moved == first[4:] + first[2:4] + first[:2]  # prompt-major, n=2 per prompt
    assert fewer == first[2:]
    assert first[0] != first[1]  # the samples of one prompt differ
    assert other != first
