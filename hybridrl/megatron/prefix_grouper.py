"""Shared-prompt rows ("Prefix Grouper"): a prompt's samples in one row, the prompt encoded once.

GRPO samples ``n`` responses per prompt, and the plain layout (:mod:`sequences`) gives each sample its
own row ``[prompt ‖ response_i]``, so every forward and backward pass encodes each prompt ``n`` times.
Here the samples of one prompt share a row::

    [p_0 … p_{P-1} | r^1_0 … r^1_{T_1-1} | r^2_0 … | … | r^k_0 … r^k_{T_k-1} | pad …]

with the attention mask ``allowed(q, k) = k ≤ q ∧ (seg(k) = prompt ∨ seg(k) = seg(q))`` (a response sees
the prompt and its own earlier tokens, never another response) and positions ``0 … P-1`` for the prompt
and ``P … P+T_i-1`` for every response (:mod:`rope_positions`: Megatron's RoPE ignores position ids). Each
response token then sees exactly the keys, values and positions it sees in its own row, so hidden
states, log-probs and gradients are those of the plain layout (Liu et al. 2025, "Prefix Grouper:
Efficient GRPO Training through Shared-Prefix Forward", arXiv:2506.05433, prove the same for their
two-part attention); only floating-point summation order differs. The first response token of every
sample is predicted from the prompt's last position (one logits row shared by the ``k`` samples, each
with its own target); later ones from the response's previous token.

Tokens per group fall from ``k·(P + T̄)`` to ``P + k·T̄``: on ``grpo_tiny`` (P ≈ 6, T̄ ≈ 3, k = 8) 2.4× fewer.
The attention is still dense over the row (``S²`` scores with the masked ones computed), so it pays
when prompts are not much shorter than responses; with long responses and short prompts it can cost
more than it saves (keep it off there).

Deviation from the paper: it splits attention into a prefix part and a suffix part so flash kernels
can run; here the mask is explicit, so this layout needs Megatron's local attention (Transformer
Engine's fused attention takes no such mask: validation refuses it), CP = 1 and no interleaved
schedule (variable shapes, as token-budget micro-batches).

Micro-batches: with a fixed size they are the plain layout's (``micro_batch_size`` samples in batch
order), grouped inside; with a token budget the *groups* are partitioned (:func:`token_budget_partition`
over row lengths), a group longer than the budget being cut into rows that each repeat the prompt.
"""

from __future__ import annotations

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.megatron.dynamic_batch import padded_len, token_budget_partition, token_sum_partition
from hybridrl.megatron.sequences import PackedRows

_PAD_SEGMENT = -1  # padding: attends to the prompt and to padding (any non-empty set; never read)


def prompt_groups(batch: RolloutBatch) -> list[list[int]]:
    """Indices of ``batch``'s samples with identical prompt tokens, groups in order of first appearance."""
    lengths = batch.prompt_mask.sum(-1).tolist()
    P = batch.prompt_ids.shape[1]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ids, p) in enumerate(zip(batch.prompt_ids.tolist(), lengths, strict=True)):
        groups.setdefault(tuple(ids[P - int(p):]), []).append(i)
    return list(groups.values())


def group_rows(batch: RolloutBatch, *, max_tokens: int | None, multiple: int = 1) -> list[list[int]]:
    """The samples of each shared-prompt row: :func:`prompt_groups`, each cut (in order) so that a row's
    prompt + responses, padded to ``multiple``, fit ``max_tokens`` (None: no limit)."""
    return _cut_rows(batch, max_tokens=max_tokens, multiple=multiple)[0]


def partition_rows(batch: RolloutBatch, *, max_tokens: int, multiple: int = 1,
                   packed: bool = False) -> list[list[list[int]]]:
    """Token-budget micro-batches of shared-prompt rows: each a list of rows (each a list of sample
    indices), ``rows × padded longest row ≤ max_tokens`` (``packed``: the rows' summed lengths ≤ it)."""
    rows, widths = _cut_rows(batch, max_tokens=max_tokens, multiple=multiple)
    parts = (token_sum_partition if packed else token_budget_partition)(widths, max_tokens=max_tokens,
                                                                       multiple=multiple)
    return [[rows[r] for r in part] for part in parts]


def _cut_rows(batch: RolloutBatch, *, max_tokens: int | None, multiple: int) -> tuple[list[list[int]], list[int]]:
    """:func:`group_rows` and each row's tokens (its prompt once, plus every response)."""
    prompt_len = batch.prompt_mask.sum(-1).tolist()
    response_len = batch.response_mask.sum(-1).tolist()
    rows: list[list[int]] = []
    widths: list[int] = []
    for group in prompt_groups(batch):
        prompt = int(prompt_len[group[0]])
        row: list[int] = []
        width = prompt
        for i in group:
            length = int(response_len[i])
            fits = max_tokens is None or padded_len(width + length, multiple) <= max_tokens
            if row and not fits:  # this row is full: the sample starts the next one, with the prompt again
                rows.append(row)
                widths.append(width)
                row, width = [], prompt
                fits = max_tokens is None or padded_len(width + length, multiple) <= max_tokens
            if not fits:
                raise ValueError(f"a sample of {width + length} tokens (prompt + response) does not fit the "
                                 f"token budget of {max_tokens} per micro-batch; raise the budget to at least "
                                 f"the longest prompt + response")
            row.append(i)
            width += length
        rows.append(row)
        widths.append(width)
    return rows, widths


