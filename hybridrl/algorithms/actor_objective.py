"""The actor's full objective on one micro-batch: policy loss − entropy bonus + KL-to-reference loss (+ distillation).

    L = L_pg(π, π_old, A) − c_H · agg(H(π)) + β · agg(KL_est(π ‖ π_ref)) [+ λ_d · agg(ℓ_distill)]

``L_pg`` is the configured policy-loss plugin (PPO-clip etc., Schulman et al. 2017), the entropy
bonus is PPO's c_2 term, and the KL term is GRPO's (Shao et al. 2024, eq. 3) with the estimator
picked by ``actor.kl_loss_type`` (``low_var_kl`` = Schulman's k3, GRPO's choice).
``agg`` is ``actor.loss_agg_mode``, normalised by the *mini-batch's* normaliser so micro-batch
losses add up exactly (see ``loss_agg``). Metrics ending in ``_sum`` are such partial sums and are
summed (not averaged) over micro-batches and DP ranks by the trainer.

``seq-mean-token-sum-norm`` (Dr. GRPO) divides by the constant ``norm_constant`` (the trainer passes
``data.max_response_length``) rather than a micro-batch's padded width: the policy loss is run as
``seq-mean-token-sum`` and divided by it here (the mode is exactly that, and a policy-loss plugin only
receives a mode and a normaliser), the entropy and KL terms are aggregated with it.

With ``rollout_correction`` (``algorithm.rollout_correction``, see ``rollout_correction``) the detached
importance weights w = min(π_old/π_rollout, C) multiply the advantages handed to the policy loss (for
losses linear in A with w > 0 — PPO-clip, dual-clip, GSPO — exactly w times the per-token loss; no
plugin signature changes) and the rejection mask multiplies the response mask of all three terms.

With ``distillation`` (``actor_rollout_ref.teacher.loss``) the supervised distillation term of
:mod:`hybridrl.algorithms.distillation_loss` is added, aggregated like the others; its ``use_task_rewards=false``
drops L_pg (the distillation term alone, with the entropy and KL terms as configured).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.algorithms.distillation_loss import DistillationLossConfig, distillation_losses_BT
from hybridrl.algorithms.kl import kl_penalty
from hybridrl.algorithms.loss_agg import aggregate
from hybridrl.algorithms.rollout_correction import RolloutCorrection
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
    norm_constant: float | None = None  # C of seq-mean-token-sum-norm; required in that mode
    rollout_correction: RolloutCorrection | None = None  # None: off (π_old is treated as the sampler)
    distillation: DistillationLossConfig | None = None  # None / loss_mode null: no distillation term

    def __post_init__(self) -> None:
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and not (self.norm_constant or 0) > 0:
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r} needs norm_constant > 0 "
                             f"(data.max_response_length), got {self.norm_constant!r}")

    def __call__(self, logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor, mb: RolloutBatch, *,
                 normalizer: torch.Tensor, topk_logprobs_BTK: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert mb.old_logprobs is not None and mb.advantages is not None
        mask_BT = mb.loss_mask.float()
        advantages_BT = mb.advantages
        rc_metrics: dict[str, torch.Tensor] = {}
        if self.rollout_correction is not None:  # IS weights into A, rejected tokens out of the mask
            weights_BT, mask_BT, rc_metrics = self.rollout_correction(mb.old_logprobs, mb.rollout_logprobs, mask_BT)
            advantages_BT = advantages_BT * weights_BT
        norm = self.loss_agg_mode == "seq-mean-token-sum-norm"
        pg, pg_metrics = self.policy_loss(
            logprobs_BT=logprobs_BT, old_logprobs_BT=mb.old_logprobs, advantages_BT=advantages_BT,
            response_mask_BT=mask_BT, loss_agg_mode="seq-mean-token-sum" if norm else self.loss_agg_mode,
            global_normalizer=normalizer)
        if norm:
            assert self.norm_constant is not None
            pg = pg / self.norm_constant
        entropy = self._aggregate(entropy_BT, mask_BT, normalizer)
        d = self.distillation if self.distillation is not None and self.distillation.enabled else None
        loss = pg if d is None or d.use_task_rewards else torch.zeros_like(pg)
        loss = loss - self.entropy_coeff * entropy if self.entropy_coeff else loss
        metrics = {k: v for k, v in pg_metrics.items() if k != "pg_loss"}
        metrics |= {"pg_loss_sum": pg.detach(), "entropy_sum": entropy.detach()} | rc_metrics
        if self.use_kl_loss:
            assert mb.ref_logprobs is not None, "use_kl_loss needs ref log-probs in the batch"
            kl_BT = kl_penalty(logprobs_BT, mb.ref_logprobs, self.kl_loss_type)
            kl = self._aggregate(kl_BT, mask_BT, normalizer)
            loss = loss + self.kl_loss_coef * kl
            metrics["kl_ref_sum"] = kl.detach()
        if d is not None:
            distill_BT, diagnostics = distillation_losses_BT(
                d, logprobs_BT=logprobs_BT, teacher_logprobs_BT=mb.teacher_logprobs,
                student_topk_BTK=topk_logprobs_BTK, teacher_topk_BTK=mb.teacher_topk_logprobs)
            distill = self._aggregate(distill_BT, mask_BT, normalizer)
            loss = loss + d.distillation_loss_coef * distill
            metrics["distill_loss_sum"] = distill.detach()
            metrics |= {f"distill_{k}_sum": self._aggregate(v, mask_BT, normalizer) for k, v in diagnostics.items()}
        return loss, metrics

    def _aggregate(self, x_BT: torch.Tensor, mask_BT: torch.Tensor, normalizer: torch.Tensor) -> torch.Tensor:
        return aggregate(x_BT, mask_BT, self.loss_agg_mode, global_normalizer=normalizer,
                         norm_constant=self.norm_constant)
