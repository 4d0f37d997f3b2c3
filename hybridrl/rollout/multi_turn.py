"""The multi-turn rollout (``actor_rollout_ref.rollout.multi_turn.enable``): episodes of policy turns, tool calls
and environment messages, trained on token-exactly.

Every rank runs the same loop over the whole step (SPMD; host objects only)::

    while some episode is live (at most multi_turn.max_assistant_turns turns each):
        generate  every live episode's context (prompt + its response so far) on the engines, all at once, one
                  sample each, seeded by (step seed, sample, turn): the same trajectories at every layout
        act       each episode on the rank that owns it (sample mod world size): its tool calls, else its
                  environment's step, else the end (hybridrl.rollout.episodes); the template's ids of what
                  comes next
        share     the acts over all ranks (one all_gather)

A sample's response is everything after its prompt: the policy's turns as sampled (``loss_mask`` 1, the engine's
log-probs) and the appended ids (``loss_mask`` 0, log-prob 0), within one budget of ``data.max_response_length``
tokens (a turn's generation is cut to what is left; an episode whose appended ids reach it ends, ``finish_reason``
"length"). Each rank then keeps its DP share; the reward scores it, plus the episode's environment rewards
(``SampleMeta.env_reward``; :func:`hybridrl.rewards.execution.with_env_rewards`). An episode whose environment
failed ends there: under ``reward.on_error=raise`` the step stops on every rank naming it, under ``zero`` it scores
0.0 and counts in ``reward/errors``.

The engines stay awake over the step's turns (SGLang keeps its prefix cache); the trainers wait in host memory as
in a single-turn rollout. Metrics: ``multi_turn/turns_mean`` (policy turns per sample) and the step's totals
``multi_turn/tool_calls``, ``tool_errors``, ``tool_timeouts``, ``tool_truncated``, ``env_errors``.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from hybridrl.batch import RolloutBatch
from hybridrl.data.collate import PromptBatch
from hybridrl.distributed import host_group
from hybridrl.interfaces import Generation, RolloutStep, SamplingParams
from hybridrl.rewards.execution import PendingReward, RewardRunner
from hybridrl.rollout.colocated import prompt_seed
from hybridrl.rollout.episodes import Act, EpisodeActors
from hybridrl.tools.runner import ToolCounts

if TYPE_CHECKING:
    from hybridrl.metrics import Timer


class TurnEngines(Protocol):
    """What the rollout uses of :class:`~hybridrl.rollout.colocated.ColocatedEngines`."""

    def generate_ids(self, contexts: Sequence[list[int]], params: SamplingParams, *, seeds: Sequence[int],
                     max_new_tokens: Sequence[int] | None = None) -> list[Generation]: ...

    def dp_share(self, prompts: PromptBatch, gens: Sequence[Generation]) -> RolloutBatch: ...

    def dp_prompts(self, num_prompts: int) -> range: ...


class MultiTurnWorkers(Protocol):
    @property
    def weight_version(self) -> int: ...

    def generating(self) -> AbstractContextManager[TurnEngines]: ...

    def sync_weights(self, *, version: int | None = None) -> float: ...


class EnvironmentFailed(RuntimeError):
    """An environment raised (or timed out) under ``reward.on_error=raise``."""


@dataclass(slots=True, kw_only=True)
class _Sample:
    prompt_index: int
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    finish: str = "stop"
    weight_version: int = 0
    env_reward: float | None = None
    env_error: str | None = None

    def add_turn(self, g: Generation, room: int) -> list[int]:
        """Append the policy's turn ``g`` (cut to ``room`` tokens); its ids."""
        ids = g.token_ids[:room]
        self.response += ids
        self.logprobs += g.logprobs[:room]
        self.mask += [1] * len(ids)
        self.turns += 1
        self.weight_version = g.weight_version
        self.finish = "length" if len(g.token_ids) > room or g.finish_reason == "length" else "stop"
        return ids

    def apply(self, act: Act, budget: int) -> None:
        """The owner's answer to the turn: its appended ids (cut to the budget), reward, error, end."""
        if act.reward is not None:
            self.env_reward = (self.env_reward or 0.0) + act.reward
        if act.error is not None:
            self.env_error = act.error
        room = budget - len(self.response)
        appended = act.appended[:room]
        self.response += appended
        self.logprobs += [0.0] * len(appended)
        self.mask += [0] * len(appended)
        if act.done or len(act.appended) >= room:
            self.done = True
            if not act.done:
                self.finish = "length"


