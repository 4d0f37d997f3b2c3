"""``environment``: no score of its own, so a multi-turn sample scores its environment's rewards alone.

The reward runner adds each sample's environment rewards (``SampleMeta.env_reward``: Σ over its episode's
``EnvStep.reward``) to the score of ``reward.name`` (:func:`hybridrl.rewards.execution.with_env_rewards`); with this
reward the sum is the score. A sample without an environment scores 0.0. ``correct_B``: None (accuracy counts
score > 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import RewardOutput


class EnvironmentReward:
    overlaps_compute: ClassVar[bool] = True  # no work at all

    @dataclass(slots=True, kw_only=True)
    class Config:
        pass

    def __init__(self, config: EnvironmentReward.Config | None = None, **ctx: Any) -> None:
        self.config = config if config is not None else self.Config()

    def __call__(self, batch: RolloutBatch) -> RewardOutput:
        return RewardOutput(scores_B=torch.zeros(len(batch)))
