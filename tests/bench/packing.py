"""Benchmark: packed rows (``use_remove_padding``) against padded ones, on long-tailed response lengths.

    python tests/bench/packing.py [--steps 5] [--budget 2048]

Workload (fixed): a random tiny Qwen2 (hidden 128, 4 layers, the grpo_tiny start model's shape), one process (gloo
world of 1), 1 torch thread; 128 samples, 8 per prompt, lengths long-tailed like real rollouts — prompts of 8–24
tokens, responses geometric with mean ~25 and a tail to the 100-token limit (~2 % reach it). Timed: the actor's
log-prob pass and one optimizer step over the whole batch in four layouts — padded micro-batches of 16 samples
(every row as long as the batch's longest), padded token-budget micro-batches (``use_dynamic_bsz``: each padded to
its own longest row), packed micro-batches of 16 samples, packed token-budget micro-batches (summed lengths ≤
``--budget``). Reports each layout's computed positions, seconds (median over ``--steps`` after one warm-up) and
response tokens per CPU-second of the update, the ratios against padded, and that every layout gives the same
log-probs. CPU seconds are the process's (``time.process_time``).
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

SAMPLES, MICRO, MAX_RESPONSE = 128, 16, 100


def long_tailed_batch(vocab: int, pad: int, seed: int = 0):  # -> RolloutBatch
    from hybridrl.batch import RolloutBatch, SampleMeta

    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(8, 25, (SAMPLES // 8,), generator=g).repeat_interleave(8)
    # geometric: P(stop) = 1/25 per token, cut at the limit (a sixth of the samples run into it)
    response_len = (torch.distributions.Geometric(torch.tensor(1 / 25)).sample((SAMPLES,)).long() + 1) \
        .clamp(max=MAX_RESPONSE)
    P, T = int(prompt_len.max()), MAX_RESPONSE
    prompt_ids, prompt_mask = torch.full((SAMPLES, P), pad), torch.zeros(SAMPLES, P, dtype=torch.long)
    response_ids, response_mask = torch.full((SAMPLES, T), pad), torch.zeros(SAMPLES, T, dtype=torch.long)
    for b in range(SAMPLES):
        p, r = int(prompt_len[b]), int(response_len[b])
        prompt_ids[b, P - p:], prompt_mask[b, P - p:] = torch.randint(0, pad, (p,), generator=g), 1
        response_ids[b, :r], response_mask[b, :r] = torch.randint(0, pad, (r,), generator=g), 1
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
    torch.manual_seed(0)
    from transformers import AutoConfig

    from hybridrl.bootstrap import TINY_MODEL
    from hybridrl.megatron.config import MegatronConfig, MicroBatching, OptimConfig
    from hybridrl.megatron.parallel import ParallelConfig, destroy_parallel, init_parallel, seed_everything
    from hybridrl.megatron.policy import MegatronPolicy
    from hybridrl.models.tiny import make_tiny_model

    init_parallel(ParallelConfig())
    seed_everything(0)
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_model(Path(d) / "model", **{**TINY_MODEL, "max_positions": 256})  # type: ignore[arg-type]
        pad = AutoConfig.from_pretrained(model).pad_token_id
        policy = MegatronPolicy(model_dir=str(model), megatron=MegatronConfig(), optim=OptimConfig(lr=0.0),
                                total_steps=args.steps + 2, pad_token_id=pad)
    batch = long_tailed_batch(policy.arch.vocab_size, pad=pad)
    batch.old_logprobs = torch.zeros_like(batch.rollout_logprobs)
    response_tokens = int(batch.response_mask.sum())
    lengths = batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)
    print(f"{SAMPLES} samples, {int(lengths.sum())} real tokens ({response_tokens} response tokens); responses: "
          f"median {int(batch.response_mask.sum(-1).median())}, max {int(batch.response_mask.sum(-1).max())}, "
          f"{int((batch.response_mask.sum(-1) == MAX_RESPONSE).sum())} at the limit")

    def loss_fn(logp, ent, mb, *, normalizer):  # token-mean policy-gradient surrogate, global normaliser
        return -(logp * mb.advantages * mb.response_mask).sum() / normalizer, {}

    layouts = {"padded": MicroBatching(micro_batch_size=MICRO),
               "padded+budget": MicroBatching(micro_batch_size=MICRO, max_tokens=args.budget),
               "packed": MicroBatching(micro_batch_size=MICRO, packed=True),
               "packed+budget": MicroBatching(micro_batch_size=MICRO, max_tokens=args.budget, packed=True)}
    times: dict[str, dict[str, list[float]]] = {n: {"log_prob": [], "train": [], "train_cpu": []} for n in layouts}
    results, computed = {}, {}
    for step in range(args.steps + 1):
        for name, batching in layouts.items():
            t0 = time.perf_counter()
            results[name], _ = policy.compute_log_probs(batch, batching=batching)
            t1, c1 = time.perf_counter(), time.process_time()
            policy.train_step(batch, loss_fn, batching=batching, loss_agg_mode="token-mean")
            t2, c2 = time.perf_counter(), time.process_time()
            real, total = policy.padding_tally.pop("update")
            policy.padding_tally.clear()
            computed[name] = (real, total)
            if step:  # the first round warms up
                for key, value in (("log_prob", t1 - t0), ("train", t2 - t1), ("train_cpu", c2 - c1)):
                    times[name][key].append(value)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    base = med["padded"]
    print(f"{'layout':<14} {'positions':>9} {'padding':>8} {'log-prob s':>10} {'update s':>9} "
          f"{'update tok/CPU-s':>16} {'vs padded':>9}")
    for name, m in med.items():
        real, total = computed[name]
        rate = response_tokens / m["train_cpu"]
        print(f"{name:<14} {total:>9} {1 - real / total:>8.1%} {m['log_prob']:>10.3f} {m['train']:>9.3f} "
              f"{rate:>16.0f} {base['train_cpu'] / m['train_cpu']:>8.2f}x")
    diff = max(float((results[n] - results["padded"]).abs().max()) for n in layouts)
    print(f"max |log-prob - padded's| over the layouts: {diff:.1e}")
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
