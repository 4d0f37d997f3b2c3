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

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from megatron.core import parallel_state

from hybridrl.batch import RolloutBatch
from hybridrl.guards import agree
from hybridrl.hf.arch import HFArch
from hybridrl.interfaces import WeightBucket
from hybridrl.lora.config import LoRAConfig
from hybridrl.megatron.config import ROUTER_REPLAY_MODES, MegatronConfig, MicroBatching, OptimConfig
from hybridrl.megatron.context_parallel import gather_sequence, shard_sequence
from hybridrl.megatron.hidden_states import output_weight
from hybridrl.megatron.lora import LoRAModel, apply_lora
from hybridrl.megatron.model import TORCH_DTYPES, build_model_chunks
from hybridrl.megatron.router_replay import RouterReplay, unpacked_routing
from hybridrl.megatron.runner import FP16_INITIAL_LOSS_SCALE, Head, MegatronRunner, _Micro, parallel_config
from hybridrl.megatron.vocab_parallel import vocab_parallel_is_argmax, vocab_parallel_logprob_entropy
from hybridrl.megatron.vocab_topk import vocab_parallel_logprobs_at, vocab_parallel_topk
from hybridrl.megatron.weights import export_hf_weights, load_hf_weights
from hybridrl.ops import compiled_kernels, lm_head_logprob_entropy
from hybridrl.tracking import say
from hybridrl.vlm.megatron_vlm import attach_vision_tower

__all__ = ["FP16_INITIAL_LOSS_SCALE", "LossFn", "MegatronPolicy", "parallel_config"]


def _fused_kernels_everywhere(setting: bool | None, device: torch.device) -> bool:
    """``use_fused_kernels`` decided once for every rank: the fused and the plain head combine a TP group's
    vocabulary shards with different collectives, so a rank without a compiler (null) sends every rank down
    the plain path, and ``true`` fails on every rank (not only where the kernels did not build, which would
    leave the others waiting in the next collective)."""
    here = setting is not False and compiled_kernels(device) is not None  # warned once where they do not build
    cause = agree(None if here or setting is False else f"the fused kernels are unavailable on {device.type}")
    if cause is None:
        return here
    if setting:
        raise RuntimeError(f"actor_rollout_ref.actor.megatron.use_fused_kernels=true but {cause} (see the warning "
                           f"there); set it to null (use them where every rank has them) or false")
    if here:
        say(f"use_fused_kernels=null: the plain log-prob path on every rank, as {cause}")
    return False


PerToken = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, ...]]
"""``(last stage's output, target_N, select_N)`` → per-token values ``[N]`` (log-prob and entropy; a greedy match)."""


