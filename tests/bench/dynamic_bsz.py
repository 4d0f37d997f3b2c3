"""Benchmark: token-budget micro-batches (``use_dynamic_bsz``) against fixed-size ones, same batch.

    python tests/bench/dynamic_bsz.py [--steps 5] [--budget 2048]

Workload (fixed): random tiny Qwen2 (hidden 128, 4 layers), one process (gloo world of 1), 1 torch
thread; 128 samples whose lengths are skewed like real rollouts — prompts of 8–24 tokens, most
responses 8–32 tokens, one in eight 160–200 (a long tail that hits the length limit). Timed: the
actor's log-prob pass and one optimizer step over the whole batch, with micro-batches of 16 samples
(every row padded to the batch's longest) and with micro-batches of ≤ ``--budget`` padded tokens.
Also prints the padded tokens each computes and checks that both give the same log-probs.
Prints medians; the ratio fixed / dynamic is measured in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

SAMPLES, MICRO = 128, 16


def skewed_batch(vocab: int, pad: int, seed: int = 0):  # -> RolloutBatch
    from hybridrl.batch import RolloutBatch, SampleMeta

    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(8, 25, (SAMPLES,), generator=g)
    long_tail = torch.rand(SAMPLES, generator=g) < 1 / 8
    response_len = torch.where(long_tail, torch.randint(160, 201, (SAMPLES,), generator=g),
                               torch.randint(8, 33, (SAMPLES,), generator=g))
    P, T = int(prompt_len.max()), int(response_len.max())
    prompt_ids = torch.full((SAMPLES, P), pad)
    prompt_mask = torch.zeros(SAMPLES, P, dtype=torch.long)
    response_ids = torch.full((SAMPLES, T), pad)
    response_mask = torch.zeros(SAMPLES, T, dtype=torch.long)
    for b in range(SAMPLES):
        p, r = int(prompt_len[b]), int(response_len[b])
        prompt_ids[b, P - p:] = torch.randint(0, pad, (p,), generator=g)
        prompt_mask[b, P - p:] = 1
        response_ids[b, :r] = torch.randint(0, pad, (r,), generator=g)
        response_mask[b, :r] = 1
    assert pad < vocab
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, rollout_logprobs=torch.zeros(SAMPLES, T),
                        weight_version=torch.zeros(SAMPLES, dtype=torch.long),
                        group_index=torch.arange(SAMPLES) // 8, meta=[SampleMeta() for _ in range(SAMPLES)],
                        pad_token_id=pad, advantages=torch.randn(SAMPLES, 1, generator=g) * response_mask)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget", type=int, default=2048)
    args = p.parse_args()
    from hybridrl.bootstrap import TINY_MODEL
    from hybridrl.config.schema import MegatronConfig, OptimConfig
    from hybridrl.megatron.dynamic_batch import partition_cost, token_budget_partition
    from hybridrl.megatron.parallel import ParallelConfig, destroy_parallel, init_parallel, seed_everything
    from hybridrl.megatron.policy import MegatronPolicy
    from hybridrl.models.tiny import make_tiny_model

    init_parallel(ParallelConfig())
    seed_everything(0)
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_model(Path(d) / "model", **{**TINY_MODEL, "max_positions": 256})  # type: ignore[arg-type]
        from transformers import AutoConfig

        pad = AutoConfig.from_pretrained(model).pad_token_id
        policy = MegatronPolicy(model_dir=str(model), megatron=MegatronConfig(), optim=OptimConfig(lr=0.0),
                                total_steps=args.steps + 1, pad_token_id=pad)
    batch = skewed_batch(policy.arch.vocab_size, pad=pad)
    batch.old_logprobs = torch.zeros_like(batch.rollout_logprobs)
    lengths = (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).tolist()
    fixed_tokens = SAMPLES * (-(-max(lengths) // 8) * 8)
    parts = token_budget_partition(lengths, max_tokens=args.budget, multiple=8)
    print(f"{SAMPLES} samples, {sum(lengths)} real tokens; padded tokens computed: fixed micro-batches of {MICRO}: "
          f"{fixed_tokens}, token budget {args.budget}: {partition_cost(lengths, parts, 8)} "
          f"in {len(parts)} micro-batches")
    n_tokens = batch.response_mask.sum().float()

    def loss_fn(logp, ent, mb):  # token-mean policy-gradient surrogate, global normaliser
        return -(logp * mb.advantages * mb.response_mask).sum() / n_tokens, {}

    times: dict[str, list[float]] = {k: [] for k in ("fixed/log_prob", "fixed/train", "dynamic/log_prob",
                                                     "dynamic/train")}
    results = {}
    for step in range(args.steps + 1):
        for name, budget in (("fixed", None), ("dynamic", args.budget)):
            t0 = time.perf_counter()
            results[name], _ = policy.compute_log_probs(batch, micro_batch_size=MICRO, max_tokens=budget)
            t1 = time.perf_counter()
            policy.train_step(batch, loss_fn, micro_batch_size=MICRO, max_tokens=budget)
            t2 = time.perf_counter()
            if step:  # the first round warms up
                times[f"{name}/log_prob"].append(t1 - t0)
                times[f"{name}/train"].append(t2 - t1)
    diff = float((results["fixed"] - results["dynamic"]).abs().max())
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:<18} median {v:7.3f} s")
    print(f"ratio fixed / dynamic, median: log-prob pass {med['fixed/log_prob'] / med['dynamic/log_prob']:.2f}x, "
          f"train step {med['fixed/train'] / med['dynamic/train']:.2f}x; max |log-prob diff| {diff:.1e}")
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