class MultiTurnRollout:
    """:class:`~hybridrl.interfaces.Rollout` of multi-turn episodes (module docstring)."""

    def __init__(self, hybrid: MultiTurnWorkers, *, prompts: Iterator[PromptBatch], reward: RewardRunner,
                 params: SamplingParams, actors: EpisodeActors, on_error: str, environment: str | None) -> None:
        self.hybrid, self.prompts, self.reward, self.params = hybrid, prompts, reward, params
        self.actors, self.on_error, self.environment = actors, on_error, environment
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    @property
    def weight_version(self) -> int:
        return self.hybrid.weight_version

    def step(self, *, seed: int, timer: Timer) -> RolloutStep:
        with timer("gen"):
            batch, metrics = self._episodes(next(self.prompts), self.params, seed=seed)
        with timer("reward"):
            scores = self.reward.submit(batch) if len(batch) else PendingReward.finished(self.reward.empty())
        return RolloutStep(batch=batch, scores=scores, metrics=metrics)

    def generate(self, prompts: PromptBatch, params: SamplingParams, *, seed: int) -> RolloutBatch:
        return self._episodes(prompts, params, seed=seed)[0]

    def sync_weights(self, *, version: int | None = None) -> float:
        return self.hybrid.sync_weights(version=version)

    def _episodes(self, prompts: PromptBatch, params: SamplingParams, *,
                  seed: int) -> tuple[RolloutBatch, dict[str, float]]:
        try:
            return self._run(prompts, params, seed=seed)
        finally:
            self.actors.close_all()  # episodes a failed step left open (a finished one is closed already)

    def _run(self, prompts: PromptBatch, params: SamplingParams, *,
             seed: int) -> tuple[RolloutBatch, dict[str, float]]:
        n, budget = params.n, params.max_new_tokens
        contexts = prompts.token_lists()
        samples = [_Sample(prompt_index=s // n, prompt=contexts[s // n]) for s in range(len(prompts) * n)]
        for s in range(self.rank, len(samples), self.world):
            self.actors.open(s, prompts.meta[s // n])
        with self.hybrid.generating() as engines:
            for turn in range(budget):  # ends well before: every turn adds a token or ends its episode
                live = [s for s, x in enumerate(samples) if not x.done]
                if not live:
                    break
                left = [budget - len(samples[s].response) for s in live]
                gens = engines.generate_ids([samples[s].prompt + samples[s].response for s in live],
                                            dataclasses.replace(params, n=1, max_new_tokens=max(left)),
                                            seeds=[prompt_seed(prompt_seed(seed, s), turn) for s in live],
                                            max_new_tokens=left)
                mine = []
                for s, g, room in zip(live, gens, left, strict=True):
                    x = samples[s]
                    ids = x.add_turn(g, room)
                    if s % self.world == self.rank:
                        mine.append((s, ids, x.finish == "length", x.turns, prompts.meta[s // n],
                                     prompt_seed(seed, s)))
                for s, act in self._act(mine).items():
                    samples[s].apply(act, budget)
            self._raise_failures(samples)
            metrics = self._metrics(samples)
            gens = [Generation(prompt_index=x.prompt_index, token_ids=x.response, logprobs=x.logprobs,
                               loss_mask=x.mask, finish_reason=x.finish, weight_version=x.weight_version)
                    for x in samples]
            batch = engines.dp_share(prompts, gens)
            kept = engines.dp_prompts(len(prompts))
        batch.meta = [dataclasses.replace(m, env_reward=x.env_reward, env_error=x.env_error)
                      for m, x in zip(batch.meta, samples[kept.start * n:kept.stop * n], strict=True)]
        return batch, metrics

    def _act(self, mine: list[Any]) -> dict[int, Act]:
        """Every live episode's act, each from its owner; a rank whose acting failed (a template that cannot render
        a turn, a broken tool runner) stops every rank, none is left waiting in the gather."""
        try:
            acts, failure = self.actors.act(mine), None
        except Exception as e:  # noqa: BLE001 — re-raised below on every rank
            acts, failure = {}, f"rank {self.rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, (acts, failure), group=host_group.get())
        if failures := [f for _, f in everyone if f is not None]:
            raise RuntimeError(f"the multi-turn rollout failed between turns on {failures[0]}")
        return {s: a for part, _ in everyone for s, a in sorted(part.items())}

    def _raise_failures(self, samples: list[_Sample]) -> None:
        failed = [(s, x.env_error) for s, x in enumerate(samples) if x.env_error is not None]
        if failed and self.on_error == "raise":
            s, error = failed[0]
            raise EnvironmentFailed(
                f"environment {self.environment!r} (actor_rollout_ref.rollout.multi_turn.environment) failed in "
                f"{len(failed)} episode(s); the first, sample {s} of the step: {error}\nreward.on_error=zero would "
                "end such episodes, score them 0.0 and go on")

    def _metrics(self, samples: list[_Sample]) -> dict[str, float]:
        """The step's: the same on every rank (the tool counts of every rank's episodes summed)."""
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, self.actors.tools.take_counts(), group=host_group.get())
        c = ToolCounts()
        for part in everyone:
            c.calls, c.errors, c.timeouts, c.truncated = (c.calls + part.calls, c.errors + part.errors,
                                                          c.timeouts + part.timeouts, c.truncated + part.truncated)
        return {"multi_turn/turns_mean": sum(x.turns for x in samples) / max(len(samples), 1),
                "multi_turn/tool_calls": float(c.calls), "multi_turn/tool_errors": float(c.errors),
                "multi_turn/tool_timeouts": float(c.timeouts), "multi_turn/tool_truncated": float(c.truncated),
                "multi_turn/env_errors": float(sum(x.env_error is not None for x in samples))}
