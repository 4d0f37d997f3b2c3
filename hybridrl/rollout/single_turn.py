"""The single-turn rollout: one response per sample from the run's engines (:mod:`hybridrl.rollout.workers`).

A step takes the next prompt batch (the same on every rank), generates ``rollout.n`` samples of each prompt
(the actor, ref and critic wait in host memory as the ``*_offload`` keys say while the engines hold theirs) and
submits this rank's DP share to the reward, which may score while the loop runs the log-prob passes. Weight
sync streams the actor's weights into the engines in place.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from hybridrl.batch import RolloutBatch
from hybridrl.data.collate import PromptBatch
from hybridrl.interfaces import RolloutStep, SamplingParams
from hybridrl.rewards.execution import PendingReward, RewardRunner

if TYPE_CHECKING:
    from hybridrl.metrics import Timer


class ColocatedWorkers(Protocol):
    """What the rollout uses of the engines it owns (:class:`~hybridrl.rollout.workers.EngineWorkers`): generation
    (with the trainer's memory phases) and the weight sync from the actor."""

    @property
    def weight_version(self) -> int: ...

    def generate(self, prompts: PromptBatch, params: SamplingParams, *, seed: int) -> RolloutBatch: ...

    def sync_weights(self, *, version: int | None = None) -> float: ...

    def shutdown(self) -> None: ...


class SingleTurnRollout:
    """:class:`~hybridrl.interfaces.Rollout` of one engine call per prompt batch."""

    def __init__(self, workers: ColocatedWorkers, *, prompts: Iterator[PromptBatch], reward: RewardRunner,
                 params: SamplingParams) -> None:
        self.workers, self.prompts, self.reward, self.params = workers, prompts, reward, params

    @property
    def weight_version(self) -> int:
        return self.workers.weight_version

    def step(self, *, seed: int, timer: Timer) -> RolloutStep:
        with timer("gen"):
            batch = self.generate(next(self.prompts), self.params, seed=seed)
        with timer("reward"):
            scores = self.reward.submit(batch) if len(batch) else PendingReward.finished(self.reward.empty())
        return RolloutStep(batch=batch, scores=scores)

    def generate(self, prompts: PromptBatch, params: SamplingParams, *, seed: int) -> RolloutBatch:
        return self.workers.generate(prompts, params, seed=seed)

    def sync_weights(self, *, version: int | None = None) -> float:
        return self.workers.sync_weights(version=version)

    def shutdown(self) -> None:
        self.workers.shutdown()
