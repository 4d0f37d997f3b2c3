"""Direct preference optimisation losses on sequence log-probs of (chosen, rejected) response pairs.

With the sequence log-prob ``log π(y|x) = Σ_t log π(y_t | x, y_<t)`` (a **sum** over the response
tokens, EOS included) and the implicit reward ``r(x, y) = β (log π(y|x) − log π_ref(y|x))``:

    h        = (log π(y_w|x) − log π_ref(y_w|x)) − (log π(y_l|x) − log π_ref(y_l|x))
    sigmoid  L = −(1 − ε) log σ(β h) − ε log σ(−β h)
    ipo      L = (h − 1 / (2 β))²

``y_w`` is the chosen response, ``y_l`` the rejected one. ``sigmoid`` with ε = 0 is DPO (Rafailov et
al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward Model", eq. 7);
ε = ``label_smoothing`` > 0 is conservative DPO (cDPO; Mitchell 2023, "A note on DPO with noisy
preferences"): the label is taken to be flipped with probability ε. ``ipo`` is IPO (Azar et al. 2023,
"A General Theoretical Paradigm to Understand Learning from Human Preferences", eq. 17), which
regresses h onto 1/(2β) instead of pushing it to infinity; label smoothing does not apply to it.
The loss of a batch is the mean over its pairs. Names (``beta``, ``label_smoothing``, ``loss_type``)
are TRL's ``DPOConfig`` ones.

Deviation: TRL's IPO divides each log-prob by the response length (a per-token mean); here IPO uses
the summed log-prob, as the paper's h does, so both loss types see the same sequence log-probs.

Metrics (means over pairs): ``rewards/chosen`` = r(x, y_w), ``rewards/rejected`` = r(x, y_l),
``rewards/margin`` = their difference (= β h), ``rewards/accuracy`` = the fraction of pairs whose
chosen reward is strictly larger.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo")


@dataclass(slots=True, kw_only=True, frozen=True)
class DPOTerms:
    """Per-pair results, each ``[N]`` (N pairs)."""

    loss_N: torch.Tensor
    chosen_reward_N: torch.Tensor  # β (log π − log π_ref) of the chosen response (detached)
    rejected_reward_N: torch.Tensor  # the same for the rejected response (detached)

    def metric_sums(self) -> dict[str, torch.Tensor]:
        """Sums over the pairs (a caller divides by the pair count of the whole batch)."""
        margin_N = self.chosen_reward_N - self.rejected_reward_N
        return {"dpo/loss": self.loss_N.detach().sum(), "rewards/chosen": self.chosen_reward_N.sum(),
                "rewards/rejected": self.rejected_reward_N.sum(), "rewards/margin": margin_N.sum(),
                "rewards/accuracy": (margin_N > 0).float().sum()}


def dpo_loss(policy_chosen_N: torch.Tensor, policy_rejected_N: torch.Tensor, ref_chosen_N: torch.Tensor,
             ref_rejected_N: torch.Tensor, *, beta: float, label_smoothing: float = 0.0,
             loss_type: str = "sigmoid") -> DPOTerms:
    """Per-pair loss and implicit rewards from sequence log-probs (each ``[N]``); see the module docstring."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"algorithm.loss_type={loss_type!r} is invalid; valid: {', '.join(DPO_LOSS_TYPES)}")
    chosen_ratio_N = policy_chosen_N - ref_chosen_N
    rejected_ratio_N = policy_rejected_N - ref_rejected_N
    h_N = chosen_ratio_N - rejected_ratio_N
    if loss_type == "sigmoid":
        loss_N = -(1 - label_smoothing) * F.logsigmoid(beta * h_N) - label_smoothing * F.logsigmoid(-beta * h_N)
    else:
        loss_N = (h_N - 1 / (2 * beta)) ** 2
    return DPOTerms(loss_N=loss_N, chosen_reward_N=beta * chosen_ratio_N.detach(),
                    rejected_reward_N=beta * rejected_ratio_N.detach())
