"""Worker: one actor RL step (old/ref log-probs, PPO mini-batch updates) at the layouts given, saved.

    python -m torch.distributed.run --nproc-per-node N rl_step.py MODEL_DIR OUT_DIR LAYOUT [LAYOUT ...]

A layout is ``tp<a>pp<b>cp<c>``, optionally followed by ``vpp<d>`` (interleaved 1F1B over d model
chunks per stage) and ``-distopt`` (Megatron's distributed optimizer, Adam only: the SGD mode is
skipped) or ``-dyn`` (token-budget micro-batches, ``use_dynamic_bsz``: 2–6 rows of differing padded
lengths each, so PP sends variable activation shapes), then optionally ``-pg`` (shared-prompt rows,
``use_prefix_grouper``: a prompt's samples in one row; with ``-dyn`` a prompt's 4 samples can exceed the
budget and are cut into two rows) or ``-lmh`` (the fused LM head: ``use_fused_kernels`` +
``fused_lm_head``, log-probs from hidden states × the LM-head weight), and ``-pad`` (a padded row per sample,
``use_remove_padding=false``; else each micro-batch's samples are packed in one row); DP is what remains of the
world. Under VPP
the ref's log-prob pass uses micro-batches of 6 (3 per pass, padded to a multiple of PP by the
policy); log-probs don't depend on the micro-batch size, so the TP=1 reference (4) still applies. For
each layout and each ``loss_agg_mode`` the worker builds :class:`ActorRolloutRef` (actor + ref, as the trainer
does), fills a FIXED RolloutBatch (no generation: DP ranks would sample differently) and runs what
``trainer.fit`` runs between generation and weight sync: ``compute_log_probs`` →
``compute_ref_log_probs`` → ``update_actor``. Rank 0 saves ``OUT_DIR/<layout>dp<DP>-<mode>.pt`` with the
old/ref log-probs and entropy of every sample (in the fixed batch's order), the metrics of every
optimizer step and the HF-named weights after the step.

DP sharding is the trainer's: DP rank r gets the r-th contiguous block of prompts with all their
samples, and the update forms its mini-batches from the whole step as one rank does
(:mod:`hybridrl.distributed.dp_batches`, ``balance_batch`` on), so a single-rank layout, given the batch in
its own order, takes the same optimizer steps as every other layout.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.config.plan import Plan
from hybridrl.config.schema import RLConfig
from hybridrl.hybrid import ActorRolloutRef
from hybridrl.megatron.parallel import ParallelConfig, init_parallel, seed_everything
from hybridrl.trainers.components import actor_objective

torch.set_num_threads(1)

PROMPTS, N = 4, 4  # 4 prompts × 4 samples = one RL step of 16 samples
MINI_PROMPTS = 2  # 2 mini-batches of 8 samples
MICRO = 2  # samples per micro-batch per DP rank: 4 (DP=1) or 2 (DP=2) micro-batches per mini-batch
LOGPROB_MICRO = 4
P, T = 9, 10  # prompt / response pad widths
MODES = ("token-mean", "seq-mean-token-mean")


LAYOUT = re.compile(r"tp(\d+)pp(\d+)cp(\d+)(?:vpp(\d+))?(-distopt)?(-dyn)?(-pg)?(-lmh)?(-pad)?")
DYN_BUDGET = 48  # padded tokens per micro-batch: 2 rows of the longest samples (24), up to 6 of the shortest


def parse_layout(name: str) -> tuple[ParallelConfig, bool]:
    """``(parallel layout, distributed optimizer?)`` of a layout name."""
    match = LAYOUT.fullmatch(name)
    assert match, f"layout {name!r} is not tp<a>pp<b>cp<c>[vpp<d>][-distopt][-dyn][-pg][-lmh][-pad]"
    tp, pp, cp, vpp, distopt, _, _, _, _ = match.groups()
    return ParallelConfig(tensor_model_parallel_size=int(tp), pipeline_model_parallel_size=int(pp),
                          context_parallel_size=int(cp),
                          virtual_pipeline_model_parallel_size=int(vpp) if vpp else None), bool(distopt)


def config(model_dir: str, layout: ParallelConfig, mode: str, *, distributed_optimizer: bool = False,
           dynamic_bsz: bool = False, prefix_grouper: bool = False, lm_head: bool = False,
           padded: bool = False) -> RLConfig:
    cfg = RLConfig()
    aor = cfg.actor_rollout_ref
    aor.model.path = model_dir
    for m in (aor.actor.megatron, aor.ref.megatron):
        m.tensor_model_parallel_size = layout.tensor_model_parallel_size
        m.pipeline_model_parallel_size = layout.pipeline_model_parallel_size
        m.virtual_pipeline_model_parallel_size = layout.virtual_pipeline_model_parallel_size
        m.context_parallel_size = layout.context_parallel_size
    aor.actor.megatron.use_distributed_optimizer = distributed_optimizer
    aor.actor.megatron.use_remove_padding = not padded  # the ref's passes follow
    a = aor.actor
    a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.ppo_epochs = MINI_PROMPTS, MICRO, 1
    a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu = dynamic_bsz, DYN_BUDGET  # also the log-prob passes
    a.use_prefix_grouper = prefix_grouper  # also the log-prob passes (actor's and ref's)
    if lm_head:  # the ref runs with the actor's Megatron config: its log-probs too
        aor.actor.megatron.use_fused_kernels, aor.actor.megatron.fused_lm_head = True, True
    a.loss_agg_mode, a.entropy_coeff = mode, 0.01
    a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type = True, 0.1, "low_var_kl"
    # Adam (the default) is nearly blind to the gradient's scale on its first steps, so the other
    # mode uses SGD, whose update is the (clipped) gradient itself. Adam's first update is
    # lr·g/(|g| + eps): with eps = 1e-8 a gradient entry of ~1e-9 (there is one here) turns fp32
    # reassociation noise into a weight change of ~lr; eps = 1e-6 bounds that at lr·noise/eps.
    a.optim.optimizer, a.optim.lr = ("adam", 1e-3) if mode == "token-mean" else ("sgd", 0.5)
    a.optim.adam_eps, a.optim.clip_grad = 1e-6, 1.0
    aor.ref.log_prob_micro_batch_size_per_gpu = 6 if layout.virtual_pipeline_model_parallel_size else LOGPROB_MICRO
    aor.rollout.n, aor.rollout.temperature = N, 0.9
    aor.rollout.log_prob_micro_batch_size_per_gpu = LOGPROB_MICRO
    cfg.algorithm.policy_loss, cfg.algorithm.policy_loss_kwargs = "ppo_clip", {"clip_ratio": 0.02}
    cfg.data.train_batch_size = PROMPTS
    cfg.data.max_prompt_length, cfg.data.max_response_length = P, T
    cfg.trainer.total_training_steps = 1
    return cfg


def modes(name: str) -> tuple[str, ...]:
    """The loss modes run at a layout: Megatron's distributed optimizer is Adam-only (no SGD mode)."""
    return MODES[:1] if parse_layout(name)[1] else MODES


