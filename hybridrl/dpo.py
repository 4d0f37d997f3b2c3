"""Offline DPO of the Megatron actor on preference pairs; saves an HF checkpoint (``launch/dpo.py``).

    L = mean over pairs of dpo_loss(log π(y_w|x), log π(y_l|x), log π_ref(y_w|x), log π_ref(y_l|x))

with sequence log-probs summed over the response tokens (EOS appended to each response, as in SFT);
the loss types, formulas and papers are in :mod:`hybridrl.algorithms.dpo_loss`.

Why a trainer of its own and not a mode of the RL loop: DPO has no rollouts, rewards, advantages or
weight sync, so the RL loop (generate → score → advantages → update → sync) would be all bypasses.
It is SFT's offline loop with a different batch and loss, and reuses what SFT uses: the config's
``model``/``megatron``/``optim``/``trainer`` sections, the Megatron policy (``MegatronPolicy``:
micro-batching and every TP/PP/CP/DP layout of the same plan, ``train_step`` with a loss function,
``compute_log_probs``), the tracker, the output-dir lock and the HF checkpoint at the end.

Batch layout: each pair is two rows, chosen at ``2i`` and rejected at ``2i + 1``, sharing the prompt; a
micro-batch holds ``2 × data.micro_batch_size_per_gpu`` rows, so a pair never straddles two
micro-batches or DP ranks, and the loss function sees both halves of each of its pairs.

Reference log-probs: a frozen copy of the start model (``MegatronPolicy`` without optimizer, the RL ref's
build) scores each batch once, before the policy's step. Chosen over precomputing them for the whole
dataset at start: it is exact whatever the shuffle, the number of epochs or a later resume, with nothing
to store or invalidate, and costs one frozen copy of the weights (no gradients or optimizer state: a fraction of
the trained copy's memory) plus a forward-only pass per step. With LoRA (``model.lora_rank`` > 0) there is no
copy: the reference is the policy with its adapters off (the base it started from).

Deviation from TRL's DPOTrainer: no padding-free/concatenated forward tricks; IPO uses summed
log-probs (see the loss module). As in SFT (unlike the RL trainer) there is no mid-run checkpoint/resume.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hybridrl.algorithms.dpo_loss import DPOTerms, dpo_loss
from hybridrl.batch import RolloutBatch
from hybridrl.config.dpo_schema import DPOAlgorithmConfig, DPOConfig
from hybridrl.config.plan import MicroBatching
from hybridrl.data.collate import PromptBatch, collate_prompts
from hybridrl.data.preference import PreferenceDataset, PreferenceDatasetConfig
from hybridrl.lora_config import LoRAConfig
from hybridrl.tracking import say

if TYPE_CHECKING:
    from hybridrl.megatron.policy import MegatronPolicy

# seq-mean-token-sum's normaliser is the mini-batch's sequence count over all DP ranks: 2 × its pairs
LOSS_AGG_MODE = "seq-mean-token-sum"


def pair_batch(prompts: PromptBatch, tokenizer: PreTrainedTokenizerBase, *, rejected_key: str,
               max_response_length: int) -> RolloutBatch:
    """``B`` pairs → ``2B`` rows: chosen at ``2i``, rejected at ``2i + 1`` (SFT's targets: response + EOS)."""
    from hybridrl.sft import sft_batch

    meta = [m for pair in prompts.meta for m in
            (pair, dataclasses.replace(pair, ground_truth=str(pair.extra[rejected_key])))]
    doubled = PromptBatch(input_ids=prompts.input_ids.repeat_interleave(2, 0),
                          attention_mask=prompts.attention_mask.repeat_interleave(2, 0),
                          index=prompts.index.repeat_interleave(2), meta=meta, pad_token_id=prompts.pad_token_id)
    return sft_batch(doubled, tokenizer, max_response_length=max_response_length)


def pair_terms(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, response_mask_BT: torch.Tensor,
               algo: DPOAlgorithmConfig) -> DPOTerms:
    """The loss terms of the interleaved pairs of a ``[2N, T]`` batch (sequence log-prob = masked sum)."""
    mask_BT = response_mask_BT.to(logprobs_BT.dtype)
    seq_B, ref_B = (logprobs_BT * mask_BT).sum(-1), (ref_logprobs_BT * mask_BT).sum(-1)
    return dpo_loss(seq_B[0::2], seq_B[1::2], ref_B[0::2], ref_B[1::2], beta=algo.beta,
                    label_smoothing=algo.label_smoothing, loss_type=algo.loss_type)


def dpo_micro_loss(logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor, mb: RolloutBatch, *,
                   normalizer: torch.Tensor, algo: DPOAlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the mean loss over the mini-batch's pairs (``normalizer``: its sequence
    count, all DP ranks); metrics as ``*_sum`` shares of the same mean, so they add up across micro-batches."""
    assert mb.ref_logprobs is not None, "the reference log-probs are computed before the step"
    terms = pair_terms(logprobs_BT, mb.ref_logprobs, mb.response_mask, algo)
    pairs = normalizer / 2
    return terms.loss_N.sum() / pairs, {f"{k}_sum": v / pairs for k, v in terms.metric_sums().items()}


def reference_log_probs(ref: MegatronPolicy, batch: RolloutBatch, micro: MicroBatching) -> torch.Tensor:
    """log π_ref of every response token: the frozen copy, or the LoRA policy with its adapters off."""
    with ref.lora.disabled() if ref.lora is not None else nullcontext():
        ref_BT, _ = ref.compute_log_probs(batch, batching=micro)
    return ref_BT


def validation_metrics(policy: MegatronPolicy, ref: MegatronPolicy, val: PreferenceDataset, cfg: DPOConfig,
                       micro: MicroBatching, *, pad_token_id: int) -> dict[str, float]:
    """``val/dpo/loss`` and ``val/rewards/*`` over the held-out pairs, each DP rank scoring its share."""
    from megatron.core import parallel_state

    from hybridrl.metrics import DPMeans

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = list(range(dp_rank, len(val), dp_size))
    rows = 128  # pairs per forward-only pass (micro-batched inside)
    m = DPMeans()
    for start in range(0, -(-len(val) // dp_size), rows):  # the same number of passes on every rank
        idx = mine[start:start + rows]
        weight = 1.0 if idx else 0.0  # a rank with nothing left runs a pass on pair 0 that counts for nothing
        idx = idx or [0]
        batch = pair_batch(collate_prompts([val[i] for i in idx], idx, pad_token_id=pad_token_id), val.tokenizer,
                           rejected_key=cfg.data.rejected_key, max_response_length=cfg.data.max_response_length)
        logp_BT, _ = policy.compute_log_probs(batch, batching=micro)
        ref_BT = reference_log_probs(ref, batch, micro)
        for k, v in pair_terms(logp_BT, ref_BT, batch.response_mask, cfg.algorithm).metric_sums().items():
            m.add(f"val/{k}", v * weight, len(idx) * weight)
    return m.reduce()


def fit_dpo(cfg: DPOConfig) -> dict[str, float]:
    from functools import partial

    import torch.distributed as dist
    from megatron.core import parallel_state

    from hybridrl.data.loader import PromptLoader
    from hybridrl.data.sampler import SamplerConfig
    from hybridrl.hf_checkpoint import save_hf_checkpoint
    from hybridrl.megatron.parallel import init_parallel, seed_everything
    from hybridrl.megatron.policy import MegatronPolicy, parallel_config
    from hybridrl.run_lock import hold_output_dir
    from hybridrl.tracking import Tracker

    init_parallel(parallel_config(cfg.megatron))
    d, t = cfg.data, cfg.trainer
    hold_output_dir(t.output_dir)  # before anything is written: a second run on it fails here
    seed_everything(t.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    pairs_config = PreferenceDatasetConfig(prompt_key=d.prompt_key, chosen_key=d.chosen_key,
                                           rejected_key=d.rejected_key, apply_chat_template=d.apply_chat_template,
                                           max_prompt_length=d.max_prompt_length)
    dataset = PreferenceDataset(d.train_files, tokenizer=tokenizer, config=pairs_config)
    loader = PromptLoader(dataset, sampler=SamplerConfig(train_batch_size=d.train_batch_size, shuffle=d.shuffle,
                                                         seed=t.seed),
                          dp_rank=parallel_state.get_data_parallel_rank(),
                          dp_size=parallel_state.get_data_parallel_world_size())
    # the policy is built as SFT builds it; the reference as the RL loop builds its ref: frozen, no optimizer,
    # and with LoRA the policy itself with its adapters off (no second copy of the weights)
    lora = LoRAConfig.from_model(cfg.model, key="model")
    policy = MegatronPolicy(model_dir=cfg.model.path, megatron=cfg.megatron, optim=cfg.optim,
                            total_steps=t.total_training_steps, pad_token_id=loader.pad_token_id, lora=lora)
    ref = policy if lora is not None else MegatronPolicy(model_dir=cfg.model.path, megatron=cfg.megatron, optim=None,
                                                         total_steps=0, pad_token_id=loader.pad_token_id)
    val = PreferenceDataset(d.val_files, tokenizer=tokenizer, config=pairs_config) if d.val_files else None
    tracker = Tracker(t, config={}, rank=dist.get_rank())
    a = cfg.algorithm
    say(f"DPO ({a.loss_type}, beta={a.beta}, label_smoothing={a.label_smoothing}): {len(dataset)} pairs, "
        f"{t.total_training_steps} steps of {d.train_batch_size} pairs")

    def batches():  # epoch after epoch
        while True:
            yield from loader

    metrics: dict[str, float] = {}
    micro = MicroBatching(micro_batch_size=2 * d.micro_batch_size_per_gpu)  # rows: both halves of each pair
    loss_fn = partial(dpo_micro_loss, algo=a)
    for step, prompts in zip(range(1, t.total_training_steps + 1), batches(), strict=False):
        batch = pair_batch(prompts, tokenizer, rejected_key=d.rejected_key, max_response_length=d.max_response_length)
        batch = dataclasses.replace(batch, ref_logprobs=reference_log_probs(ref, batch, micro))
        step_metrics = policy.train_step(batch, loss_fn, batching=micro, loss_agg_mode=LOSS_AGG_MODE)
        metrics = {k if "/" in k else f"dpo/{k}": v for k, v in step_metrics.items()}
        if val is not None and t.test_freq and (step % t.test_freq == 0 or step == t.total_training_steps):
            metrics |= validation_metrics(policy, ref, val, cfg, micro, pad_token_id=loader.pad_token_id)
        tracker.log(metrics, step=step)
    say(f"DPO: saving the HF checkpoint to {t.save_path}")
    save_hf_checkpoint(policy.export_weights(bucket_bytes=256 << 20), t.save_path, source_dir=cfg.model.path,
                       key="trainer.save_path", overwrite=t.overwrite_save_path,
                       overwrite_option="trainer.overwrite_save_path=true", protect=[cfg.model.path])
    tracker.close()
    return metrics
