"""A reward model on Megatron: a causal-LM trunk with a scalar head, one score per sequence (``launch/rm.py``).

The model is the critic's (:func:`~hybridrl.megatron.critic.build_scalar_head_model`: the checkpoint's trunk on the
run's TP/PP/CP/DP layout, a replicated ``Linear(hidden, 1)`` in place of the LM head, initialised from the
checkpoint's ``score.weight`` when it is a reward model already, else N(0, 0.02²)), without a bias: the layout of
transformers' ``*ForSequenceClassification`` with one label, whose ``score`` has none, so the export
(:meth:`MegatronRewardModel.export_weights`, HF names ``model.*`` + ``score.weight``) is loaded by
``AutoModelForSequenceClassification`` — and by ``reward.name=model`` — as is.

A sequence's score is the head's output at its **last token that is not the pad token**, the position transformers
pools at (``GenericForSequenceClassification``: the rightmost ``input_ids != pad_token_id``), so the trained scores
are the ones the exported checkpoint gives on the same ids (``pad_token_id`` is written into its config). Every
layout of the runner works (padded rows, packed rows, CP: the head's outputs are gathered back to whole sequences
first, as the critic's values are).

LoRA (``model.lora_rank`` > 0): adapters on the trunk's linears, and the head trains in full (it is new: there is
nothing to adapt; peft's ``modules_to_save=["score"]``, as TRL's reward trainer sets for sequence classification);
the export merges the adapters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from functools import partial

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import WeightBucket
from hybridrl.lora.config import LoRAConfig
from hybridrl.megatron.config import MegatronConfig, MicroBatching, OptimConfig
from hybridrl.megatron.context_parallel import gather_sequence
from hybridrl.megatron.critic import build_scalar_head_model
from hybridrl.megatron.lora import LoRAModel, apply_lora
from hybridrl.megatron.model import unwrap_model
from hybridrl.megatron.runner import Head, MegatronRunner, _Micro
from hybridrl.megatron.sequences import PackedRows
from hybridrl.megatron.weights import export_hf_weights
from hybridrl.tracking import say

PairLoss = Callable[[torch.Tensor, RolloutBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``(scores_B, micro-batch, normalizer)`` → the micro-batch's loss divided by ``normalizer``, and metrics."""


def score_index_B(rows: PackedRows, response_ids_BT: torch.Tensor, *, pad_token_id: int) -> torch.Tensor:
    """``[B]``: where each sample's score is read among the ``R·S`` positions of ``rows`` (row-major) — its last
    response token that is not ``pad_token_id`` (the prompt's last token when there is none), as transformers pools a
    sequence-classification model. Plain and packed rows (not shared-prompt rows: their prompt sits elsewhere)."""
    T = response_ids_BT.shape[1]
    keep_BT = rows.response_mask_BT.bool() & (response_ids_BT != pad_token_id)
    t_BT = torch.arange(T, device=response_ids_BT.device).expand_as(keep_BT)
    last_B = torch.where(keep_BT, t_BT, -1).amax(-1)
    start_B = rows.prompt_len_B if rows.response_start_B is None else rows.response_start_B
    end_B = rows.prompt_len_B if rows.prompt_end_B is None else rows.prompt_end_B
    position_B = torch.where(last_B >= 0, start_B + last_B, end_B - 1)
    row_B = rows.row_B if rows.row_B is not None else torch.arange(len(position_B), device=position_B.device)
    return row_B * rows.seq_len + position_B


class MegatronRewardModel(MegatronRunner):
    """A trainable reward model on Megatron, initialised from an HF causal LM's trunk (or a reward model)."""

    def __init__(self, *, model_dir: str, megatron: MegatronConfig, optim: OptimConfig, total_steps: int,
                 pad_token_id: int, seed: int, lora: LoRAConfig | None = None) -> None:
        chunks, arch = build_scalar_head_model(model_dir, megatron, seed=seed, bias=False)
        self.lora: LoRAModel | None = None
        if lora is not None:
            self.lora = apply_lora(chunks, arch, lora)  # freezes every base parameter
            last = unwrap_model(chunks[-1])
            if last.post_process:
                last.output_layer.requires_grad_(True)  # the head trains in full (module docstring)
        super().__init__(chunks, arch=dataclasses.replace(arch, score_head=True), megatron=megatron, optim=optim,
                         total_steps=total_steps, pad_token_id=pad_token_id)
        if self.lora is not None:
            say(self.lora.summary(optimizer=optim.optimizer, dtype=self.dtype) + " (+ the score head, trained in full)")

    def _scores(self, loss_fn: PairLoss | None, normalizer: torch.Tensor | None, mb: _Micro,
                out_BS1: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        R, s, _ = out_BS1.shape  # s: this CP rank's positions (all S when CP = 1)
        out_RS = gather_sequence(out_BS1.float().view(R, s), cu_seqlens=mb.rows.cu_seqlens_padded)
        scores_B = out_RS.reshape(-1)[score_index_B(mb.rows, mb.batch.response_ids, pad_token_id=self.pad_token_id)]
        if loss_fn is None:  # forward only: every response position carries the sample's score (read at t = 0)
            every_BT = scores_B.detach()[:, None].expand(mb.batch.response_ids.shape).contiguous()
            return scores_B.sum() * 0.0, {"scores": every_BT}
        assert normalizer is not None
        return loss_fn(scores_B, mb.batch, normalizer)

    @torch.no_grad()
    def compute_scores(self, batch: RolloutBatch, *, batching: MicroBatching) -> torch.Tensor:
        """``scores_B`` (fp32, on the host, on every rank of the MP group): each sample's score."""
        return self._forward_rows(batch, partial(self._scores, None, None), ("scores",), batching=batching)[0][:, 0]

    def train_step(self, batch: RolloutBatch, loss_fn: PairLoss, *, batching: MicroBatching) -> dict[str, float]:
        """One optimizer step over ``batch`` (this DP rank's share of a mini-batch); ``loss_fn`` gets the
        mini-batch's sequence count over all DP ranks as its normalizer."""

        def head_for(normalizer: torch.Tensor) -> Head:
            return partial(self._scores, loss_fn, normalizer)

        return self._train_step(batch, head_for, batching=batching, loss_agg_mode="seq-mean-token-sum")

    def export_weights(self, *, bucket_bytes: int) -> Iterator[WeightBucket]:
        """HF-named full tensors of a ``*ForSequenceClassification`` (``model.*``, ``score.weight``) in buckets, the
        same stream on every rank; with LoRA the adapters merged."""
        return export_hf_weights(self.chunks, self.arch, bucket_bytes=bucket_bytes,
                                 merge=None if self.lora is None else self.lora.merger())
