"""Step guards: a non-finite number never reaches the optimizer, the engines or a checkpoint.

- **Reward contract.** A reward manager returns ``scores_B``: a 1-D floating tensor with one score per
  sample. Anything else (a length-1 output would broadcast to every sample: all GRPO advantages 0, no
  learning, a wrong ``reward/mean``) is an error naming ``reward.name`` and what came back.
- **Skipped steps.** A non-finite score or advantage on any rank skips the whole step on every rank
  (decided together, so no rank waits in a collective the others skip): no update, no weight sync.
  The cause — which values, which samples, which reward — is logged and counted
  (``training/skipped_steps``); ``trainer.max_consecutive_skipped_steps`` skips in a row stop the run
  with that cause. The policy skips an optimizer step whose loss or gradient norm is not finite
  (``actor/update_skipped``), which counts the same way.
- **Finite weights only leave the trainer.** Before a weight sync or a checkpoint, every rank checks
  its parameters; a non-finite one stops the run (nothing is synced or saved).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from hybridrl.distributed import host_group


class RewardContractError(ValueError):
    """A reward manager returned scores of the wrong shape or type."""


class NonFiniteError(RuntimeError):
    """Non-finite numbers where the run cannot continue (too many skipped steps, non-finite weights)."""


def check_reward_scores(scores_B: object, *, batch_size: int, reward: str) -> torch.Tensor:
    """``scores_B`` as float32 if it is a 1-D floating tensor of ``batch_size`` scores, else raise naming ``reward``."""
    where = f"reward.name={reward!r} returned scores_B"
    if not isinstance(scores_B, torch.Tensor):
        raise RewardContractError(f"{where} of type {type(scores_B).__name__}; expected a 1-D float tensor of "
                                  f"{batch_size} scores (one per sample)")
    if scores_B.ndim != 1 or scores_B.shape[0] != batch_size:
        raise RewardContractError(f"{where} of shape {tuple(scores_B.shape)}; expected ({batch_size},): one score "
                                  f"per sample of the batch (nothing is broadcast)")
    if not scores_B.dtype.is_floating_point:
        raise RewardContractError(f"{where} of dtype {scores_B.dtype}; expected a floating dtype")
    return scores_B.float()


def non_finite(what: str, values: torch.Tensor, *, sample_ids: Sequence[int] | None = None,
               limit: int = 4) -> str | None:
    """A description of ``values``' non-finite entries (None: all finite)."""
    bad = (~torch.isfinite(values)).nonzero()
    if not len(bad):
        return None
    first = [tuple(int(i) for i in b) for b in bad[:limit]]
    shown = ", ".join(f"sample {b[0]}" + (f" (dataset row {sample_ids[b[0]]})" if sample_ids is not None else "")
                      + (f" token {b[1]}" if len(b) > 1 else "") + f" = {values[b].item()}" for b in first)
    return f"{len(bad)} non-finite {what}: {shown}{' …' if len(bad) > limit else ''}"


def agree(cause: str | None) -> str | None:
    """The first rank's cause, on every rank, if any rank has one (one flag all-reduce when all is well)."""
    group = host_group.get()
    flag = torch.tensor([cause is not None], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return None
    causes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(causes, cause, group=group)
    return next(f"rank {r}: {c}" for r, c in enumerate(causes) if c is not None)


def require_finite(tensors: Iterable[torch.Tensor], *, what: str) -> None:
    """Stop the run (on every rank) if any rank holds a non-finite entry in ``tensors``."""
    local = next((f"{what} are not all finite" for t in tensors if not bool(torch.isfinite(t).all())), None)
    cause = agree(local)
    if cause is not None:
        raise NonFiniteError(f"{cause}; stopping before it reaches the rollout engines or a checkpoint")


def update_skip_cause(updates: list[dict[str, float]]) -> str | None:
    """Why an RL step's actor update counts as skipped, or None: a non-finite loss or gradient caught by the
    guard in any optimizer step (fp32/bf16), or no optimizer step applied at all (fp16: the loss scaler
    skipped every one; a single overflow that the scale absorbs is routine and does not count)."""
    if any(u["grad_nonfinite"] for u in updates):
        return "an update's loss or gradient norm was not finite"
    if all(u["update_skipped"] for u in updates):
        return f"the fp16 loss scaler skipped all {len(updates)} optimizer step(s) (gradient overflow)"
    return None


class SkipCounter:
    """Consecutive and total skipped steps; too many in a row stop the run with the last cause."""

    def __init__(self, *, limit: int) -> None:
        self.limit, self.in_a_row, self.total = limit, 0, 0

    def record(self, cause: str | None) -> None:
        if cause is None:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.limit and self.in_a_row >= self.limit:
            raise NonFiniteError(f"{self.in_a_row} steps in a row were skipped (trainer.max_consecutive_skipped_steps="
                                 f"{self.limit}); the last because {cause}")
