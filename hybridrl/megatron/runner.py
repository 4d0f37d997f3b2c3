"""A Megatron model of the RL loop run through Megatron's schedule: what actor, ref and critic share.

:class:`MegatronRunner` holds this rank's model chunks (one per virtual stage; one without VPP), each
wrapped in Megatron's DDP under one optimizer and LR scheduler when trainable, frozen otherwise; it cuts a
DP rank's samples into micro-batches and runs them through Megatron's forward-backward schedule, so PP
(1F1B, or interleaved 1F1B over VPP model chunks) and gradient accumulation over micro-batches are
Megatron's. What a model computes from its last stage's output is a *head* (a function of the micro-batch
and that output returning its loss and metrics): :class:`~hybridrl.megatron.policy.MegatronPolicy` turns
logits into token log-probs, :class:`~hybridrl.megatron.critic.MegatronCritic` reads values. Results are
computed on the last pipeline stage and broadcast to the other stages, so every rank of a model-parallel
group holds the same tensors afterwards (SPMD: the loop has no rank branches). Micro-batches are either
fixed-size (every row padded to the batch's longest) or, with a token budget, length-grouped and each
padded to its own longest row (:mod:`dynamic_batch`); shapes then differ between micro-batches and the
pipeline sends each activation's shape ahead of it. A row is one sample (:mod:`sequences`) or, with
``MicroBatching.shared_prompts``, one prompt and several of its samples with an explicit mask and positions
(:mod:`prefix_grouper`). With ``returns_hidden_states`` (the policy's fused LM head) the last stage's output is
its final hidden states instead of logits (:mod:`hidden_states`).

With CP > 1 each rank feeds its share of the positions (Megatron's load-balanced chunks,
:mod:`context_parallel`) and the heads gather per-token results back to whole sequences, so every CP rank
computes the same loss; the gradient of that loss is summed over CP (the schedule's ×CP and DDP's
1/(DP·CP) cancel to a sum over CP and a mean over DP).

Loss scaling: the schedule divides each micro-batch loss by the number of micro-batches and Megatron's DDP
averages gradients over DP. :meth:`MegatronRunner._train_step` computes the *global* (mini-batch, all-DP)
normaliser of the loss aggregation mode (:mod:`hybridrl.algorithms.loss_agg`) and hands it to the head,
whose loss is its micro-batch loss divided by it; the scaling is undone here (× num_microbatches × DP), so
the accumulated gradient is exactly that of the mini-batch loss.

Precision (``megatron.dtype``): with bfloat16/float16 the chunks are Megatron's ``Float16Module``s
(:func:`~hybridrl.megatron.model.build_model_chunks`) and the optimizer is Megatron's mixed-precision one
(``Float16OptimizerWithFloat16Params``, or the distributed optimizer with fp32 main-parameter shards): fp32
main weights, gradients accumulated and reduced in fp32 (``grad_reduce_in_fp32``), the update computed in
fp32 and copied back into the 16-bit parameters. float16 adds Megatron's dynamic loss scaling (the schedule
multiplies each loss by ``optimizer.scale_loss``; a step whose gradients overflow is skipped,
``update_skipped`` = 1, and the scale halves).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import MegatronModule

from hybridrl.algorithms.loss_agg import local_normalizer
from hybridrl.batch import RolloutBatch
from hybridrl.guards import agree
from hybridrl.hf.arch import HFArch
from hybridrl.megatron.config import MegatronConfig, MicroBatching, OptimConfig, interleaved_micro_batches_problem
from hybridrl.megatron.context_parallel import shard_sequence
from hybridrl.megatron.cpu import causal_attention_mask
from hybridrl.megatron.hidden_states import returning_hidden_states
from hybridrl.megatron.micro_batches import MicroBatch, MicroBatcher
from hybridrl.megatron.model import TORCH_DTYPES, use_transformer_engine
from hybridrl.megatron.moe_compat import drop_empty_parts
from hybridrl.megatron.optimizer_overrides import optimizer_config_problems
from hybridrl.megatron.packed_attention import SharedPrefixParams
from hybridrl.megatron.parallel import ParallelConfig, rank_device
from hybridrl.megatron.rope_positions import positioned_rope
from hybridrl.megatron.router_losses import router_loss_metrics
from hybridrl.megatron.router_replay import RouterReplay
from hybridrl.megatron.sequences import PackedRows
from hybridrl.vlm.megatron_vlm import forward_rows


def parallel_config(m: MegatronConfig) -> ParallelConfig:
    return ParallelConfig(tensor_model_parallel_size=m.tensor_model_parallel_size,
                          pipeline_model_parallel_size=m.pipeline_model_parallel_size,
                          virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
                          context_parallel_size=m.context_parallel_size, sequence_parallel=m.sequence_parallel,
                          expert_model_parallel_size=m.expert_model_parallel_size,
                          expert_tensor_parallel_size=m.expert_tensor_parallel_size)


# float16's first loss scale: torch.amp.GradScaler's default. Megatron's (2**32) overflows fp16 gradients at
# once and skips the first ~17 steps while it halves; 2**16 is enough headroom for the losses of RL (≈ 1).
FP16_INITIAL_LOSS_SCALE = 2.0**16


def _mixed_precision_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    """Megatron ``OptimizerConfig`` fields for ``dtype``: fp32 main params/grads and Adam state (Megatron's
    defaults) under bf16/fp16; fp16 with dynamic loss scaling (``loss_scale=None``)."""
    return dict(params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                initial_loss_scale=FP16_INITIAL_LOSS_SCALE)


_Micro = MicroBatch  # the name the heads (policy, critic) annotate with

Head = Callable[[_Micro, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""A micro-batch and the last stage's output → its (unscaled) loss and metrics (detached)."""


