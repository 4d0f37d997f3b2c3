"""Worker: vocab-parallel log-prob/entropy, top-k log-probs and log-probs at given ids (values and grads) vs a
full-vocab torch reference."""

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hybridrl.megatron.parallel import ParallelConfig, destroy_parallel, init_parallel
from hybridrl.megatron.vocab_parallel import vocab_parallel_logprob_entropy
from hybridrl.megatron.vocab_topk import vocab_parallel_logprobs_at, vocab_parallel_topk

torch.set_num_threads(1)
tp = int(sys.argv[1])
init_parallel(ParallelConfig(tensor_model_parallel_size=tp))
rank = parallel_state.get_tensor_model_parallel_rank()
g = torch.Generator().manual_seed(0)
N, vocab, padded = 7, 10, 12  # 2 padding columns, in the last shard
full_NV = torch.randn(N, padded, generator=g, dtype=torch.float64).float() * 3
target_N = torch.randint(0, vocab, (N,), generator=g)
w_logp, w_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
for temperature in (1.0, 0.7):
    ref = full_NV[:, :vocab].clone().requires_grad_(True)
    logp_ref = torch.log_softmax(ref / temperature, -1)
    lp_ref = logp_ref.gather(-1, target_N[:, None]).squeeze(-1)
    ent_ref = -(logp_ref.exp() * logp_ref).sum(-1)
    (lp_ref * w_logp + ent_ref * w_ent).sum().backward()

    v = padded // tp
    local = full_NV[:, rank * v:(rank + 1) * v].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprob_entropy(local, target_N, vocab_size=vocab, temperature=temperature)
    (lp * w_logp + ent * w_ent).sum().backward()
    grad_full = torch.cat([ref.grad, torch.zeros(N, padded - vocab)], -1)[:, rank * v:(rank + 1) * v]
    errs = [(lp - lp_ref).abs().max().item(), (ent - ent_ref).abs().max().item(),
            (local.grad - grad_full).abs().max().item()]
    if dist.get_rank() == 0:
        print(f"T={temperature} max errors logp/entropy/grad: {errs}")
    assert max(errs) < 1e-5, errs

# the top-k distillation loss's pair (hybridrl.megatron.vocab_topk)
full_NV[:, vocab:] = 50.0  # padding columns far above the rest: they must never be chosen nor counted
v = padded // tp
for temperature, k in ((1.0, 4), (0.7, 8)):  # k = 8 > one TP=2 shard's 6 columns
    logp_ref_NV = torch.log_softmax(full_NV[:, :vocab] / temperature, -1)
    want_logp, want_ids = logp_ref_NV.topk(k, dim=-1)
    local = full_NV[:, rank * v:(rank + 1) * v]
    logp_NK, ids_NK = vocab_parallel_topk(local, k, vocab_size=vocab, temperature=temperature)
    assert torch.equal(ids_NK, want_ids), (ids_NK, want_ids)
    topk_err = (logp_NK - want_logp).abs().max().item()

    # log-probs at other ids (the student's at the teacher's top-k), with gradient
    ids = torch.randint(0, vocab, (N, k), generator=g)
    w_NK = torch.randn(N, k, generator=g)
    ref = full_NV[:, :vocab].clone().requires_grad_(True)
    at_ref = torch.log_softmax(ref / temperature, -1).gather(-1, ids)
    (at_ref * w_NK).sum().backward()
    mine = local.clone().requires_grad_(True)
    at = vocab_parallel_logprobs_at(mine, ids, vocab_size=vocab, temperature=temperature)
    (at * w_NK).sum().backward()
    grad_full = torch.cat([ref.grad, torch.zeros(N, padded - vocab)], -1)[:, rank * v:(rank + 1) * v]
    errs = [topk_err, (at - at_ref).abs().max().item(), (mine.grad - grad_full).abs().max().item()]
    if dist.get_rank() == 0:
        print(f"T={temperature} k={k} max errors topk/at/grad: {errs}")
    assert max(errs) < 1e-5, errs
try:
    vocab_parallel_topk(full_NV[:, rank * v:(rank + 1) * v], vocab + 1, vocab_size=vocab)
except ValueError as e:
    assert "at most the vocabulary size" in str(e), e
else:
    raise AssertionError("top-k over the vocabulary size was not refused")
destroy_parallel()
print("OK")
