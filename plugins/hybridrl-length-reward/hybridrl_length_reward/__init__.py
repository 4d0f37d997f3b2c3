"""Reward manager: score = -|response_length - target_length| / scale, clipped at ``min_score``.

A response of exactly ``target_length`` tokens counts as correct (``correct_B``, for the accuracy
metrics); per-sample info: ``length``.

A deliberately simple, task-free reward that shapes response length; mostly an example of how a
third-party package plugs into hybridrl (see pyproject.toml's entry point).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hybridrl.interfaces import RewardOutput

if TYPE_CHECKING:
    from hybridrl.batch import RolloutBatch


class LengthReward:
    overlaps_compute: ClassVar[bool] = True  # no GPU, no collectives: may score while the log-prob passes run

    @dataclass(kw_only=True, slots=True)
    class Config:
        target_length: int = 16  # tokens
        scale: float = 16.0
        min_score: float = -1.0

        def __post_init__(self) -> None:
            if self.target_length < 1:
                raise ValueError(f"target_length={self.target_length} must be ≥ 1")
            if self.scale <= 0:
                raise ValueError(f"scale={self.scale} must be > 0")

    def __init__(self, config: Config, **ctx: Any) -> None:
        self.config = config

    def __call__(self, batch: RolloutBatch) -> RewardOutput:
        lengths_B = batch.response_mask.sum(dim=-1).to(torch.float32)
        c = self.config
        scores_B = (-(lengths_B - c.target_length).abs() / c.scale).clamp(min=c.min_score)
        return RewardOutput(scores_B=scores_B, correct_B=lengths_B == c.target_length,
                            info={"length": lengths_B.tolist()})
