"""Micro-batches by token budget ("dynamic batch size"), so padding does not dominate compute.

With a fixed number of samples per micro-batch, every row is padded to the longest sample of the
whole batch: a few long responses make every micro-batch pay for them. Here samples are grouped by
length instead and each micro-batch is padded only to its own longest row:

    cost(micro-batch) = rows × round_up(longest prompt + response in it, multiple)  ≤  max_tokens

The partition is first-fit over the samples sorted by length, longest first: the first sample of a
micro-batch fixes its padded length and shorter ones join while the cost stays within the budget. On
sorted lengths this greedy gives the fewest micro-batches of any partition into contiguous runs, and
it groups similar lengths, which is what minimises padding.

With the interleaved pipeline schedule (VPP) the count is rounded up to a multiple of PP (the schedule's
micro-batch groups), on NCCL only: on gloo Megatron's variable-shape exchange fails there
(``VPP_DYNAMIC_UNSUPPORTED``). At EP > 1 the
expert-parallel ranks must run the same number of micro-batches (they exchange tokens in every MoE layer):
:func:`split_to_count` splits a rank's partition up to the count the busiest rank needs, as verl's
``same_micro_num_in_dp`` does; a rank with fewer samples than that runs empty (fully masked) micro-batches.
Packed micro-batches (``use_remove_padding``) cost the sum of their samples' lengths, not a rectangle:
:func:`token_sum_partition` bins them by that sum.
Gradients do not depend on the grouping: the loss of every micro-batch is normalised by the
mini-batch-global normaliser, so the accumulated gradient is the mini-batch gradient whatever the
partition (up to the order of floating-point sums). Same idea as verl's ``use_dynamic_bsz`` /
``ppo_max_token_len_per_gpu``; verl balances the token sums with Karmarkar–Karp for unpadded (packed)
sequences, whereas here the cost is the padded rectangle the dense attention really computes.
"""

from __future__ import annotations

from collections.abc import Sequence

# Measured on gloo at PP=2 × VPP=2: the interleaved schedule's combined send/receive exchanges the
# shapes of the forward and backward tensors in one batch, and with both neighbours the same rank they
# are paired the wrong way round (gloo: "Received data size doesn't match expected size").
VPP_DYNAMIC_UNSUPPORTED = ("not supported on CPU (gloo): Megatron's variable-shape exchange under the interleaved "
                           "schedule mispairs the two directions there (on GPU, NCCL, it runs); use fixed "
                           "micro-batches or virtual_pipeline_model_parallel_size=null on CPU")


def padded_len(length: int, multiple: int) -> int:
    return max(-(-length // multiple) * multiple, 2)


def token_budget_partition(lengths: Sequence[int], *, max_tokens: int, multiple: int = 1) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches whose padded cost is ≤ ``max_tokens``.

    Every micro-batch is non-empty; together they hold every index exactly once; within a micro-batch
    indices are ascending.
    """
    if not lengths:
        raise ValueError("token_budget_partition: no samples")
    longest = max(lengths)
    if padded_len(longest, multiple) > max_tokens:
        raise ValueError(f"a sample of {longest} tokens (padded to {padded_len(longest, multiple)}) does not "
                         f"fit the token budget of {max_tokens} per micro-batch; raise the budget to at least "
                         f"the longest prompt + response")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    parts: list[list[int]] = []
    width = 0
    for i in order:
        if parts and (len(parts[-1]) + 1) * width <= max_tokens:
            parts[-1].append(i)
        else:
            parts.append([i])
            width = padded_len(lengths[i], multiple)
    return [sorted(p) for p in parts]


def token_sum_partition(lengths: Sequence[int], *, max_tokens: int, multiple: int = 1) -> list[list[int]]:
    """Packed micro-batches (no padding between samples): indices of ``lengths`` in bins whose summed lengths (each
    rounded up to ``multiple``) are ≤ ``max_tokens`` — first-fit decreasing, at most 11/9 of the fewest bins + 6/9
    (Dósa 2007; verl instead fixes the count and balances the bins by Karmarkar–Karp). Every bin non-empty, indices
    ascending."""
    if not lengths:
        raise ValueError("token_sum_partition: no samples")
    cost = [padded_len(n, multiple) if multiple > 1 else max(n, 1) for n in lengths]
    if max(cost) > max_tokens:
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit the token budget of {max_tokens} per "
                         f"micro-batch; raise the budget to at least the longest prompt + response")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-cost[i], i)):
        k = next((k for k, r in enumerate(room) if r >= cost[i]), len(bins))
        if k == len(bins):
            bins.append([])
            room.append(max_tokens)
        bins[k].append(i)
        room[k] -= cost[i]
    return [sorted(b) for b in bins]


def split_to_count(parts: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """``parts`` split up to ``count`` micro-batches (none exceeds its budget more than before): the one with the most
    rows is halved, again and again; when every part holds one row, empty parts ([]) make up the rest."""
    out = [list(p) for p in parts]
    while len(out) < count:
        k = max(range(len(out)), key=lambda i: (len(out[i]), -i)) if out else -1
        if k < 0 or len(out[k]) < 2:
            out += [[] for _ in range(count - len(out))]
            break
        half = len(out[k]) // 2
        out[k:k + 1] = [out[k][:half], out[k][half:]]
    return out


def partition_cost(lengths: Sequence[int], parts: Sequence[Sequence[int]], multiple: int = 1) -> int:
    """Tokens the forward really computes (rows × padded length, summed over micro-batches)."""
    return sum(len(p) * padded_len(max(lengths[i] for i in p), multiple) for p in parts)
