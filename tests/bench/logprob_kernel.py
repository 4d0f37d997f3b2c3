"""Benchmark: the fused log-prob + entropy kernels (hybridrl.ops) against the current path, peak memory and time.

    python tests/bench/logprob_kernel.py [--tokens 4096] [--vocab 151936] [--hidden 1024] [--repeats 3]

Workload: an LM head of ``--vocab`` columns (weight [V, h], fp32) over ``--tokens`` hidden states [N, h], the
loss Σ log p(target) + 0.01 Σ H, forward and backward (gradients of hidden and weight), 1 torch thread.
Variants, each in its own process (so peak RSS is its own):
  current        logits = hidden @ weightᵀ, then ``vocab_parallel_logprob_entropy`` as the policy calls it
                 today (fp32 z, e, p saved for backward; the [N, V] logits and their gradient)
  fused_logits   the same logits, then the C++ kernel as the policy runs it (``use_fused_kernels``, with
                 ``consume_logits``: the gradient overwrites the logits, no second [N, V] tensor)
  fused_lm_head  ``lm_head_logprob_entropy``: chunks of vocabulary columns, [N, V] never held whole
Peak memory: the process's peak RSS (ru_maxrss) after the steps minus its resident memory before them
(inputs, torch and Megatron already resident; nothing before peaks higher), i.e. what a step adds at its
peak. Time: wall and CPU seconds per step, medians over ``--repeats`` steps (the kernel is built and loaded
before timing; nothing is JIT-compiled). The ratios current / variant are printed last.
At the default sizes one [N, V] fp32 tensor is 2.5 GB and the current path holds several at once: it needs
~15 GB free; use --tokens to scale down (memory scales with tokens except the weight and its gradient).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

VARIANTS = ("current", "fused_logits", "fused_lm_head")


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _rss_now_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(variant: str, tokens: int, vocab: int, hidden: int, repeats: int) -> dict[str, object]:
    import torch

    torch.set_num_threads(1)
    from hybridrl.megatron.parallel import ParallelConfig, init_parallel
    from hybridrl.megatron.vocab_parallel import vocab_parallel_logprob_entropy
    from hybridrl.ops import compiled_kernels, lm_head_logprob_entropy

    init_parallel(ParallelConfig())  # a world of 1: the current path reads Megatron's TP group
    if variant != "current":
        assert compiled_kernels(torch.device("cpu")) is not None, "the C++ kernels did not build"
    g = torch.Generator().manual_seed(0)
    hidden_Nh = torch.randn(tokens, hidden, generator=g).requires_grad_(True)
    weight_Vh = torch.randn(vocab, hidden, generator=g).mul_(hidden**-0.5).requires_grad_(True)
    target_N = torch.randint(0, vocab, (tokens,), generator=g)

    def step() -> torch.Tensor:
        if variant == "fused_lm_head":
            lp, ent = lm_head_logprob_entropy(hidden_Nh, weight_Vh, target_N, vocab_size=vocab)
        else:
            lp, ent = vocab_parallel_logprob_entropy(hidden_Nh @ weight_Vh.t(), target_N, vocab_size=vocab,
                                                     fused=variant == "fused_logits",
                                                     consume_logits=variant == "fused_logits")
        (lp.sum() + 0.01 * ent.sum()).backward()
        return lp.detach()

    before, peak_before = _rss_now_bytes(), _rss_peak_bytes()
    wall, cpu, checksum = [], [], 0.0
    for _ in range(repeats):
        hidden_Nh.grad = weight_Vh.grad = None
        t0, c0 = time.perf_counter(), time.process_time()
        checksum = float(step().sum())
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"variant": variant, "peak_added_bytes": _rss_peak_bytes() - before, "resident_before_bytes": before,
            "peak_before_bytes": peak_before,
            "wall_s": wall, "cpu_s": cpu, "logp_sum": checksum,
            "grad_norms": [float(hidden_Nh.grad.norm()), float(weight_Vh.grad.norm())]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.tokens, a.vocab, a.hidden, a.repeats)), flush=True)
        return 0

    variants = a.variants.split(",")
    if bad := [v for v in variants if v not in VARIANTS]:
        ap.error(f"--variants: unknown {bad}; valid: {', '.join(VARIANTS)}")
    print(f"LM head log-prob + entropy, fwd + bwd: tokens {a.tokens}, vocab {a.vocab}, hidden {a.hidden}, fp32, "
          f"1 thread, {a.repeats} step(s) per variant, each variant in its own process", flush=True)
    results: dict[str, dict] = {}
    start = time.perf_counter()
    for i, v in enumerate(variants):
        cmd = [sys.executable, __file__, "--child", v, "--tokens", str(a.tokens), "--vocab", str(a.vocab),
               "--hidden", str(a.hidden), "--repeats", str(a.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(f"{v}: failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        r = results[v] = json.loads(line[len("RESULT "):])
        done = time.perf_counter() - start
        eta = done / (i + 1) * (len(variants) - i - 1)
        print(f"[{i + 1}/{len(variants)}] {v:<14} peak +{r['peak_added_bytes'] / 2**30:6.2f} GiB  "
              f"wall {statistics.median(r['wall_s']):7.2f} s  cpu {statistics.median(r['cpu_s']):7.2f} s (medians)  "
              f"Σlogp {r['logp_sum']:.6e}  |grad h| {r['grad_norms'][0]:.6e}  |grad W| {r['grad_norms'][1]:.6e}  "
              f"({done:.0f} s elapsed, ETA {eta:.0f} s)", flush=True)
    if "current" in results:
        base = results["current"]
        for v, r in results.items():
            if v == "current":
                continue
            print(f"current / {v}: peak memory {base['peak_added_bytes'] / max(r['peak_added_bytes'], 1):.2f}x, "
                  f"wall {statistics.median(base['wall_s']) / statistics.median(r['wall_s']):.2f}x, "
                  f"cpu {statistics.median(base['cpu_s']) / statistics.median(r['cpu_s']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
