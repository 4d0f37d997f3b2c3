"""The reward model's pairwise loss: Bradley–Terry on scalar scores of (chosen, rejected) responses.

With ``r(x, y)`` the reward model's score of the whole sequence (its scalar head at the last token):

    L = −log σ(r(x, y_w) − r(x, y_l) − m) + c · (r(x, y_w) + r(x, y_l))²

``y_w`` is the chosen response, ``y_l`` the rejected one. The first term is the negative log-likelihood of
the preference under the Bradley–Terry model (Bradley & Terry 1952, "Rank analysis of incomplete block
designs"), as reward models for RLHF are trained (Stiennon et al. 2020, "Learning to summarize from human
feedback", eq. 1; Ouyang et al. 2022, InstructGPT, eq. 1). ``m`` is an optional per-pair margin (Touvron et al.
2023, Llama 2, eq. 2: pairs rated far apart must be scored far apart; ``data.margin_key``, 0 without it).
``c`` = ``algorithm.center_rewards_coefficient`` pulls the scores toward mean zero (Eisenstein et al. 2023,
"Helping or Herding? Reward Model Ensembles Mitigate but do not Eliminate Reward Hacking"), TRL's
``RewardConfig`` name and term. The loss of a batch is the mean over its pairs.

Deviation: none from TRL's ``RewardTrainer`` (its loss is the same two terms). InstructGPT's grouping of all
K-choose-2 comparisons of one prompt into one batch element is not done: every pair is its own element.

Metrics (means over pairs): ``chosen``, ``rejected`` (the scores), ``margin`` (their difference),
``pair_accuracy`` (the fraction of pairs whose chosen score is strictly larger) and ``loss``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True, kw_only=True, frozen=True)
class RMTerms:
    """Per-pair results, each ``[N]`` (N pairs)."""

    loss_N: torch.Tensor
    chosen_N: torch.Tensor  # r(x, y_w) (detached)
    rejected_N: torch.Tensor  # r(x, y_l) (detached)

    def metric_sums(self) -> dict[str, torch.Tensor]:
        """Sums over the pairs (a caller divides by the pair count of the whole batch)."""
        margin_N = self.chosen_N - self.rejected_N
        return {"loss": self.loss_N.detach().sum(), "chosen": self.chosen_N.sum(), "rejected": self.rejected_N.sum(),
                "margin": margin_N.sum(), "pair_accuracy": (margin_N > 0).float().sum()}


def bradley_terry_loss(chosen_N: torch.Tensor, rejected_N: torch.Tensor, *, margin_N: torch.Tensor | None = None,
                       center_rewards_coefficient: float = 0.0) -> RMTerms:
    """Per-pair loss from the two scores of each pair (each ``[N]``); see the module docstring."""
    diff_N = chosen_N - rejected_N
    loss_N = -F.logsigmoid(diff_N if margin_N is None else diff_N - margin_N)
    if center_rewards_coefficient:
        loss_N = loss_N + center_rewards_coefficient * (chosen_N + rejected_N) ** 2
    return RMTerms(loss_N=loss_N, chosen_N=chosen_N.detach(), rejected_N=rejected_N.detach())
