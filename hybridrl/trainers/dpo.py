"""Offline DPO of the Megatron actor on preference pairs; saves an HF checkpoint (``launch/dpo.py``).

    L = mean over pairs of dpo_loss(log π(y_w|x), log π(y_l|x), log π_ref(y_w|x), log π_ref(y_l|x))

with sequence log-probs summed over the response tokens (EOS appended to each response, as in SFT);
the loss types, formulas and papers are in :mod:`hybridrl.algorithms.dpo_loss`.

Why a trainer of its own and not a mode of the RL loop: DPO has no rollouts, rewards, advantages or
weight sync, so the RL loop (generate → score → advantages → update → sync) would be all bypasses.
It is an offline job on SFT's skeleton (:mod:`hybridrl.trainers.offline`) with a different batch and loss: the
config's ``model``/``megatron``/``optim``/``trainer`` sections, the Megatron policy (``MegatronPolicy``:
micro-batching and every TP/PP/CP/DP layout of the same plan, ``train_step`` with a loss function,
``compute_log_probs``), the tracker, the output-dir lock and the HF checkpoint at the end.

Batch layout: each pair is two rows, chosen at ``2i`` and rejected at ``2i + 1``, sharing the prompt; a
micro-batch holds ``2 × data.micro_batch_size_per_gpu`` rows, so a pair never straddles two
micro-batches or DP ranks, and the loss function sees both halves of each of its pairs.

Reference log-probs: a frozen copy of the start model (the RL ref's build:
:func:`hybridrl.megatron.policy.reference_policy`) scores each batch once, before the policy's step. Chosen over
precomputing them for the whole dataset at start: it is exact whatever the shuffle, the number of epochs or a
later resume, with nothing to store or invalidate, and costs one frozen copy of the weights (no gradients or
optimizer state: a fraction of the trained copy's memory) plus a forward-only pass per step. With LoRA
(``model.lora_rank`` > 0) there is no copy: the reference is the policy with its adapters off (the base it
started from).

Deviation from TRL's DPOTrainer: no padding-free/concatenated forward tricks; IPO uses summed
log-probs (see the loss module). As in SFT (unlike the RL trainer) there is no mid-run checkpoint/resume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from hybridrl.algorithms.dpo_loss import DPOTerms, dpo_loss
from hybridrl.batch import RolloutBatch
from hybridrl.config.dpo_schema import DPOAlgorithmConfig, DPOConfig
from hybridrl.data.collate import PromptBatch, collate_prompts
from hybridrl.data.preference import PreferenceDataset, PreferenceDatasetConfig
from hybridrl.megatron.config import MicroBatching
from hybridrl.trainers.offline import OfflineJob, dp_strided_passes, fit_offline

if TYPE_CHECKING:
    from hybridrl.megatron.policy import MegatronPolicy

# seq-mean-token-sum's normaliser is the mini-batch's sequence count over all DP ranks: 2 × its pairs
LOSS_AGG_MODE = "seq-mean-token-sum"


def pair_batch(prompts: PromptBatch, tokenizer: PreTrainedTokenizerBase, *, rejected_key: str,
               max_response_length: int, end_ids: Sequence[int] | None = None) -> RolloutBatch:
    """``B`` pairs → ``2B`` rows: chosen at ``2i``, rejected at ``2i + 1`` (SFT's targets: response + EOS, or
    ``end_ids``)."""
    from hybridrl.trainers.sft import sft_batch

    meta = [m for pair in prompts.meta for m in
            (pair, dataclasses.replace(pair, ground_truth=str(pair.extra[rejected_key])))]
    doubled = PromptBatch(input_ids=prompts.input_ids.repeat_interleave(2, 0),
                          attention_mask=prompts.attention_mask.repeat_interleave(2, 0),
                          index=prompts.index.repeat_interleave(2), meta=meta, pad_token_id=prompts.pad_token_id)
    return sft_batch(doubled, tokenizer, max_response_length=max_response_length, end_ids=end_ids)


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
    terms = pair_terms(logprobs_BT, mb.ref_logprobs, mb.loss_mask, algo)
    pairs = normalizer / 2
    return terms.loss_N.sum() / pairs, {f"{k}_sum": v / pairs for k, v in terms.metric_sums().items()}


class DPOJob(OfflineJob):
    """:class:`~hybridrl.trainers.offline.OfflineJob` of offline DPO."""

    name = "DPO"
    target_metric = None  # no trainer.target_accuracy (validation refuses it)

    def __init__(self, cfg: DPOConfig) -> None:
        self.cfg = cfg
        self.micro = MicroBatching(micro_batch_size=2 * cfg.data.micro_batch_size_per_gpu,  # both halves of a pair
                                   packed=cfg.megatron.use_remove_padding)
        self.loss_fn = partial(dpo_micro_loss, algo=cfg.algorithm)

    def datasets(self, tokenizer: PreTrainedTokenizerBase) -> tuple[PreferenceDataset, PreferenceDataset | None]:
        d = self.cfg.data
        config = PreferenceDatasetConfig(prompt_key=d.prompt_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key,
                                         apply_chat_template=d.apply_chat_template,
                                         max_prompt_length=d.max_prompt_length)
        train = PreferenceDataset(d.train_files, tokenizer=tokenizer, config=config)
        return train, PreferenceDataset(d.val_files, tokenizer=tokenizer, config=config) if d.val_files else None

    def start(self, policy: MegatronPolicy, *, tokenizer: PreTrainedTokenizerBase, pad_token_id: int,
              train: PreferenceDataset) -> str:
        from hybridrl.megatron.policy import reference_policy

        self.tokenizer, self.pad_token_id = tokenizer, pad_token_id
        self.ref = reference_policy(policy, model_dir=self.cfg.model.path, megatron=self.cfg.megatron,
                                    pad_token_id=pad_token_id)
        a, t = self.cfg.algorithm, self.cfg.trainer
        return (f"DPO ({a.loss_type}, beta={a.beta}, label_smoothing={a.label_smoothing}): {len(train)} pairs, "
                f"{t.total_training_steps} steps of {self.cfg.data.train_batch_size} pairs")

    def _batch(self, prompts: PromptBatch) -> RolloutBatch:
        """The pairs' rows with the reference's log-probs (computed once, before the policy's step)."""
        from hybridrl.megatron.policy import reference_log_probs

        d = self.cfg.data
        batch = pair_batch(prompts, self.tokenizer, rejected_key=d.rejected_key,
                           max_response_length=d.max_response_length)
        return dataclasses.replace(batch, ref_logprobs=reference_log_probs(self.ref, batch, batching=self.micro))

    def step(self, policy: MegatronPolicy, prompts: PromptBatch) -> dict[str, float]:
        metrics = policy.train_step(self._batch(prompts), self.loss_fn, batching=self.micro,
                                    loss_agg_mode=LOSS_AGG_MODE)
        return {k if "/" in k else f"dpo/{k}": v for k, v in metrics.items()}

    def validate(self, policy: MegatronPolicy, val: PreferenceDataset) -> dict[str, float]:
        """``val/dpo/loss`` and ``val/rewards/*`` over the held-out pairs, each DP rank scoring its share."""
        from hybridrl.metrics import DPMeans

        m = DPMeans()
        for idx, weight in dp_strided_passes(len(val), rows=128):  # pairs per forward-only pass
            batch = self._batch(collate_prompts([val[i] for i in idx], idx, pad_token_id=self.pad_token_id))
            logp_BT, _ = policy.compute_log_probs(batch, batching=self.micro)
            assert batch.ref_logprobs is not None
            terms = pair_terms(logp_BT, batch.ref_logprobs, batch.loss_mask, self.cfg.algorithm)
            for k, v in terms.metric_sums().items():
                m.add(f"val/{k}", v * weight, len(idx) * weight)
        return m.reduce()


def fit_dpo(cfg: DPOConfig) -> dict[str, float]:
    return fit_offline(cfg, DPOJob(cfg), train_batch_size=cfg.data.train_batch_size, shuffle=cfg.data.shuffle)