class LossFn(Protocol):
    """A micro-batch's loss divided by ``normalizer`` (the mini-batch's, over all DP ranks), and metrics;
    ``topk_logprobs_BTK`` is given when the batch carries the teacher's top-k ids (``teacher_topk_ids``): the
    policy's log-probs of those ids."""

    def __call__(self, logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor, mb: RolloutBatch, *,
                 normalizer: torch.Tensor, topk_logprobs_BTK: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class MegatronPolicy(MegatronRunner):
    """A causal LM on Megatron; trainable when ``optim`` is given (actor), frozen otherwise (ref)."""

    fp32_output = False  # Float16Module: logits stay in the model's dtype; vocab_parallel computes in fp32

    def __init__(self, *, model_dir: str, megatron: MegatronConfig, optim: OptimConfig | None,
                 total_steps: int, pad_token_id: int, lora: LoRAConfig | None = None,
                 router_replay: str = "disabled", freeze_vision_tower: bool = False) -> None:
        """``lora``: train adapters on the frozen base (:mod:`hybridrl.megatron.lora`; ``self.lora``);
        ``router_replay``: an MoE actor's ``actor.router_replay.mode`` (:mod:`hybridrl.megatron.router_replay`)."""
        arch = HFArch.from_hf(model_dir)
        chunks = build_model_chunks(arch, parallel_config(megatron), dtype=megatron.dtype,
                                    overrides=megatron.override_transformer_config)
        load_hf_weights(chunks, arch, model_dir)  # cast into the model's dtype
        if arch.vision is not None:  # a VLM: its vision tower in the first stage (hybridrl.vlm.megatron_vlm)
            attach_vision_tower(chunks, arch, model_dir, dtype=TORCH_DTYPES[megatron.dtype],
                                trainable=optim is not None and not freeze_vision_tower)
        self.lora: LoRAModel | None = apply_lora(chunks, arch, lora) if lora is not None else None
        super().__init__(chunks, arch=arch, megatron=megatron, optim=optim, total_steps=total_steps,
                         pad_token_id=pad_token_id)
        if self.lora is not None and optim is not None:
            say(self.lora.summary(optimizer=optim.optimizer, dtype=self.dtype))
        self.use_fused_kernels = _fused_kernels_everywhere(megatron.use_fused_kernels, self.device)
        # fused LM head: the model returns hidden states and the head multiplies them by the LM-head weight in
        # vocabulary chunks (when the fused kernels are used at all: with null and no compiler, the logits path)
        self.returns_hidden_states = megatron.fused_lm_head and self.use_fused_kernels
        if router_replay not in ROUTER_REPLAY_MODES:
            raise ValueError(f"actor_rollout_ref.actor.router_replay.mode={router_replay!r}; valid: "
                             f"{', '.join(ROUTER_REPLAY_MODES)}")
        self.router_replay_mode = router_replay
        if router_replay != "disabled":
            if arch.moe is None:
                raise ValueError(f"actor_rollout_ref.actor.router_replay.mode={router_replay}: the model at "
                                 f"{model_dir} has no experts to route (a dense model); use disabled")
            self.router_replay = RouterReplay(self.chunks, arch.moe.sparse_layers,
                                              sequence_parallel=megatron.sequence_parallel)
        self.replay_metrics: dict[str, float] = {}  # the last old-log-prob pass's (router_replay/*)

    def _token_logprobs(self, output: torch.Tensor, target_N: torch.Tensor, select_N: torch.Tensor | None,
                        temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log p, entropy)`` of ``target_N`` at the positions ``select_N`` (all when None) of the last stage's
        output, in (row, position) order: logits ``[b, s, v]``, or hidden states ``[s, b, h]`` with the fused LM
        head (``returns_hidden_states``: the logits never exist whole)."""
        if self.returns_hidden_states:
            hidden_Nh = output.transpose(0, 1).reshape(-1, output.shape[-1])
            return lm_head_logprob_entropy(
                hidden_Nh if select_N is None else hidden_Nh[select_N], output_weight(self.chunks[-1]), target_N,
                vocab_size=self.arch.vocab_size, temperature=temperature,
                group=parallel_state.get_tensor_model_parallel_group())
        logits_Nv = output.reshape(-1, output.shape[-1])
        return vocab_parallel_logprob_entropy(  # the logits are read here only (a copy when selected)
            logits_Nv if select_N is None else logits_Nv[select_N], target_N, vocab_size=self.arch.vocab_size,
            temperature=temperature, fused=self.use_fused_kernels, consume_logits=True)

    def _response_tokens(self, output: torch.Tensor, mb: _Micro, per_token: PerToken) -> list[torch.Tensor]:
        """``per_token(output, target_N, select_N)``'s values (``[N]`` or ``[N, K]`` each) at every response token,
        ``[B, T]`` (``[B, T, K]``) each: the target of a position is the next token of its row. Rows holding several
        samples (packed, shared-prompt) are read at the response positions only; otherwise, and with CP > 1 (each
        rank holds its chunks of every sequence), at every position, gathered over CP."""
        rows = mb.rows
        if rows.shared_prompts and not (rows.packed and parallel_state.get_context_parallel_world_size() > 1):
            response_BT = mb.batch.response_ids
            values = per_token(output, response_BT.reshape(-1), rows.flat_response_index_BT().reshape(-1))
            return [v.view(*response_BT.shape, *v.shape[1:]) for v in values]
        # s: this CP rank's positions (all S when CP = 1)
        R, s = (output.shape[1], output.shape[0]) if self.returns_hidden_states else output.shape[:2]
        cu = rows.cu_seqlens_padded
        next_RS = F.pad(rows.tokens_BS[:, 1:], (0, 1), value=self.pad_token_id)  # last: no target
        values = per_token(output, shard_sequence(next_RS, cu_seqlens=cu).reshape(-1), None)
        return [rows.at_responses(gather_sequence(v.view(R, s, *v.shape[1:]), cu_seqlens=cu)) for v in values]

    def _positioned(self, mb: _Micro, x_BTK: torch.Tensor) -> torch.Tensor:
        """``[N, K]``: the per-response-token ``x_BTK`` at the positions ``per_token`` sees, in its order (each
        response token's at the position that predicts it; zeros elsewhere)."""
        K, rows = x_BTK.shape[-1], mb.rows
        if rows.shared_prompts and not (rows.packed and parallel_state.get_context_parallel_world_size() > 1):
            return x_BTK.reshape(-1, K)
        R, S = rows.tokens_BS.shape
        out_NK = x_BTK.new_zeros(R * S, K)
        b, t = mb.batch.response_mask.nonzero(as_tuple=True)
        out_NK[rows.flat_response_index_BT()[b, t]] = x_BTK[b, t]
        return shard_sequence(out_NK.view(R, S, K), cu_seqlens=rows.cu_seqlens_padded).reshape(-1, K)

    def _loss(self, loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] | None,
              temperature: float, mb: _Micro, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        extra: dict[str, torch.Tensor] = {}
        if loss_fn is not None and mb.batch.teacher_topk_ids is not None:  # a top-k distillation loss: read first,
            ids_NK = self._positioned(mb, mb.batch.teacher_topk_ids)  # the sampled-token path may consume logits
            (extra["topk_logprobs_BTK"],) = self._response_tokens(output, mb, lambda out, _, select_N: (
                vocab_parallel_logprobs_at(self._local_logits(out, select_N),
                                           ids_NK, vocab_size=self.arch.vocab_size,
                                           temperature=temperature),))
        logp_BT, ent_BT = self._response_tokens(
            output, mb, lambda out, target_N, select_N: self._token_logprobs(out, target_N, select_N, temperature))
        if loss_fn is None:
            return logp_BT.sum() * 0.0, {"logprobs": logp_BT.detach(), "entropy": ent_BT.detach()}
        loss, metrics = loss_fn(logp_BT, ent_BT, mb.batch, **extra)
        return loss, {k: v.detach() for k, v in metrics.items()}

    def _local_logits(self, output: torch.Tensor, select_N: torch.Tensor | None) -> torch.Tensor:
        """``[N, V_pad / TP]``: this TP rank's vocabulary columns of the logits at the positions ``select_N`` (all
        when None), in (row, position) order; from the fused LM head's hidden states when the model returns those."""
        if self.returns_hidden_states:
            hidden_Nh = output.transpose(0, 1).reshape(-1, output.shape[-1])
            return (hidden_Nh if select_N is None else hidden_Nh[select_N]) @ output_weight(self.chunks[-1]).t()
        logits_Nv = output.reshape(-1, output.shape[-1])
        return logits_Nv if select_N is None else logits_Nv[select_N]

    def _greedy_matches(self, output: torch.Tensor, target_N: torch.Tensor,
                        select_N: torch.Tensor | None) -> tuple[torch.Tensor]:
        logits_Nv = self._local_logits(output, select_N)
        return (vocab_parallel_is_argmax(logits_Nv, target_N, vocab_size=self.arch.vocab_size),)

    def _topk_head(self, k: int, temperature: float, mb: _Micro,
                   output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        def per_token(out: torch.Tensor, target_N: torch.Tensor,
                      select_N: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
            logits_Nv = self._local_logits(out, select_N)
            logp_NK, ids_NK = vocab_parallel_topk(logits_Nv, k, vocab_size=self.arch.vocab_size,
                                                  temperature=temperature)
            (sampled_N,) = vocab_parallel_logprobs_at(logits_Nv.detach(), target_N[:, None],
                                                      vocab_size=self.arch.vocab_size, temperature=temperature).T
            return sampled_N, logp_NK, ids_NK.float()  # ids < 2^24: exact in fp32
        sampled_BT, logp_BTK, ids_BTK = self._response_tokens(output, mb, per_token)
        return output.sum() * 0.0, {"logprobs": sampled_BT, "topk_logprobs": logp_BTK, "topk_ids": ids_BTK}

    def compute_topk_log_probs(self, batch: RolloutBatch, k: int, *, batching: MicroBatching,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logprobs_BT, topk_logprobs_BTK, topk_ids_BTK)`` of every response position: the log-prob of the sampled
        token and the model's ``k`` most likely tokens (most likely first) with their log-probs; every rank of the MP
        group, on the host, zeros outside the response (the distillation teacher's pass for a top-k loss)."""
        with torch.no_grad():
            sampled_BT, logp_BTK, ids_BTK = self._forward_rows(
                batch, partial(self._topk_head, k, temperature), ("logprobs", "topk_logprobs", "topk_ids"),
                batching=batching, widths={"topk_logprobs": k, "topk_ids": k})
        return sampled_BT, logp_BTK, ids_BTK.long()

    def _greedy_head(self, mb: _Micro, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        (match_BT,) = self._response_tokens(output, mb, self._greedy_matches)
        return match_BT.sum() * 0.0, {"greedy": match_BT}

    def greedy_matches(self, batch: RolloutBatch, *, batching: MicroBatching) -> torch.Tensor:
        """``[B, T]``: 1 where a response token is the model's greedy (argmax) choice after the tokens before it, 0
        elsewhere and at masked positions (teacher-forced). A row that matches at every response token is exactly
        what greedy decoding from its prompt writes: one forward pass measures greedy accuracy, at any layout."""
        return self._forward_rows(batch, self._greedy_head, ("greedy",), batching=batching)[0]

    def compute_log_probs(self, batch: RolloutBatch, *, batching: MicroBatching, temperature: float = 1.0,
                          old_pass: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs_BT, entropy_BT)`` of the response tokens, on every rank of the MP group, on the host (as
        the loop's batches are); ``batch`` moves to this rank's device once, here. ``old_pass``: the actor's
        old-log-prob pass, where router replay acts — R3 routes as the engine did, R2 records this pass's routing
        into ``batch.*_routed_experts`` for the update."""
        head: Head = partial(self._loss, None, temperature)
        rr, mode = self.router_replay, self.router_replay_mode
        if old_pass and mode == "R3" and batch.prompt_routed_experts is None:
            raise RuntimeError("actor_rollout_ref.actor.router_replay.mode=R3: the batch has no routed experts (the "
                               "rollout engine returned none although asked); use an engine that records them, or R2")
        with self._routing(replay=old_pass and mode == "R3", record=old_pass and mode == "R2"):
            both = self._forward_rows(batch, head, ("logprobs", "entropy"), batching=batching)
        if rr is not None and old_pass:
            if mode == "R2":
                self._store_routing(batch)
            mismatched, compared = rr.take_mismatch()
            self.replay_metrics = ({"router_replay/engine_mismatch": mismatched / compared} if compared else {})
        return both[0], both[1]

    @contextlib.contextmanager
    def _routing(self, *, replay: bool, record: bool) -> Iterator[None]:
        """Router replay's mode for the passes inside (none without router replay)."""
        rr = self.router_replay
        if rr is None:
            yield
            return
        rr.replaying, rr.recording = replay, record
        try:
            yield
        finally:
            rr.replaying = rr.recording = False

    def _store_routing(self, batch: RolloutBatch) -> None:
        """The routing the last pass recorded, into ``batch.{prompt,response}_routed_experts`` (host; -1 in the MoE
        layers of other pipeline stages, which never read them)."""
        assert self.router_replay is not None and self.arch.moe is not None
        B, P = batch.prompt_ids.shape
        T = batch.response_ids.shape[1]
        L, k = self.router_replay.num_slots, self.arch.moe.top_k
        prompt_BPLK = torch.full((B, P, L, k), -1, dtype=torch.int16)
        response_BTLK = torch.full((B, T, L, k), -1, dtype=torch.int16)
        for mb, slots in self.router_replay.take_recorded():
            b, S = mb.rows.tokens_BS.shape
            packed = torch.full((b, S, L, k), -1, dtype=torch.long, device=mb.rows.tokens_BS.device)
            for slot, idx_bSk in slots.items():
                packed[:, :, slot] = idx_bSk
            p_bPLK, r_bTLK = unpacked_routing(packed, mb.batch, mb.rows)
            real = (mb.index >= 0).cpu()
            rows = mb.index.cpu()[real]
            prompt_BPLK[rows], response_BTLK[rows] = p_bPLK.cpu()[real], r_bTLK.cpu()[real]
        batch.prompt_routed_experts, batch.response_routed_experts = prompt_BPLK, response_BTLK

    def train_step(self, batch: RolloutBatch, loss_fn: LossFn, *, batching: MicroBatching, loss_agg_mode: str,
                   temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over ``batch`` (this DP rank's share of a mini-batch); the loss is aggregated
        as ``loss_agg_mode`` says over the whole mini-batch (all DP ranks). ``batch`` moves to this rank's
        device unless it is there already (``ActorRolloutRef.update_actor`` moves the whole batch once)."""
        with self._routing(replay=True, record=False):  # the batch's recorded routing, if it has any
            metrics = self._train_step(
                batch, lambda normalizer: partial(self._loss, partial(loss_fn, normalizer=normalizer), temperature),
                batching=batching, loss_agg_mode=loss_agg_mode)
        return metrics | self._update_mismatch()

    def _update_mismatch(self) -> dict[str, float]:
        """``router_replay_mismatch``: the share of (token, MoE layer) pairs of the last update whose own top-k
        differed from the replayed one (none without router replay)."""
        if self.router_replay is None:
            return {}
        mismatched, compared = self.router_replay.take_mismatch()
        return {"router_replay_mismatch": mismatched / compared} if compared else {}

    def train_step_on_policy(self, batch: RolloutBatch, loss_fn: LossFn, *, batching: MicroBatching,
                             loss_agg_mode: str, temperature: float = 1.0
                             ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """``train_step`` of a provably on-policy update (the caller's to prove: one PPO epoch of one
        mini-batch on the weights the old log-probs would come from): π_old is this forward's own detached
        log-probs, so the ratio is 1 and the separate old-log-prob pass is not needed (TRL's and verl's
        shortcut). ``batch`` has no ``old_logprobs``; returns the metrics and the ``(logprobs_BT, entropy_BT)``
        used as π_old, as ``compute_log_probs`` returns them (every MP rank, host, masked)."""
        if batch.old_logprobs is not None:
            raise ValueError("train_step_on_policy: the batch already has old_logprobs; use train_step")
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # each micro-batch's (logprobs, entropy), in order
        rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # ... with its rows' batch index

        def head_for(normalizer: torch.Tensor) -> Head:
            def on_policy(logp_BT: torch.Tensor, ent_BT: torch.Tensor, mb: RolloutBatch, **extra: torch.Tensor
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                mb.old_logprobs = logp_BT.detach()
                seen.append((mb.old_logprobs, ent_BT.detach()))
                return loss_fn(logp_BT, ent_BT, mb, normalizer=normalizer, **extra)

            def head(mb: _Micro, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                out = self._loss(on_policy, temperature, mb, logits)
                rows.append((mb.index, *seen.pop()))
                return out
            return head

        with self._routing(replay=True, record=False):  # R3: the engine's routing (R2 has none yet: on-policy)
            metrics = self._train_step(batch, head_for, batching=batching, loss_agg_mode=loss_agg_mode)
        metrics |= self._update_mismatch()
        B, T = batch.response_ids.shape
        both = torch.zeros(2, B, T, device=self.device)
        for index, logp_bT, ent_bT in rows:  # empty but on the last pipeline stage
            real = index >= 0
            both[0, index[real]], both[1, index[real]] = logp_bT[real].float(), ent_bT[real].float()
        self._broadcast_from_last_stage(both)
        both = (both * batch.response_mask.to(self.device).float()).cpu()
        return metrics, both[0], both[1]

    # ---- weights ----
    def export_weights(self, *, bucket_bytes: int) -> Iterator[WeightBucket]:
        """HF-named full tensors in buckets, the same stream on every rank (TP-gathered, PP-broadcast)."""
        return export_hf_weights(self.chunks, self.arch, bucket_bytes=bucket_bytes,
                                 merge=None if self.lora is None else self.lora.merger())  # LoRA: W + s·B·A


def reference_policy(actor: MegatronPolicy, *, model_dir: str, megatron: MegatronConfig,
                     pad_token_id: int) -> MegatronPolicy:
    """π_ref of ``actor`` (the RL ref, DPO's reference): under LoRA the actor itself — its frozen base, scored with
    the adapters off (:func:`reference_log_probs`), no second copy of the weights; else a frozen copy of the start
    model (no gradients, no optimizer) in the actor's layout and dtype."""
    if actor.lora is not None:
        return actor
    return MegatronPolicy(model_dir=model_dir, megatron=megatron, optim=None, total_steps=0, pad_token_id=pad_token_id)


def reference_log_probs(ref: MegatronPolicy, batch: RolloutBatch, *, batching: MicroBatching,
                        temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` log π_ref of every response token of ``batch`` (a LoRA policy with its adapters off)."""
    with ref.lora.disabled() if ref.lora is not None else contextlib.nullcontext():
        logp_BT, _ = ref.compute_log_probs(batch, batching=batching, temperature=temperature)
    return logp_BT

