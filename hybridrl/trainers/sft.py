"""Supervised fine-tuning of the Megatron actor on prompt → response pairs; saves an HF checkpoint.

    L = -(1/N) Σ_i Σ_t m_{i,t} log π(y_{i,t} | x_i, y_{i,<t}),   N = Σ m over the global batch

Loss on the response tokens only (EOS appended to each target), token-mean over the whole
optimizer batch across micro-batches and DP ranks (the same normalisation as the RL actor).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from hybridrl.algorithms.loss_agg import aggregate
from hybridrl.batch import RolloutBatch
from hybridrl.config.sft_schema import SFTConfig
from hybridrl.data.collate import PromptBatch, collate_prompts
from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
from hybridrl.hf.arch import HFArch
from hybridrl.megatron.config import MicroBatching
from hybridrl.megatron.policy import MegatronPolicy
from hybridrl.metrics import DPMeans
from hybridrl.trainers.offline import OfflineJob, dp_strided_passes, fit_offline


def sft_batch(prompts: PromptBatch, tokenizer: PreTrainedTokenizerBase, *, max_response_length: int,
              end_ids: Sequence[int] | None = None) -> RolloutBatch:
    """Targets = tokenized ground truth + EOS (or ``end_ids``: what ends a response), right-padded, as a RolloutBatch
    the actor can train on; a long one is cut to ``max_response_length`` with its end kept."""
    end = [tokenizer.eos_token_id] if end_ids is None else list(end_ids)
    targets = []
    for meta in prompts.meta:
        if meta.ground_truth is None:
            raise ValueError("an SFT row has no response (data.response_key)")
        ids = tokenizer(meta.ground_truth, add_special_tokens=False)["input_ids"][:max(max_response_length - len(end),
                                                                                       0)]
        targets.append(ids + end)
    B, T = len(targets), max(len(t) for t in targets)
    response_ids_BT = torch.full((B, T), prompts.pad_token_id, dtype=torch.long)
    mask_BT = torch.zeros((B, T), dtype=torch.long)
    for b, ids in enumerate(targets):
        response_ids_BT[b, :len(ids)] = torch.tensor(ids)
        mask_BT[b, :len(ids)] = 1
    return RolloutBatch(prompt_ids=prompts.input_ids, prompt_mask=prompts.attention_mask,
                        response_ids=response_ids_BT, response_mask=mask_BT, rollout_logprobs=torch.zeros(B, T),
                        weight_version=torch.zeros(B, dtype=torch.long), group_index=prompts.index,
                        meta=prompts.meta, pad_token_id=prompts.pad_token_id)


def nll_loss(logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor, mb: RolloutBatch, *,
             normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the token-mean NLL of the whole batch (``normalizer``: its token count)."""
    loss = -aggregate(logprobs_BT, mb.loss_mask, "token-mean", global_normalizer=normalizer)
    return loss, {"loss_sum": loss.detach()}


class SFTJob(OfflineJob):
    """:class:`~hybridrl.trainers.offline.OfflineJob` of supervised fine-tuning."""

    name = "SFT"
    target_metric = "val/greedy_accuracy"  # what trainer.target_accuracy is compared with

    def __init__(self, cfg: SFTConfig) -> None:
        self.cfg = cfg
        # a vision-language model: rows with images, read through its processor, in padded micro-batches (its
        # multimodal positions do not fit packed rows; hybridrl.vlm.megatron_vlm)
        self.vlm = HFArch.from_hf(cfg.model.path).vision is not None
        self.micro = MicroBatching(micro_batch_size=cfg.data.micro_batch_size_per_gpu,
                                   packed=cfg.megatron.use_remove_padding and not self.vlm)

    def build(self, *, pad_token_id: int) -> MegatronPolicy:
        return OfflineJob.build(self, pad_token_id=pad_token_id, freeze_vision_tower=self.cfg.model.freeze_vision_tower)

    def datasets(self, tokenizer: PreTrainedTokenizerBase) -> tuple[PromptDataset, PromptDataset | None]:
        d = self.cfg.data
        config = PromptDatasetConfig(prompt_key=d.prompt_key, ground_truth_key=d.response_key,
                                     apply_chat_template=d.apply_chat_template, max_prompt_length=d.max_prompt_length)
        if self.vlm:
            from transformers import AutoProcessor

            from hybridrl.data.multimodal import MultimodalDatasetConfig, MultimodalPromptDataset

            processor = AutoProcessor.from_pretrained(self.cfg.model.tokenizer_path or self.cfg.model.path)
            mm = MultimodalDatasetConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
                                         image_key=d.image_key)
            make = lambda files: MultimodalPromptDataset(files, config=mm, processor=processor)  # noqa: E731
        else:
            make = lambda files: PromptDataset(files, tokenizer=tokenizer, config=config)  # noqa: E731
        return make(d.train_files), make(d.val_files) if d.val_files else None

    def start(self, policy: MegatronPolicy, *, tokenizer: PreTrainedTokenizerBase, pad_token_id: int,
              train: PromptDataset) -> str:
        self.tokenizer, self.pad_token_id = tokenizer, pad_token_id
        return (f"SFT: {len(train)} pairs, {self.cfg.trainer.total_training_steps} steps of "
                f"{self.cfg.data.train_batch_size} samples")

    def step(self, policy: MegatronPolicy, prompts: PromptBatch) -> dict[str, float]:
        batch = sft_batch(prompts, self.tokenizer, max_response_length=self.cfg.data.max_response_length)
        metrics = policy.train_step(batch, nll_loss, batching=self.micro, loss_agg_mode="token-mean")
        return {f"sft/{k}": v for k, v in metrics.items()}

    def validate(self, policy: MegatronPolicy, val: PromptDataset) -> dict[str, float]:
        """On the held-out pairs (``data.val_files``), each DP rank scoring its share: ``val/loss``, the token-mean
        NLL, and ``val/greedy_accuracy``, the share of pairs whose whole target (EOS included) is the model's greedy
        choice token by token — what greedy decoding from the prompt would write (``MegatronPolicy.greedy_matches``).
        For a multi-turn transcript the target's tool replies count too: it is stricter than an episode's success."""
        m = DPMeans()
        for idx, weight in dp_strided_passes(len(val), rows=256):  # pairs per forward-only pass
            batch = sft_batch(collate_prompts([val[i] for i in idx], idx, pad_token_id=self.pad_token_id),
                              self.tokenizer, max_response_length=self.cfg.data.max_response_length)
            logp_BT, _ = policy.compute_log_probs(batch, batching=self.micro)
            mask_BT = batch.loss_mask
            m.add("val/loss", -(logp_BT * mask_BT).sum() * weight, mask_BT.sum() * weight)
            misses_B = ((1 - policy.greedy_matches(batch, batching=self.micro)) * mask_BT).sum(-1)
            m.add("val/greedy_accuracy", (misses_B == 0).float().sum() * weight, torch.tensor(len(idx) * weight))
        return m.reduce()


def fit_sft(cfg: SFTConfig) -> dict[str, float]:
    return fit_offline(cfg, SFTJob(cfg), train_batch_size=cfg.data.train_batch_size, shuffle=cfg.data.shuffle)
