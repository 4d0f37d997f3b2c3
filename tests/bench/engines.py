"""Benchmark: generation throughput of the three rollout engines (``hf``, ``sglang``, ``vllm``) on one model and one
set of prompts.

    python tests/bench/engines.py [--repeats 3] [--engines hf,sglang,vllm]

Workload (fixed): a random tiny Qwen2 (hidden 128, 4 layers, head_dim 32, fp32), 64 prompts of 16 tokens × n=4
samples at temperature 1, seeded; each prompt's length cap is the workload's (``generate(..., max_new_tokens=[...])``):
``short`` — every sample up to 32 tokens; ``long-tail`` — up to 32 tokens, one prompt in eight up to 256 (a tail that
keeps the batch decoding). A random model rarely samples EOS, so most samples run to their cap. Each engine is built
through the registry as a run builds it (its CPU defaults; SGLang and vLLM in processes of their own, one OpenMP
thread each; ``hf`` with 1 torch thread), warmed up with one call, then timed ``--repeats`` times one engine at a
time. Prints the median samples/s and generated tokens/s per engine and workload, and each against ``hf``, all from
one run. Engines that are not installed are reported and skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

PROMPTS, PROMPT_LEN, N = 64, 16, 4
WORKLOADS = {"short": [32] * PROMPTS, "long-tail": [256 if i % 8 == 0 else 32 for i in range(PROMPTS)]}
NEEDS = {"sglang": "sglang", "vllm": "vllm"}  # engine -> module it needs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="hf,sglang,vllm")
    args = ap.parse_args()
    from hybridrl.interfaces import SamplingParams
    from hybridrl.models.tiny import make_tiny_model
    from hybridrl.registry import Registry

    names = args.engines.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", hidden=128, layers=4, heads=4, kv_heads=2, max_positions=512)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 90, (PROMPT_LEN,), generator=g).tolist() for _ in range(PROMPTS)]
        params = SamplingParams(temperature=1.0, max_new_tokens=max(max(c) for c in WORKLOADS.values()), n=N)
        results: dict[tuple[str, str], tuple[float, float]] = {}
        for name in names:
            if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
                print(f"{name}: not installed (launch/install_{name}_cpu.sh); skipped")
                continue
            t0 = time.perf_counter()
            engine = Registry("rollout_engines").build(name, {}, key="actor_rollout_ref.rollout.engine_kwargs",
                                                       model_path=str(model), device=torch.device("cpu"))
            print(f"{name}: started in {time.perf_counter() - t0:.1f} s", flush=True)
            try:
                engine.generate(prompts[:8], params, seeds=list(range(8)), max_new_tokens=[8] * 8)  # warm-up
                for workload, caps in WORKLOADS.items():
                    times, tokens = [], 0
                    for r in range(args.repeats):
                        t0 = time.perf_counter()
                        gens = engine.generate(prompts, params, seeds=[1000 * r + i for i in range(PROMPTS)],
                                               max_new_tokens=caps)
                        times.append(time.perf_counter() - t0)
                        tokens = sum(len(x.token_ids) for x in gens)
                        print(f"  {name} {workload} repeat {r + 1}/{args.repeats}: {times[-1]:.2f} s, "
                              f"{tokens} tokens", flush=True)
                    med = statistics.median(times)
                    results[(name, workload)] = (PROMPTS * N / med, tokens / med)
            finally:
                engine.shutdown()
    print(f"\nmedian of {args.repeats}; {PROMPTS} prompts × n={N}, 1 thread per engine")
    print(f"{'engine':8} {'workload':10} {'samples/s':>10} {'tokens/s':>10} {'× hf':>6}")
    for (name, workload), (sps, tps) in results.items():
        base = results.get(("hf", workload))
        ratio = f"{tps / base[1]:.2f}" if base else "-"
        print(f"{name:8} {workload:10} {sps:10.1f} {tps:10.0f} {ratio:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
