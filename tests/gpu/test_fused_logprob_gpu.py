"""Fused log-prob + entropy on CUDA (the Triton kernels of hybridrl/ops/triton_kernels.py): exact, and lighter.

1. Exactness (fp32, small): log-probs, entropies and gradients of the logits form and of the chunked LM-head
   form against fp64 on the GPU (≤ 1e-5 relative: the Triton kernels work in fp32), and the policy's call
   (``vocab_parallel_logprob_entropy(fused=True)``) against the current implementation.
2. The benchmark's sizes on the GPU in bf16: 4,096 tokens, vocabulary 151,936, hidden 1,024, forward +
   backward of hidden @ weightᵀ → log p + 0.01 H: peak ``torch.cuda.max_memory_allocated`` above the inputs
   and time, current path vs the fused LM head (asserted ≥ 4× less memory), the values agreeing to bf16.
Figure: max relative errors, peak memory of both and the ratio, ms per step of both.
"""

from __future__ import annotations

import time

import pytest
import torch
from gpu_checks import report  # tests/gpu is on sys.path under pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: GPU checks run with tests/gpu/run_all.sh on a GPU machine"),
]
CHECK = "fused_logprob"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _step(fn, *inputs: torch.Tensor, w_ent: float = 0.01) -> list[torch.Tensor]:
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    lp, ent = fn(*xs)
    (lp.sum() + w_ent * ent.sum()).backward()
    return [lp.detach(), ent.detach(), *[x.grad for x in xs]]


def _softmax_stats(x: torch.Tensor, target: torch.Tensor, vocab: int, T: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (fp64) log p(target) and entropy of the first ``vocab`` columns of ``x / T``."""
    logp = torch.log_softmax(x.double()[:, :vocab] / T, -1)
    return logp.gather(-1, target[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _exactness(dev: torch.device) -> dict[str, float]:
    from hybridrl.megatron.vocab_parallel import vocab_parallel_logprob_entropy
    from hybridrl.ops import compiled_kernels, lm_head_logprob_entropy, logprob_entropy

    assert compiled_kernels(dev) is not None, "the Triton kernels are unavailable (see the warning)"
    g = torch.Generator(device=dev).manual_seed(0)
    N, h, padded, vocab, T = 256, 64, 5120, 5000, 0.7
    hidden = torch.randn(N, h, device=dev, generator=g)
    weight = torch.randn(padded, h, device=dev, generator=g) * 0.4
    target = torch.randint(0, vocab, (N,), device=dev, generator=g)

    want = _step(lambda hh, ww: _softmax_stats(hh.double() @ ww.double().t(), target, vocab, T), hidden, weight)
    head = _step(lambda hh, ww: lm_head_logprob_entropy(hh, ww, target, vocab_size=vocab, temperature=T,
                                                        chunk_size=1024), hidden, weight)
    logits = hidden @ weight.t()
    want_logits = _step(lambda x: _softmax_stats(x, target, vocab, T), logits)
    got_logits = _step(lambda x: logprob_entropy(x, target, vocab_size=vocab, temperature=T), logits)
    fused = _step(lambda x: vocab_parallel_logprob_entropy(x, target, vocab_size=vocab, temperature=T, fused=True),
                  logits)
    current = _step(lambda x: vocab_parallel_logprob_entropy(x, target, vocab_size=vocab, temperature=T), logits)
    errs = {"head_vs_exact": max(_rel(a, b) for a, b in zip(head, want, strict=True)),
            "logits_vs_exact": max(_rel(a, b) for a, b in zip(got_logits, want_logits, strict=True)),
            "policy_fused_vs_current": max(_rel(a, b) for a, b in zip(fused, current, strict=True))}
    return errs


def _memory_and_time(dev: torch.device) -> dict[str, float]:
    from hybridrl.megatron.vocab_parallel import vocab_parallel_logprob_entropy
    from hybridrl.ops import lm_head_logprob_entropy

    N, V, h = 4096, 151936, 1024
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(N, h, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(V, h, device=dev, generator=g) * h**-0.5).bfloat16().requires_grad_(True)
    target = torch.randint(0, V, (N,), device=dev, generator=g)
    variants = {
        "current": lambda: vocab_parallel_logprob_entropy(hidden @ weight.t(), target, vocab_size=V),
        "fused_lm_head": lambda: lm_head_logprob_entropy(hidden, weight, target, vocab_size=V),
    }
    out: dict[str, float] = {}
    sums = {}
    for name, fn in variants.items():
        times = []
        for _ in range(3):
            hidden.grad = weight.grad = None
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            t0 = time.perf_counter()
            lp, ent = fn()
            (lp.sum() + 0.01 * ent.sum()).backward()
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
            out[f"{name}_peak_gib"] = (torch.cuda.max_memory_allocated(dev) - base) / 2**30
        out[f"{name}_ms"] = sorted(times)[1] * 1e3  # median of 3 (the first includes Triton's compile)
        sums[name] = (lp.sum().item(), hidden.grad.float().norm().item(), weight.grad.float().norm().item())
    out["values_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(sums["fused_lm_head"], sums["current"],
                                                                      strict=True))
    return out


def test_fused_logprob_gpu() -> None:
    from hybridrl.megatron.parallel import ParallelConfig, init_parallel

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    init_parallel(ParallelConfig())  # a world of 1 (NCCL): the current implementation reads Megatron's TP group
    try:
        errs = _exactness(dev)
        mem = _memory_and_time(dev)
    except Exception as e:
        report(check=CHECK, figure=f"failed: {type(e).__name__}: {e}"[:400])
        raise
    ratio = mem["current_peak_gib"] / mem["fused_lm_head_peak_gib"]
    figure = (f"rel err vs fp64: head {errs['head_vs_exact']:.1e}, logits {errs['logits_vs_exact']:.1e}; "
              f"fused vs current {errs['policy_fused_vs_current']:.1e}; 4096x151936x1024 bf16 fwd+bwd: peak "
              f"{mem['current_peak_gib']:.2f} → {mem['fused_lm_head_peak_gib']:.2f} GiB ({ratio:.1f}x), "
              f"{mem['current_ms']:.0f} → {mem['fused_lm_head_ms']:.0f} ms")
    report(check=CHECK, figure=figure, **errs, **mem, memory_ratio=ratio)
    assert errs["head_vs_exact"] <= 1e-5 and errs["logits_vs_exact"] <= 1e-5, errs
    assert errs["policy_fused_vs_current"] <= 1e-5, errs
    assert ratio >= 4, mem
    assert mem["values_rel_diff"] <= 2e-2, mem  # bf16 logits/gradients on both sides