def _samples(batch: RolloutBatch, sizes: list[int], caller: str) -> tuple[list[list[int]], list[int], list[list[int]],
                                                                         list[int]]:
    """``batch``'s prompt ids, prompt lengths, response ids and response lengths as lists, once ``sizes`` (samples per
    group) are checked to cover it."""
    if sum(sizes) != len(batch):
        raise ValueError(f"{caller}: row sizes {sizes} do not add up to {len(batch)} samples")
    return (batch.prompt_ids.tolist(), batch.prompt_mask.sum(-1).tolist(), batch.response_ids.tolist(),
            batch.response_mask.sum(-1).tolist())


def pack_groups(batch: RolloutBatch, sizes: list[int], *, pad_token_id: int, multiple: int = 1) -> PackedRows:
    """``batch``'s samples, consecutive runs of ``sizes`` sharing one prompt each, as shared-prompt rows
    (module docstring) on the batch's device: tokens, positions, mask and where each sample's tokens are."""
    prompt_ids, prompt_len, response_ids, response_len = _samples(batch, sizes, "pack_groups")
    device, P = batch.prompt_ids.device, batch.prompt_ids.shape[1]
    tokens: list[list[int]] = []
    positions: list[list[int]] = []
    segments: list[list[int]] = []
    start_B: list[int] = []
    row_B: list[int] = []
    first = 0
    for r, size in enumerate(sizes):
        p = int(prompt_len[first])
        toks, pos, seg = prompt_ids[first][P - p:], list(range(p)), [0] * p
        for j, i in enumerate(range(first, first + size), start=1):
            t = int(response_len[i])
            start_B.append(len(toks))
            row_B.append(r)
            toks = toks + response_ids[i][:t]
            pos += range(p, p + t)
            seg += [j] * t
        tokens.append(toks)
        positions.append(pos)
        segments.append(seg)
        first += size
    S = padded_len(max(len(t) for t in tokens), multiple)
    fill = [S - len(t) for t in tokens]
    tokens_RS = torch.tensor([t + [pad_token_id] * f for t, f in zip(tokens, fill, strict=True)], device=device)
    position_ids_RS = torch.tensor([p + [0] * f for p, f in zip(positions, fill, strict=True)], device=device)
    seg_RS = torch.tensor([s + [_PAD_SEGMENT] * f for s, f in zip(segments, fill, strict=True)], device=device)
    causal_SS = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    seg_q, seg_k = seg_RS[:, :, None], seg_RS[:, None, :]
    allowed_RSS = causal_SS & ((seg_k == 0) | (seg_k == seg_q))
    return PackedRows(tokens_BS=tokens_RS, prompt_len_B=batch.prompt_mask.sum(-1).long(),
                      response_mask_BT=batch.response_mask,
                      row_B=torch.tensor(row_B, device=device), response_start_B=torch.tensor(start_B, device=device),
                      position_ids_BS=position_ids_RS, attention_mask=~allowed_RSS[:, None])


def pack_groups_in_one_row(batch: RolloutBatch, sizes: list[int], *, pad_token_id: int) -> PackedRows:
    """:func:`pack_groups`' rows end to end in a single row ``[1, N]`` (packed, no padding), each group's attention
    described by blocks instead of a mask (:class:`~hybridrl.megatron.packed_attention.SharedPrefixParams`): the
    prompt ``[A, A + p)`` attends causally to itself, each response to the prompt and causally to itself."""
    prompt_ids, prompt_len, response_ids, response_len = _samples(batch, sizes, "pack_groups_in_one_row")
    device, P = batch.prompt_ids.device, batch.prompt_ids.shape[1]
    tokens: list[int] = []
    positions: list[int] = []
    blocks: list[tuple[int, int, int, int]] = []  # (prefix start, prefix length, own start, own length)
    start_B: list[int] = []
    end_B: list[int] = []
    first = 0
    for size in sizes:
        p, at = int(prompt_len[first]), len(tokens)
        tokens += prompt_ids[first][P - p:]
        positions += range(p)
        blocks.append((at, 0, at, p))
        for i in range(first, first + size):
            t = int(response_len[i])
            start_B.append(len(tokens))
            end_B.append(at + p)
            if t:
                blocks.append((at, p, len(tokens), t))
            tokens += response_ids[i][:t]
            positions += range(p, p + t)
        first += size
    if len(tokens) < 2:  # a row needs a next-token target
        tokens, positions = tokens + [pad_token_id], positions + [positions[-1] + 1]
    long = dict(dtype=torch.long, device=device)
    return PackedRows(tokens_BS=torch.tensor([tokens], **long), prompt_len_B=batch.prompt_mask.sum(-1).long(),
                      response_mask_BT=batch.response_mask, row_B=torch.zeros(len(batch), **long),
                      response_start_B=torch.tensor(start_B, **long), prompt_end_B=torch.tensor(end_B, **long),
                      position_ids_BS=torch.tensor([positions], **long), blocks=torch.tensor(blocks, **long))