def fixed_batch(vocab: int, pad_token_id: int) -> RolloutBatch:
    """16 samples: prompt lengths 3–9, response lengths 1–10 (one full width), fixed advantages."""
    g = torch.Generator().manual_seed(1234)
    B = PROMPTS * N
    prompt_len = [3 + (5 * i) % 7 for i in range(PROMPTS)]
    response_len = [1 + (7 * b + 3) % T for b in range(B)]
    prompt_ids = torch.full((B, P), pad_token_id)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    response_ids = torch.full((B, T), pad_token_id)
    response_mask = torch.zeros(B, T, dtype=torch.long)
    tokens = [torch.randint(0, pad_token_id, (prompt_len[i],), generator=g) for i in range(PROMPTS)]
    for b in range(B):
        p, r = prompt_len[b // N], response_len[b]
        prompt_ids[b, P - p:], prompt_mask[b, P - p:] = tokens[b // N], 1
        response_ids[b, :r], response_mask[b, :r] = torch.randint(0, pad_token_id, (r,), generator=g), 1
    scores = torch.randn(B, generator=g)
    grouped = scores.view(PROMPTS, N)
    adv_B = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).view(B)
    assert pad_token_id < vocab
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        rollout_logprobs=-torch.rand(B, T, generator=g) * response_mask,
        weight_version=torch.zeros(B, dtype=torch.long),
        group_index=torch.arange(B) // N, meta=[SampleMeta() for _ in range(B)], pad_token_id=pad_token_id,
        advantages=adv_B[:, None] * response_mask)


def run_layout(model_dir: str, out_dir: Path, name: str, mode: str, full: RolloutBatch) -> None:
    start = time.perf_counter()
    layout, distributed_optimizer = parse_layout(name)
    init_parallel(layout)
    seed_everything(1)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    B = len(full)
    mine = list(range(dp_rank * B // dp, (dp_rank + 1) * B // dp))  # the trainer's: a block of prompts
    batch = full.index(mine)
    cfg = config(model_dir, layout, mode, distributed_optimizer=distributed_optimizer,
                 dynamic_bsz="-dyn" in name, prefix_grouper="-pg" in name, lm_head="-lmh" in name,
                 padded=name.endswith("-pad"))
    plan, problems = Plan.build(cfg, world_size=dist.get_world_size(), device_type="cpu")
    assert not problems, problems
    hybrid = ActorRolloutRef(cfg.actor_rollout_ref, plan=plan, objective=actor_objective(cfg),
                             pad_token_id=full.pad_token_id)
    entropy_BT = hybrid.compute_log_probs(batch)
    hybrid.compute_ref_log_probs(batch)
    steps = hybrid.update_actor(batch, seed=7)
    weights = {k: v for bucket in hybrid.actor.export_weights(bucket_bytes=1 << 20) for k, v in bucket}

    assert batch.old_logprobs is not None and batch.ref_logprobs is not None
    local = (mine, batch.old_logprobs, batch.ref_logprobs, entropy_BT)
    gathered: list = [None] * dp
    dist.all_gather_object(gathered, local, group=parallel_state.get_data_parallel_group())
    if dist.get_rank() == 0:
        per_sample = {key: torch.zeros(B, T) for key in ("old_logprobs", "ref_logprobs", "entropy")}
        for idx, old, ref, ent in gathered:
            for key, value in zip(per_sample, (old, ref, ent), strict=True):
                per_sample[key][idx] = value
        torch.save({**per_sample, "steps": steps, "weights": weights}, out_dir / f"{name}dp{dp}-{mode}.pt")
        print(f"{name}dp{dp} {mode}: {time.perf_counter() - start:.1f}s, {len(steps)} optimizer steps, "
              + " ".join(f"{k}={v:.3g}" for k, v in steps[-1].items()), flush=True)
    parallel_state.destroy_model_parallel()  # the next layout re-initialises the groups


def main() -> None:
    model_dir, out_dir, layouts = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    full = fixed_batch(hf.vocab_size, hf.pad_token_id)
    for name in layouts:
        for mode in modes(name):
            run_layout(model_dir, out_dir, name, mode, full)
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main()
