"""The actor's full objective on one micro-batch: policy loss − entropy bonus + KL-to-reference loss.

    L = L_pg(π, π_old, A) − c_H · agg(H(π)) + β · agg(KL_est(π ‖ π_ref))

``L_pg`` is the configured policy-loss plugin (PPO-clip etc., Schulman et al. 2017), the entropy
bonus is PPO's c_2 term, and the KL term is GRPO's (Shao et al. 2024, eq. 3) with the estimator
picked by ``actor.kl_loss_type`` (``low_var_kl`` = Schulman's k3, GRPO's choice).
``agg`` is ``actor.loss_agg_mode``, normalised by the *mini-batch's* normaliser so micro-batch
losses add up exactly (see ``loss_agg``). Metrics ending in ``_sum`` are such partial sums and are
summed (not averaged) over micro-batches and DP ranks by the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.algorithms.kl import kl_penalty
from hybridrl.algorithms.loss_agg import aggregate
from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import PolicyLoss


@dataclass(slots=True, kw_only=True)
class ActorObjective:
    policy_loss: PolicyLoss
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str

    def __call__(self, logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor, mb: RolloutBatch, *,
                 normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert mb.old_logprobs is not None and mb.advantages is not None
        mask_BT = mb.response_mask.float()
        pg, pg_metrics = self.policy_loss(
            logprobs_BT=logprobs_BT, old_logprobs_BT=mb.old_logprobs, advantages_BT=mb.advantages,
            response_mask_BT=mask_BT, loss_agg_mode=self.loss_agg_mode, global_normalizer=normalizer)
        entropy = aggregate(entropy_BT, mask_BT, self.loss_agg_mode, global_normalizer=normalizer)
        loss = pg - self.entropy_coeff * entropy if self.entropy_coeff else pg
        metrics = {k: v for k, v in pg_metrics.items() if k != "pg_loss"}
        metrics |= {"pg_loss_sum": pg.detach(), "entropy_sum": entropy.detach()}
        if self.use_kl_loss:
            assert mb.ref_logprobs is not None, "use_kl_loss needs ref log-probs in the batch"
            kl_BT = kl_penalty(logprobs_BT, mb.ref_logprobs, self.kl_loss_type)
            kl = aggregate(kl_BT, mask_BT, self.loss_agg_mode, global_normalizer=normalizer)
            loss = loss + self.kl_loss_coef * kl
            metrics["kl_ref_sum"] = kl.detach()
        return loss, metrics
