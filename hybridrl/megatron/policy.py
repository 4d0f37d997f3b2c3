"""The causal LM of the RL loop (actor, ref) on Megatron: build + load, log-probs, train steps, weight export.

The machinery (DDP, optimizer, scheduler, micro-batches, Megatron's schedule, PP broadcast, loss scaling,
precision) is :class:`~hybridrl.megatron.runner.MegatronRunner`'s; this module is the language-model head.
Token log-probs and entropies come from the vocab-parallel logits without gathering the vocabulary
(:mod:`vocab_parallel`); with CP > 1 they are gathered back to whole sequences, so every CP rank computes
the same loss. ``train_step`` hands the ``LossFn`` the *global* (mini-batch, all-DP) normaliser of the
loss aggregation mode; it returns its micro-batch loss divided by it.

Precision: the logits leave the model in its dtype (``fp32_output=False``) and log-probs/entropies are
computed from them in fp32 (:mod:`vocab_parallel`). The ref runs in the actor's dtype. Exports (weight sync,
HF saving) carry the model parameters as they are, i.e. in the run's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F

from hybridrl.batch import RolloutBatch
from hybridrl.config.plan import MicroBatching
from hybridrl.config.schema import MegatronConfig, OptimConfig
from hybridrl.hf_checkpoint import HFArch
from hybridrl.interfaces import WeightBucket
from hybridrl.megatron.context_parallel import gather_sequence, shard_sequence
from hybridrl.megatron.model import build_model_chunks
from hybridrl.megatron.runner import FP16_INITIAL_LOSS_SCALE, Head, MegatronRunner, _Micro, parallel_config
from hybridrl.megatron.vocab_parallel import vocab_parallel_logprob_entropy
from hybridrl.megatron.weights import export_hf_weights, load_hf_weights

__all__ = ["FP16_INITIAL_LOSS_SCALE", "LossFn", "MegatronPolicy", "parallel_config"]


class LossFn(Protocol):
    """A micro-batch's loss divided by ``normalizer`` (the mini-batch's, over all DP ranks), and metrics."""

    def __call__(self, logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor, mb: RolloutBatch, *,
                 normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class MegatronPolicy(MegatronRunner):
    """A causal LM on Megatron; trainable when ``optim`` is given (actor), frozen otherwise (ref)."""

    fp32_output = False  # Float16Module: logits stay in the model's dtype; vocab_parallel computes in fp32

    def __init__(self, *, model_dir: str, megatron: MegatronConfig, optim: OptimConfig | None,
                 total_steps: int, pad_token_id: int) -> None:
        arch = HFArch.from_hf(model_dir)
        chunks = build_model_chunks(arch, parallel_config(megatron), dtype=megatron.dtype,
                                    overrides=megatron.override_transformer_config)
        load_hf_weights(chunks, arch, model_dir)  # cast into the model's dtype
        super().__init__(chunks, arch=arch, megatron=megatron, optim=optim, total_steps=total_steps,
                         pad_token_id=pad_token_id)

    def _loss(self, loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] | None,
              temperature: float, mb: _Micro, logits_BSv: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        B, s, v = logits_BSv.shape  # s: this CP rank's positions (all S when CP = 1)
        next_BS = F.pad(mb.rows.tokens_BS[:, 1:], (0, 1), value=self.pad_token_id)  # last: no target
        logp_N, ent_N = vocab_parallel_logprob_entropy(
            logits_BSv.reshape(-1, v), shard_sequence(next_BS).reshape(-1), vocab_size=self.arch.vocab_size,
            temperature=temperature)
        idx_BT = mb.rows.response_index_BT()
        logp_BT = gather_sequence(logp_N.view(B, s)).gather(1, idx_BT)
        ent_BT = gather_sequence(ent_N.view(B, s)).gather(1, idx_BT)
        if loss_fn is None:
            return logp_BT.sum() * 0.0, {"logprobs": logp_BT.detach(), "entropy": ent_BT.detach()}
        loss, metrics = loss_fn(logp_BT, ent_BT, mb.batch)
        return loss, {k: v.detach() for k, v in metrics.items()}

    def compute_log_probs(self, batch: RolloutBatch, *, batching: MicroBatching,
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs_BT, entropy_BT)`` of the response tokens, on every rank of the MP group, on the host (as
        the loop's batches are); ``batch`` moves to this rank's device once, here."""
        head: Head = partial(self._loss, None, temperature)
        both = self._forward_rows(batch, head, ("logprobs", "entropy"), batching=batching)
        return both[0], both[1]

    def train_step(self, batch: RolloutBatch, loss_fn: LossFn, *, batching: MicroBatching, loss_agg_mode: str,
                   temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over ``batch`` (this DP rank's share of a mini-batch); the loss is aggregated
        as ``loss_agg_mode`` says over the whole mini-batch (all DP ranks). ``batch`` moves to this rank's
        device unless it is there already (``ActorRolloutRef.update_actor`` moves the whole batch once)."""
        return self._train_step(
            batch, lambda normalizer: partial(self._loss, partial(loss_fn, normalizer=normalizer), temperature),
            batching=batching, loss_agg_mode=loss_agg_mode)

    # ---- weights ----
    def export_weights(self, *, bucket_bytes: int) -> Iterator[WeightBucket]:
        """HF-named full tensors in buckets, the same stream on every rank (TP-gathered, PP-broadcast)."""
        return export_hf_weights(self.chunks, self.arch, bucket_bytes=bucket_bytes)