class MegatronRunner:
    """This rank's model chunks, trainable when ``optim`` is given (DDP + optimizer + LR scheduler), frozen
    otherwise; forward and backward passes over micro-batches through Megatron's schedule."""

    # Float16Module's fp32_output: False keeps the last stage's output in the model's dtype (the policy computes
    # log-probs in fp32 from bf16 logits without a full-vocabulary fp32 copy)
    fp32_output: ClassVar[bool] = True
    # the last stage's output is its final hidden states [s, b, h], not the output layer's (hidden_states.py)
    returns_hidden_states: bool = False
    # an MoE actor's router replay hooks (router_replay.py): the forward step tells them each micro-batch
    router_replay: RouterReplay | None = None

    def __init__(self, chunks: list[MegatronModule], *, arch: HFArch, megatron: MegatronConfig,
                 optim: OptimConfig | None, total_steps: int, pad_token_id: int) -> None:
        """``chunks``: built and loaded (:func:`~hybridrl.megatron.model.build_model_chunks`)."""
        self.arch = arch
        self.parallel = parallel_config(megatron)
        self.pad_token_id = pad_token_id
        self.dtype = TORCH_DTYPES[megatron.dtype]
        self.device = rank_device()
        self.micro_batches = MicroBatcher(self.parallel, pad_token_id=pad_token_id, device=self.device)
        self.config = chunks[0].config  # shared by all chunks
        self.optimizer = None
        self.scheduler: OptimizerParamScheduler | None = None
        self._causal_masks: dict[int, torch.Tensor | None] = {}
        # "forward" / "update" -> [real token positions, computed positions] of the passes since it was last read
        # (perf/padding_share/*: ActorRolloutRef.take_padding_metrics)
        self.padding_tally: dict[str, list[int]] = {}
        if optim is None:
            for chunk in chunks:
                chunk.requires_grad_(False)
            self.chunks: list[torch.nn.Module] = list(chunks)
        else:
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=megatron.use_distributed_optimizer)
            ddp = [DistributedDataParallel(config=self.config, module=chunk, ddp_config=ddp_config) for chunk in chunks]
            self.chunks = list(ddp)
            self.config.finalize_model_grads_func = finalize_model_grads
            # the interleaved schedule enters every chunk's no_sync when given a list
            self.config.no_sync_func = [d.no_sync for d in ddp] if len(ddp) > 1 else ddp[0].no_sync
            if problems := optimizer_config_problems(
                    optim.optimizer, optim.override_optimizer_config, key="optim", megatron_key="megatron",
                    distributed_optimizer=megatron.use_distributed_optimizer, device_type=self.device.type,
                    transformer_engine=use_transformer_engine()):
                raise ValueError("; ".join(f"{key}={value!r}: {message}" for key, value, message in problems))
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer=optim.optimizer, lr=optim.lr, min_lr=0.0, weight_decay=optim.weight_decay,
                                adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                                clip_grad=optim.clip_grad, use_distributed_optimizer=megatron.use_distributed_optimizer,
                                **_mixed_precision_kwargs(self.dtype),
                                **optim.override_optimizer_config),  # verbatim (optimizer_overrides.py)
                self.chunks,
            )
            drop_empty_parts(self.optimizer)  # LoRA on the experts only (moe_compat item 3)
            self.config.grad_scale_func = self.optimizer.scale_loss  # × the loss scale (1 unless float16)
            self.scheduler = OptimizerParamScheduler(
                self.optimizer, init_lr=0.0 if optim.lr_warmup_steps else optim.lr, max_lr=optim.lr, min_lr=0.0,
                lr_warmup_steps=optim.lr_warmup_steps, lr_decay_steps=max(total_steps, 1),
                lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
                wd_incr_steps=max(total_steps, 1), wd_incr_style="constant",
            )


    # ---- forward passes through Megatron's schedule ----
    def _run(self, micros: list[_Micro], head: Head, *, forward_only: bool) -> list[dict[str, torch.Tensor]]:
        shapes = {tuple(m.rows.tokens_BS.shape) for m in micros}
        tally = self.padding_tally.setdefault("forward" if forward_only else "update", [0, 0])
        for m in micros:
            tally[0] += m.rows.real_positions(m.index >= 0)
            tally[1] += m.rows.tokens_BS.numel()
        for s in {m.rows.seq_len for m in micros if not m.rows.shared_prompts}:  # kept from step to step
            if s not in self._causal_masks:
                self._causal_masks[s] = causal_attention_mask(s, self.device)
        masks = self._causal_masks
        scale = len(micros) * parallel_state.get_data_parallel_world_size()
        # token-budget micro-batches differ in shape: the pipeline then sends each activation's shape first
        self.config.variable_seq_lengths = len(shapes) > 1
        fp16_kwargs = {"fp32_output": False} if self.dtype != torch.float32 and not self.fp32_output else {}

        def forward_step(data_iterator: Iterator[_Micro], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            rows = mb.rows
            if self.router_replay is not None:
                self.router_replay.before_forward(model, mb.batch, rows)
            with returning_hidden_states(model) if self.returns_hidden_states else contextlib.nullcontext():
                if rows.packed:  # THD: positions restart and attention stays inside each sequence
                    cu = rows.cu_seqlens_padded
                    assert cu is not None and rows.position_ids_BS is not None
                    output = model(input_ids=shard_sequence(rows.tokens_BS, cu_seqlens=cu),
                                   position_ids=shard_sequence(rows.position_ids_BS, cu_seqlens=cu),
                                   attention_mask=None, packed_seq_params=_packed_seq_params(rows), **fp16_kwargs)
                elif rows.blocks is not None:  # shared-prompt groups in one row: blocks, explicit positions
                    assert rows.position_ids_BS is not None
                    with positioned_rope(model, rows.position_ids_BS):
                        output = model(input_ids=rows.tokens_BS, position_ids=rows.position_ids_BS,
                                       attention_mask=None, packed_seq_params=_shared_prefix_params(rows),
                                       **fp16_kwargs)
                elif rows.shared_prompts:  # explicit positions and mask per row (prefix_grouper; CP = 1)
                    assert rows.position_ids_BS is not None
                    with positioned_rope(model, rows.position_ids_BS):
                        output = model(input_ids=rows.tokens_BS, position_ids=rows.position_ids_BS,
                                       attention_mask=rows.attention_mask, **fp16_kwargs)
                elif self.arch.vision is not None:  # image features into the first stage, multimodal positions
                    output = forward_rows(model, self.arch, rows.tokens_BS, rows.prompt_len_B,
                                          rows.prompt_len_B + rows.response_mask_BT.sum(-1),
                                          [m.images for m in mb.batch.meta], masks[rows.seq_len],
                                          loss_mask_BT=mb.batch.loss_mask, **fp16_kwargs)
                else:
                    tokens_BS = rows.tokens_BS
                    position_ids_BS = torch.arange(rows.seq_len, device=tokens_BS.device)[None].expand_as(tokens_BS)
                    output = model(input_ids=shard_sequence(tokens_BS), position_ids=shard_sequence(position_ids_BS),
                                   attention_mask=masks[rows.seq_len], **fp16_kwargs)
            if self.router_replay is not None:
                self.router_replay.after_forward(model, mb, rows)
            return output, partial(_scaled, head, mb, scale)

        self._check_interleaving(len(micros))
        fwd_bwd = get_forward_backward_func(pp_size=self.parallel.pipeline_model_parallel_size,
                                            vp_size=self.parallel.virtual_pipeline_model_parallel_size)
        return fwd_bwd(forward_step_func=forward_step, data_iterator=[iter(micros) for _ in self.chunks],
                       model=self.chunks, num_microbatches=len(micros), seq_length=max(s for _, s in shapes),
                       micro_batch_size=max(b for b, _ in shapes), forward_only=forward_only)

    def _check_interleaving(self, n_micro: int) -> None:
        """Megatron's interleaved schedule needs the micro-batch count to be a multiple of PP (its
        ``microbatch_group_size_per_vp_stage``, which defaults to PP); say so in config terms."""
        pp, vpp = self.parallel.pipeline_model_parallel_size, self.parallel.virtual_pipeline_model_parallel_size
        if vpp is not None and n_micro % pp:
            raise ValueError(interleaved_micro_batches_problem(pp, vpp) + f", got {n_micro}")

    def _pad_for_interleaving(self, micros: list[_Micro]) -> list[_Micro]:
        """Forward-only passes: repeat the last micro-batch up to a multiple of PP under the interleaved
        schedule (its outputs are dropped), so any log-prob micro-batch size works."""
        if self.parallel.num_model_chunks == 1:
            return micros
        short = -len(micros) % self.parallel.pipeline_model_parallel_size
        return micros + [micros[-1]] * short

    @torch.no_grad()
    def _forward_rows(self, batch: RolloutBatch, head: Head, keys: tuple[str, ...], *,
                      batching: MicroBatching, widths: Mapping[str, int] | None = None) -> list[torch.Tensor]:
        """The head's per-response-token outputs ``keys`` of every row of ``batch``, ``[B, T]`` each (``[B, T, w]``
        for a key of ``widths``: w values per token), fp32, on every rank of the MP group, masked, on the host (as
        the loop's batches are); ``batch`` moves to this rank's device once, here."""
        for chunk in self.chunks:
            chunk.eval()
        batch = batch.to(self.device)
        micros = self._pad_for_interleaving(self.micro_batches(batch, batching))
        outputs = self._run(micros, head, forward_only=True)
        B, T = batch.response_ids.shape
        w = [(widths or {}).get(key, 0) for key in keys]  # 0: a [B, T] output
        ends = list(itertools.accumulate(max(x, 1) for x in w))
        rows = torch.zeros(B, T, ends[-1], device=self.device)  # every key side by side: one PP broadcast
        if parallel_state.is_pipeline_last_stage():
            for mb, out in zip(micros, outputs, strict=True):
                real = mb.index >= 0
                for key, x, end in zip(keys, w, ends, strict=True):
                    rows[mb.index[real], :, end - max(x, 1):end] = out[key][real].float().view(-1, T, max(x, 1))
        self._broadcast_from_last_stage(rows)
        rows = (rows * batch.response_mask.float()[:, :, None]).cpu()
        return [rows[:, :, end - x:end] if x else rows[:, :, end - 1] for x, end in zip(w, ends, strict=True)]

    def _train_step(self, batch: RolloutBatch, head_for: Callable[[torch.Tensor], Head], *,
                    batching: MicroBatching, loss_agg_mode: str) -> dict[str, float]:
        """One optimizer step over ``batch`` (this DP rank's share of a mini-batch) with the head
        ``head_for(normalizer)``, whose loss is aggregated as ``loss_agg_mode`` says over the whole mini-batch
        (all DP ranks): ``normalizer`` is that mode's denominator over the mini-batch. ``batch`` moves to this
        rank's device unless it is there already (the caller moves the whole batch once)."""
        assert self.optimizer is not None and self.scheduler is not None, "train_step on a frozen model"
        if batching.max_tokens is None and len(batch) % batching.micro_batch_size:
            raise ValueError(f"mini-batch share of {len(batch)} samples is not a multiple of the "
                             f"micro-batch size {batching.micro_batch_size}")
        batch = batch.to(self.device)
        normalizer = local_normalizer(batch.loss_mask, loss_agg_mode).double()
        dist.all_reduce(normalizer, group=parallel_state.get_data_parallel_group())
        head = head_for(normalizer.clamp_min(1).float())
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()  # type: ignore[operator]
        self.optimizer.zero_grad()
        micros = self.micro_batches(batch, batching)
        outputs = self._run(micros, head, forward_only=False)
        # the schedule's finalize_model_grads moved a sigmoid router's expert bias by this mini-batch's expert loads
        # (aux-loss-free balancing, override_transformer_config.moe_router_bias_update_rate); the loads start again
        # from 0 for the next one, as Megatron-LM's train step resets them
        reset_model_temporary_tensors(self.config, self.chunks)
        # float16: Megatron's loss scaler finds inf/NaN gradients itself, skips the update and halves the scale
        # (an overflow is routine there); else a non-finite loss or gradient never reaches the weights
        # (guards.py): fp32/bf16 Adam would step on it
        grads_nonfinite = not self.config.fp16 and not self._grads_finite()
        if not grads_nonfinite:
            ok, grad_norm, _ = self.optimizer.step()  # fp16: False when the loss scaler found an overflow
        else:
            ok, grad_norm = False, float("nan")
            for chunk in self.chunks:
                chunk.zero_grad_buffer()  # type: ignore[operator]
        if ok:  # as Megatron-LM: a skipped update does not advance the LR schedule
            self.scheduler.step(increment=1)
        metrics = self._reduce_metrics(outputs, [float(m.batch.loss_mask.sum()) for m in micros])
        if self.arch.moe is not None:  # the router losses, when override_transformer_config turns them on
            metrics |= router_loss_metrics(self.config, num_micro_batches=len(micros),
                                           num_moe_layers=sum(self.arch.moe.sparse_layers))
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["update_skipped"] = float(not ok)  # for any reason, fp16 overflows included
        metrics["grad_nonfinite"] = float(grads_nonfinite)  # skipped by the non-finite guard (not fp16)
        if self.config.fp16:
            metrics["loss_scale"] = float(self.optimizer.get_loss_scale())
        return metrics

    def _reduce_metrics(self, outputs: list[dict[str, torch.Tensor]], tokens: list[float]) -> dict[str, float]:
        """Over micro-batches and DP ranks, from the last PP stage: ``*_sum`` keys are summed (they are
        already normalised globally); the others are per-micro-batch token means, so they are weighted by
        each micro-batch's response tokens — the result is the mini-batch's token mean whatever the
        micro-batch sizes (fixed or token-budget) and the DP split."""
        local: dict[str, float] = {}
        for k in outputs[0] if outputs else []:
            vals = [float(o[k]) for o in outputs]
            local[k] = sum(vals) if k.endswith("_sum") else sum(v * w for v, w in zip(vals, tokens, strict=True))
        box: list[Any] = [local]
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                       group=parallel_state.get_pipeline_model_parallel_group())
        keys = sorted(box[0])
        sums = torch.tensor([box[0][k] for k in keys] + [sum(tokens)], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        total = max(float(sums[-1]), 1.0)
        return {k.removesuffix("_sum"): float(v) / (1.0 if k.endswith("_sum") else total)
                for k, v in zip(keys, sums[:-1], strict=True)}

    @staticmethod
    def _broadcast_from_last_stage(t: torch.Tensor) -> None:  # t on the device: the PP group is NCCL on GPUs
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(t, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())

    def _grads_finite(self) -> bool:
        """Every rank's accumulated gradients are finite (one flag all-reduce over the host group)."""
        # the DDP grad buffers hold every main_grad (one check per buffer, not three ops per parameter)
        ddp = cast(list[DistributedDataParallel], self.chunks)  # trainable: every chunk is Megatron's DDP
        # a sum is non-finite exactly when an entry is (NaN and ±inf propagate; finite gradients do not sum past
        # fp32's 3.4e38): one reduction, no [N] mask
        local = all(bool(torch.isfinite(buffer.grad_data.sum())) for d in ddp
                    for buffer in (*d.buffers, *d.expert_parallel_buffers))
        return agree(None if local else "non-finite gradients") is None

    # ---- weights ----
    def parameters(self) -> Iterator[torch.Tensor]:
        """This rank's parameters (its TP/PP shards), every model chunk."""
        for chunk in self.chunks:
            yield from chunk.parameters()


def _packed_seq_params(rows: PackedRows) -> PackedSeqParams:
    """Megatron's description of a packed row: real and padded sequence boundaries, the longest padded sequence."""
    assert rows.cu_seqlens is not None and rows.cu_seqlens_padded is not None
    longest = int((rows.cu_seqlens_padded[1:] - rows.cu_seqlens_padded[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=rows.cu_seqlens, cu_seqlens_kv=rows.cu_seqlens,
                           cu_seqlens_q_padded=rows.cu_seqlens_padded, cu_seqlens_kv_padded=rows.cu_seqlens_padded,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _shared_prefix_params(rows: PackedRows) -> SharedPrefixParams:
    """The blocks of a row of shared-prompt groups, for the core attention; its longest position for RoPE's table."""
    assert rows.position_ids_BS is not None
    longest = int(rows.position_ids_BS.max()) + 1
    return SharedPrefixParams(qkv_format="sbhd", blocks=rows.blocks, max_seqlen_q=longest, max_seqlen_kv=longest)


def _scaled(head: Head, mb: _Micro, scale: int, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The head's loss × micro-batches × DP: undoes the schedule's and DDP's averaging (module docstring)."""
    loss, metrics = head(mb, output)
    return loss * scale, metrics
