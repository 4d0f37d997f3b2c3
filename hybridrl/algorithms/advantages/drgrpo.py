"""Dr. GRPO advantages: GRPO's group baseline without the division by the group's std.

    r_i = sum_t token_reward_{i,t}
    A_{i,t} = r_i - mean_{j in G(i)} r_j                      for every response token t

together with the loss aggregation ``seq-mean-token-sum-norm`` (each response's token sum divided by
a constant, the maximum response length, not by its own length). Source: Liu et al. 2025,
"Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO, "GRPO Done Right"): both
normalisations of GRPO bias the optimisation, the std one towards too easy / too hard questions,
the length one towards long wrong answers.

This is ``grpo`` with ``norm_adv_by_std_in_grpo=False`` under a name of its own, so one key selects
the algorithm: ``algorithm.adv_estimator=drgrpo`` with ``actor_rollout_ref.actor.loss_agg_mode=
seq-mean-token-sum-norm``. The estimator cannot set the actor's aggregation; it declares it in
``loss_agg_mode`` and the static validation rejects any other ``actor.loss_agg_mode``.

Deviations and choices: as ``grpo`` (a group of one sample gets advantage 0; the groups are the ones
present in the tensors passed in). The constant of the aggregation is ``data.max_response_length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridrl.algorithms.advantages.grpo import GRPOEstimator


class DrGRPOEstimator:
    """Dr. GRPO advantages (``algorithm.adv_estimator: drgrpo``)."""

    @dataclass(slots=True, kw_only=True)
    class Config:
        pass

    needs_group: ClassVar[bool] = True
    needs_critic: ClassVar[bool] = False
    loss_agg_mode: ClassVar[str] = "seq-mean-token-sum-norm"
    """The ``actor.loss_agg_mode`` this estimator is only right with (read by the static validation)."""

    def __init__(self, config: DrGRPOEstimator.Config | None = None) -> None:
        self.config = config if config is not None else self.Config()
        self._grpo = GRPOEstimator(GRPOEstimator.Config(norm_adv_by_std_in_grpo=False))

    def __call__(
        self,
        *,
        token_rewards_BT: torch.Tensor,
        response_mask_BT: torch.Tensor,
        group_index_B: torch.Tensor,
        values_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._grpo(token_rewards_BT=token_rewards_BT, response_mask_BT=response_mask_BT,
                          group_index_B=group_index_B, values_BT=values_BT)
