"""Helpers shared by the outcome-reward (group-baseline) estimators, GRPO and RLOO."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def outcome_scores(token_rewards_BT: torch.Tensor, response_mask_BT: torch.Tensor) -> torch.Tensor:
    """One scalar reward per sample: the sum of its token rewards over the response mask."""
    return (token_rewards_BT * response_mask_BT.to(token_rewards_BT.dtype)).sum(-1)


@dataclass(slots=True, kw_only=True)
class GroupStats:
    """Per-sample statistics of the group each sample belongs to (all ``[B]``)."""

    size_B: torch.Tensor  # number of samples in the group (same dtype as the scores)
    sum_B: torch.Tensor  # sum of the group's scores
    mean_B: torch.Tensor
    std_B: torch.Tensor  # unbiased (Bessel-corrected, as torch.std); 0 for a group of one


def group_stats(scores_B: torch.Tensor, group_index_B: torch.Tensor) -> GroupStats:
    """Statistics of ``scores_B`` within groups given by equal ``group_index_B`` values.

    Group ids may be any integers in any order (samples of one prompt need not be adjacent).
    Uses ``scatter_add`` (deterministic under ``torch.use_deterministic_algorithms``).
    """
    _, inverse_B, counts_G = torch.unique(group_index_B, return_inverse=True, return_counts=True)
    num_groups = counts_G.shape[0]
    size_G = counts_G.to(scores_B.dtype)
    sum_G = scores_B.new_zeros(num_groups).scatter_add_(0, inverse_B, scores_B)
    mean_G = sum_G / size_G
    dev_B = scores_B - mean_G[inverse_B]
    sq_G = scores_B.new_zeros(num_groups).scatter_add_(0, inverse_B, dev_B.square())
    std_G = (sq_G / (size_G - 1).clamp_min(1)).sqrt()
    return GroupStats(
        size_B=size_G[inverse_B], sum_B=sum_G[inverse_B], mean_B=mean_G[inverse_B], std_B=std_G[inverse_B]
    )
