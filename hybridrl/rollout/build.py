"""Which :class:`~hybridrl.interfaces.Rollout` a run uses, decided from its config in this one place.

- the single-turn rollout over the colocated engines (:mod:`hybridrl.rollout.single_turn`);
- the multi-turn rollout when ``actor_rollout_ref.rollout.multi_turn.enable`` (:mod:`hybridrl.rollout.multi_turn`):
  its tools and environment built from their plugin groups, its chat template proven token-exact first;
- wrapped in DAPO's dynamic sampling when ``algorithm.filter_groups.enable`` (:mod:`hybridrl.rollout.dynamic_sampling`);
- the asynchronous rollout when ``async_training.enable`` (:mod:`hybridrl.rollout.async_rollout`): batches generated
  ahead on the disaggregated engine ranks, within the staleness bound (multi-turn: whole episodes played there);
  under ``algorithm.filter_groups`` rounds of them (:mod:`hybridrl.rollout.async_dynamic`).

Rollout kinds are chosen by the config keys their users already know (verl's), not by a plugin name: a kind
decides placement, weight sync and what a step is, so it belongs to the framework; what third parties plug in
below it are engines, rewards, tools and environments (their entry-point groups).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from hybridrl.config.schema import RLConfig
from hybridrl.data.collate import PromptBatch
from hybridrl.interfaces import Rollout, SamplingParams
from hybridrl.rewards.execution import RewardRunner
from hybridrl.rollout.dynamic_sampling import DynamicSamplingRollout
from hybridrl.rollout.episodes import episode_actors
from hybridrl.rollout.multi_turn import MultiTurnRollout
from hybridrl.rollout.single_turn import SingleTurnRollout

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hybridrl.config.plan import Plan
    from hybridrl.rollout.workers import EngineWorkers


def sampling_params(cfg: RLConfig) -> SamplingParams:
    """A training step's sampling parameters (``actor_rollout_ref.rollout.*``, ``data.max_response_length``)."""
    r = cfg.actor_rollout_ref.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, n=r.n,
                          max_new_tokens=cfg.data.max_response_length,
                          return_routed_experts=cfg.actor_rollout_ref.actor.router_replay.mode == "R3")


def build_rollout(cfg: RLConfig, plan: Plan, *, workers: EngineWorkers, prompts: Iterator[PromptBatch],
                  position: Callable[[], dict[str, int]], reward: RewardRunner,
                  tokenizer: PreTrainedTokenizerBase) -> Rollout:
    """``workers``: the run's engines, which the rollout owns from now on; ``prompts``: the stream of training
    batches; ``position()``: where that stream stands (a resumable
    position, saved by rollouts that draw ahead of the trainer)."""
    rollout: Rollout
    if cfg.async_training.enable:  # validation allows it disaggregated only
        from hybridrl.rollout.async_rollout import AsyncRollout, EpisodeOptions
        from hybridrl.rollout.disaggregated import RemoteEngines
        from hybridrl.rollout.staleness import StalenessGate

        assert isinstance(workers.engines, RemoteEngines)
        gate = StalenessGate(max_staleness=cfg.async_training.staleness_threshold,
                             groups_per_step=plan.batch.prompts_per_step)
        m = cfg.actor_rollout_ref.rollout.multi_turn
        if m.enable:  # the engine ranks play the episodes: the template is proven token-exact here first
            episode_actors(cfg, tokenizer).close_all()
        kind, extra = AsyncRollout, {}
        if cfg.algorithm.filter_groups.enable:
            from hybridrl.rollout.async_dynamic import AsyncDynamicSamplingRollout

            kind, extra = AsyncDynamicSamplingRollout, {"cfg": cfg, "plan": plan}
        return kind(workers, engines=workers.engines, prompts=prompts, position=position, reward=reward,
                    params=sampling_params(cfg), gate=gate, seed=cfg.trainer.seed,
                    mask_stale=cfg.async_training.mask_stale_prefix,
                    episodes=EpisodeOptions(on_error=cfg.reward.on_error, environment=m.environment)
                    if m.enable else None, **extra)
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        rollout = MultiTurnRollout(workers, prompts=prompts, reward=reward, params=sampling_params(cfg),
                                   actors=episode_actors(cfg, tokenizer), on_error=cfg.reward.on_error,
                                   environment=cfg.actor_rollout_ref.rollout.multi_turn.environment)
    else:
        rollout = SingleTurnRollout(workers, prompts=prompts, reward=reward, params=sampling_params(cfg))
    if cfg.algorithm.filter_groups.enable:
        rollout = DynamicSamplingRollout(rollout, cfg=cfg, plan=plan)
    return rollout
