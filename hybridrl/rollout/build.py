"""Which :class:`~hybridrl.interfaces.Rollout` a run uses, decided from its config in this one place.

- the single-turn rollout over the colocated engines (:mod:`hybridrl.rollout.single_turn`);
- wrapped in DAPO's dynamic sampling when ``algorithm.filter_groups.enable`` (:mod:`hybridrl.rollout.dynamic_sampling`).

Rollout kinds are chosen by the config keys their users already know (verl's), not by a plugin name: a kind
decides placement, weight sync and what a step is, so it belongs to the framework; what third parties plug in
below it are engines, rewards, tools and environments (their entry-point groups).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from hybridrl.config.schema import RLConfig
from hybridrl.data.collate import PromptBatch
from hybridrl.interfaces import Rollout, SamplingParams
from hybridrl.rewards.execution import RewardRunner
from hybridrl.rollout.dynamic_sampling import DynamicSamplingRollout
from hybridrl.rollout.single_turn import ColocatedWorkers, SingleTurnRollout

if TYPE_CHECKING:
    from hybridrl.config.plan import Plan


def sampling_params(cfg: RLConfig) -> SamplingParams:
    """A training step's sampling parameters (``actor_rollout_ref.rollout.*``, ``data.max_response_length``)."""
    r = cfg.actor_rollout_ref.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, n=r.n,
                          max_new_tokens=cfg.data.max_response_length)


def build_rollout(cfg: RLConfig, plan: Plan, *, hybrid: ColocatedWorkers, prompts: Iterator[PromptBatch],
                  reward: RewardRunner) -> Rollout:
    rollout: Rollout = SingleTurnRollout(hybrid, prompts=prompts, reward=reward, params=sampling_params(cfg))
    if cfg.algorithm.filter_groups.enable:
        rollout = DynamicSamplingRollout(rollout, cfg=cfg, plan=plan)
    return rollout
