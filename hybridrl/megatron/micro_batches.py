"""A DP rank's samples cut into micro-batches, in the layout the model reads them (:mod:`sequences`).

Fixed-size micro-batches padded to the batch's longest row; with a token budget, length-grouped ones each padded to its
own longest row (:mod:`dynamic_batch`); with ``MicroBatching.shared_prompts`` a prompt's samples share a row
(:mod:`prefix_grouper`); with ``MicroBatching.packed`` each micro-batch's samples follow one another in one row (THD,
:func:`~hybridrl.megatron.sequences.pack_sequences`; ``use_remove_padding``). At EP > 1 the EP ranks exchange their
tokens in every MoE layer, so micro-batch k has one shape on all of them (agreed here over the EP group).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hybridrl.batch import RolloutBatch
from hybridrl.megatron.config import MicroBatching
from hybridrl.megatron.dynamic_batch import (
    VPP_DYNAMIC_UNSUPPORTED,
    padded_len,
    split_to_count,
    token_budget_partition,
    token_sum_partition,
)
from hybridrl.megatron.parallel import ParallelConfig
from hybridrl.megatron.prefix_grouper import group_rows, pack_groups, pack_groups_in_one_row, partition_rows
from hybridrl.megatron.sequences import PackedRows, pack_rows, pack_sequences, padded_seq_len


@dataclass(slots=True, kw_only=True)
class MicroBatch:
    """Samples of one micro-batch and the rows the model reads them in."""

    batch: RolloutBatch
    rows: PackedRows
    index: torch.Tensor  # [b] long: each row's position in the batch it came from; -1 for a filler row


# rows are padded to a multiple of this (and of 2·CP: CP's load-balanced chunks): 8 on a GPU, for fewer distinct
# shapes; none on a CPU, where every padded position is paid for in full and shapes cost nothing
_PAD_MULTIPLE = {True: 8, False: 1}


class MicroBatcher:
    """Cuts batches for one model's layout (``parallel``) on ``device``."""

    def __init__(self, parallel: ParallelConfig, *, pad_token_id: int, device: torch.device) -> None:
        self.parallel = parallel
        self.pad_token_id = pad_token_id
        self.device = device

    def __call__(self, batch: RolloutBatch, batching: MicroBatching) -> list[MicroBatch]:
        """``batch`` cut as ``batching`` says (module docstring): shared-prompt rows, packed rows, or padded rows —
        fixed-size micro-batches padded to the batch's longest row, or, with a token budget, length-grouped ones each
        padded to its own longest row (:mod:`dynamic_batch`)."""
        micro_batch_size, max_tokens = batching.micro_batch_size, batching.max_tokens
        multiple = math.lcm(_PAD_MULTIPLE[self.device.type == "cuda"], 2 * self.parallel.context_parallel_size)
        if batching.shared_prompts:
            return self._shared_prompt_micro_batches(batch, batching, multiple)
        if batching.packed:
            return self._packed_micro_batches(batch, batching)
        if max_tokens is None:
            parts = list(torch.arange(len(batch), device=batch.prompt_ids.device).split(micro_batch_size))
            if self.parallel.expert_model_parallel_size > 1:  # one count over the EP ranks: shares may differ by one
                empty = torch.zeros(0, dtype=torch.long, device=batch.prompt_ids.device)
                parts += [empty] * (self._most_over_experts([len(parts)])[0] - len(parts))
        else:
            interleaved = self.parallel.num_model_chunks > 1
            if interleaved and dist.get_backend() == "gloo":  # config validation says so first, naming the keys
                raise ValueError(f"token-budget micro-batches with the interleaved pipeline schedule: "
                                 f"{VPP_DYNAMIC_UNSUPPORTED}")
            lengths = (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).tolist()
            groups = token_budget_partition(lengths, max_tokens=max_tokens, multiple=multiple)
            count = len(groups)
            if self.parallel.expert_model_parallel_size > 1:  # one count over the EP ranks (dynamic_batch)
                count = self._most_over_experts([count])[0]
            if interleaved:  # the interleaved schedule runs its micro-batches in groups of PP
                pp = self.parallel.pipeline_model_parallel_size
                count = -(-count // pp) * pp
            groups = split_to_count(groups, count)
            parts = [torch.tensor(p, dtype=torch.long, device=batch.prompt_ids.device) for p in groups]
            return self._budget_micro_batches(batch, parts, multiple)
        seq_len = self._common_over_experts(padded_seq_len(batch, multiple=multiple))
        out = []
        for index in parts:
            part = batch.index(index)
            if len(part) < micro_batch_size:  # equal shapes: fill with copies of row 0 (its routing as recorded)
                part, index = _filled(batch, part, index, micro_batch_size - len(part), whole_row=True)
            rows = pack_rows(part, seq_len=seq_len, pad_token_id=self.pad_token_id)
            out.append(MicroBatch(batch=part, rows=rows, index=index))
        return out

    def _budget_micro_batches(self, batch: RolloutBatch, parts: list[torch.Tensor], multiple: int) -> list[MicroBatch]:
        """Token-budget micro-batches, each padded to its own longest row; at EP > 1 micro-batch k has one shape on
        every EP rank (the most rows and the longest row over them: Megatron's all-gather dispatcher needs equal
        shapes), the extra rows fillers whose loss mask is 0."""
        shapes = [(len(p), padded_seq_len(batch.index(p), multiple=multiple) if len(p) else 2) for p in parts]
        if self.parallel.expert_model_parallel_size > 1:
            most = self._most_over_experts([x for shape in shapes for x in shape])
            shapes = list(zip(most[0::2], most[1::2], strict=True))
        out = []
        for index, (rows_needed, seq_len) in zip(parts, shapes, strict=True):
            part = batch.index(index)
            if len(part) < rows_needed:
                part, index = _filled(batch, part, index, rows_needed - len(part))
            out.append(MicroBatch(batch=part, rows=pack_rows(part, seq_len=seq_len, pad_token_id=self.pad_token_id),
                              index=index))
        return out

    def _packed_micro_batches(self, batch: RolloutBatch, batching: MicroBatching) -> list[MicroBatch]:
        """Each micro-batch's samples end to end in one row (:func:`~hybridrl.megatron.sequences.pack_sequences`):
        the fixed-size micro-batches' samples, or bins whose summed lengths fit the token budget
        (:func:`token_sum_partition`). Each sequence is rounded up to 2·CP (CP's chunks), the row to CP·TP under
        sequence parallelism; at EP > 1 micro-batch k has one length on every EP rank (:meth:`_budget_micro_batches`'
        reason), a rank short of samples packing a one-token filler. Under the interleaved schedule on gloo every
        micro-batch of the pass has the longest one's length (variable shapes are ``VPP_DYNAMIC_UNSUPPORTED`` there)."""
        cp, tp = self.parallel.context_parallel_size, self.parallel.tensor_model_parallel_size
        per_sequence = 2 * cp if cp > 1 else 1
        total = math.lcm(per_sequence, cp * tp if self.parallel.sequence_parallel else 1,
                         _PAD_MULTIPLE[self.device.type == "cuda"])
        lengths = (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).tolist()
        if batching.max_tokens is None:
            groups = [list(range(i, min(i + batching.micro_batch_size, len(batch))))
                      for i in range(0, len(batch), batching.micro_batch_size)]
        else:
            groups = token_sum_partition(lengths, max_tokens=batching.max_tokens, multiple=per_sequence)
        count = len(groups)
        if self.parallel.expert_model_parallel_size > 1:  # one count over the EP ranks (dynamic_batch)
            count = self._most_over_experts([count])[0]
        if batching.max_tokens is not None and self.parallel.num_model_chunks > 1:  # groups of PP (interleaved)
            pp = self.parallel.pipeline_model_parallel_size
            count = -(-count // pp) * pp
        groups = split_to_count(groups, count)
        sizes = [padded_len(sum(-(-lengths[i] // per_sequence) * per_sequence for i in g) or 1, total)
                 for g in groups]
        if self.parallel.expert_model_parallel_size > 1:
            sizes = self._most_over_experts(sizes)
        if self.parallel.num_model_chunks > 1 and dist.get_backend() == "gloo":  # one shape (VPP_DYNAMIC_UNSUPPORTED)
            sizes = [max(sizes)] * len(sizes)
        out = []
        for group, size in zip(groups, sizes, strict=True):
            index = torch.tensor(group, dtype=torch.long, device=batch.prompt_ids.device)
            part = batch.index(index)
            if not group:
                part, index = _filled(batch, part, index, 1)
            rows = pack_sequences(part, pad_token_id=self.pad_token_id, multiple=per_sequence, total_multiple=total,
                                  total_len=size)
            out.append(MicroBatch(batch=part, rows=rows, index=index))
        return out

    def _most_over_experts(self, values: list[int]) -> list[int]:
        """Each of ``values``' maximum over the expert-parallel group."""
        most = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group())
        return most.tolist()

    def _common_over_experts(self, seq_len: int) -> int:
        """``seq_len``, or the longest over the expert-parallel group at EP > 1: the EP ranks exchange their tokens
        in every MoE layer (Megatron's all-gather dispatcher needs equal shapes on them; the all-to-all one the same
        number of micro-batches), so their micro-batches must have one shape."""
        if self.parallel.expert_model_parallel_size == 1:
            return seq_len
        return self._most_over_experts([seq_len])[0]

    def _shared_prompt_micro_batches(self, batch: RolloutBatch, batching: MicroBatching,
                                     multiple: int) -> list[MicroBatch]:
        """:mod:`prefix_grouper`'s layout: fixed-size micro-batches (as the plain layout's) grouped inside, or
        token-budget micro-batches of whole shared-prompt rows; packed, a micro-batch's rows follow one another in
        one row (:func:`~hybridrl.megatron.prefix_grouper.pack_groups_in_one_row`)."""
        if self.parallel.context_parallel_size > 1 or self.parallel.num_model_chunks > 1:  # validation says so first
            raise ValueError("shared-prompt rows (use_prefix_grouper) need CP = 1 and no virtual pipeline stages")
        device = batch.prompt_ids.device
        packed = batching.packed  # the rows of a micro-batch end to end in one row (any lengths: no fillers)
        if batching.max_tokens is None:
            parts = []
            for index in torch.arange(len(batch), device=device).split(batching.micro_batch_size):
                if len(index) < batching.micro_batch_size and not packed:  # equal shapes: copies of row 0
                    index = torch.cat([index, index.new_full((batching.micro_batch_size - len(index),), -1)])
                ids = index.tolist()
                parts.append([[ids[i] for i in row] for row in group_rows(batch.index(index.clamp(min=0)),
                                                                         max_tokens=None)])
        else:
            parts = partition_rows(batch, max_tokens=batching.max_tokens, multiple=1 if packed else multiple,
                                   packed=packed)
        out = []
        for rows in parts:
            index = torch.tensor([i for row in rows for i in row], device=device)
            part = batch.index(index.clamp(min=0))
            sizes = [len(row) for row in rows]
            layout = pack_groups(part, sizes, pad_token_id=self.pad_token_id, multiple=multiple) if not packed \
                else pack_groups_in_one_row(part, sizes, pad_token_id=self.pad_token_id)
            out.append(MicroBatch(batch=part, rows=layout, index=index))
        return out


def _filled(batch: RolloutBatch, part: RolloutBatch, index: torch.Tensor, count: int, *,
            whole_row: bool = False) -> tuple[RolloutBatch, torch.Tensor]:
    """``part`` with ``count`` filler rows after its own, copies of its row 0 (``batch``'s when it is empty), loss
    mask 0 — nothing trained on, their outputs dropped (index -1). ``whole_row`` keeps the row as it is (it fits a
    micro-batch padded to the batch's longest row; the MoE layers then see the same tokens as before fillers
    existed: a near-tie of a random router can flip with what else runs); else cut to its last prompt token with
    no response and no recorded routing, which fits any micro-batch's shape (token-budget micro-batches agreed
    over the EP ranks)."""
    filler = (part if len(part) else batch).index([0] * count)
    empty = torch.zeros_like(filler.response_mask)
    if whole_row:
        filler = dataclasses.replace(filler, loss_mask=empty)
    else:
        prompt_mask = torch.zeros_like(filler.prompt_mask)
        prompt_mask[:, -1] = 1
        unrouted = {n: torch.full_like(v, -1) for n in RolloutBatch.ROUTING_FIELDS
                    if (v := getattr(filler, n)) is not None}
        filler = dataclasses.replace(filler, prompt_mask=prompt_mask, response_mask=empty, loss_mask=empty.clone(),
                                     **unrouted)
    return (RolloutBatch.cat([part, filler]) if len(part) else filler,
            torch.cat([index, index.new_full((count,), -1)]))
