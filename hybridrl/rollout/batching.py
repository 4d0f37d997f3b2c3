"""Engine output (one ``Generation`` per sample) → ``RolloutBatch``; shared by every engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.data.collate import PromptBatch
from hybridrl.interfaces import Generation


def rollout_batch_from_generations(prompts: PromptBatch, gens: Sequence[Generation], *,
                                   pad_token_id: int) -> RolloutBatch:
    """Samples in engine order; ``group_index`` is the prompt's dataset index (GRPO groups). A generation's
    ``loss_mask`` (None: every token was sampled) becomes the batch's ``loss_mask``; its tokens outside it
    carry log-prob 0."""
    B = len(gens)
    T = max((len(g.token_ids) for g in gens), default=0) or 1
    response_ids_BT = torch.full((B, T), pad_token_id, dtype=torch.long)
    response_mask_BT = torch.zeros((B, T), dtype=torch.long)
    loss_mask_BT = torch.zeros((B, T), dtype=torch.long)
    logprobs_BT = torch.zeros((B, T), dtype=torch.float32)
    for b, g in enumerate(gens):
        n = len(g.token_ids)
        if len(g.logprobs) != n:
            raise ValueError(f"engine returned {len(g.logprobs)} log-probs for {n} tokens (sample {b})")
        if g.loss_mask is not None and (len(g.loss_mask) != n or not set(g.loss_mask) <= {0, 1}):
            raise ValueError(f"sample {b}: Generation.loss_mask must hold one 0/1 per token ({n} tokens), "
                             f"got {len(g.loss_mask)} values {sorted(set(g.loss_mask))[:4]}")
    # every sample's tokens at once: a boolean mask fills row by row, in the order the lists are chained
    real_BT = torch.arange(T)[None, :] < torch.tensor([len(g.token_ids) for g in gens], dtype=torch.long)[:, None]
    response_ids_BT[real_BT] = torch.tensor([t for g in gens for t in g.token_ids], dtype=torch.long)
    response_mask_BT[real_BT] = 1
    loss_mask_BT[real_BT] = torch.tensor([m for g in gens for m in (g.loss_mask if g.loss_mask is not None
                                                                    else [1] * len(g.token_ids))], dtype=torch.long)
    logprobs_BT[real_BT] = torch.tensor([x for g in gens for x in g.logprobs], dtype=torch.float32)
    idx_B = torch.tensor([g.prompt_index for g in gens], dtype=torch.long)
    routing = routed_experts_fields(prompts.attention_mask[idx_B], gens, T) if any(
        g.routed_experts is not None for g in gens) else {}
    return RolloutBatch(
        prompt_ids=prompts.input_ids[idx_B], prompt_mask=prompts.attention_mask[idx_B],
        response_ids=response_ids_BT, response_mask=response_mask_BT, loss_mask=loss_mask_BT,
        rollout_logprobs=logprobs_BT * loss_mask_BT,
        weight_version=torch.tensor([g.weight_version for g in gens], dtype=torch.long),
        group_index=prompts.index[idx_B],
        meta=[dataclasses.replace(prompts.meta[g.prompt_index], finish_reason=g.finish_reason) for g in gens],
        pad_token_id=pad_token_id, **routing,
    )


def routed_experts_fields(prompt_mask_BP: torch.Tensor, gens: Sequence[Generation], T: int) -> dict[str, torch.Tensor]:
    """``RolloutBatch``'s ``prompt_routed_experts`` [B, P, L, k] and ``response_routed_experts`` [B, T, L, k] from
    each generation's ``routed_experts`` (its positions in order: the prompt's, then the response's), -1 where the
    engine ran none (padding; each response's last token)."""
    missing = [b for b, g in enumerate(gens) if g.routed_experts is None]
    if missing:
        raise ValueError(f"the engine returned routed experts for some samples only (none for samples {missing[:8]})")
    B, P = prompt_mask_BP.shape
    L, k = gens[0].routed_experts.shape[1:]
    prompt_BPLK = torch.full((B, P, L, k), -1, dtype=torch.int16)
    response_BTLK = torch.full((B, T, L, k), -1, dtype=torch.int16)
    for b, g in enumerate(gens):
        routed = torch.as_tensor(g.routed_experts, dtype=torch.int16)
        p, n = int(prompt_mask_BP[b].sum()), len(g.token_ids)
        if routed.dim() != 3 or tuple(routed.shape[1:]) != (L, k) or len(routed) > p + n:
            raise ValueError(f"sample {b}: routed_experts has shape {tuple(routed.shape)}, expected at most "
                             f"({p + n}, {L}, {k}) (prompt + response positions, MoE layers, top-k)")
        prompt_BPLK[b, P - p:] = routed[:p]
        response_BTLK[b, :len(routed) - p] = routed[p:]
    return {"prompt_routed_experts": prompt_BPLK, "response_routed_experts": response_BTLK}
