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

A vision-language policy's sample carries its images in sequence order (``SampleMeta.images``): the prompt's, then
each tool result's as its act appends them (an image whose placeholders do not all fit the budget is left out, with
the ids from its run on); every turn generates with all of them.

The engines stay awake over the step's turns (SGLang keeps its prefix cache); the trainers wait in host memory as
in a single-turn rollout. Metrics: ``multi_turn/turns_mean`` (policy turns per sample) and the step's totals
``multi_turn/tool_calls``, ``tool_errors``, ``tool_timeouts``, ``tool_truncated``, ``env_errors`` and
``env_errors/<kind>`` (``Act.error_kind``); under ``reward.on_error=zero`` the first distinct reasons are logged.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.data.collate import PromptBatch
from hybridrl.distributed import host_group
from hybridrl.interfaces import Generation, RolloutStep, SamplingParams
from hybridrl.rewards.execution import PendingReward, RewardRunner
from hybridrl.rollout.episodes import Act, EpisodeActors, OwnedTurn
from hybridrl.seeds import prompt_seed
from hybridrl.tools.runner import ToolCounts
from hybridrl.tracking import say
from hybridrl.vlm.inputs import ImageInputs, stack_images
from hybridrl.vlm.tool_images import first_images

if TYPE_CHECKING:
    from hybridrl.metrics import Timer


class Generate(Protocol):
    """An engine's ``generate`` of token-id contexts (``images``: each context's, passed only when one has any)."""

    def __call__(self, contexts: Sequence[list[int]], params: SamplingParams, *, seeds: Sequence[int],
                 max_new_tokens: Sequence[int] | None = None,
                 images: Sequence[ImageInputs | None] | None = None) -> list[Generation]: ...


class TurnEngines(Protocol):
    """What the rollout uses of :class:`~hybridrl.rollout.colocated.ColocatedEngines`."""

    def generate_ids(self, contexts: Sequence[list[int]], params: SamplingParams, *, seeds: Sequence[int],
                     max_new_tokens: Sequence[int] | None = None,
                     images: Sequence[ImageInputs | None] | None = None) -> list[Generation]: ...

    def dp_share(self, prompts: PromptBatch, gens: Sequence[Generation]) -> RolloutBatch: ...

    def dp_prompts(self, num_prompts: int) -> range: ...


class MultiTurnWorkers(Protocol):
    @property
    def weight_version(self) -> int: ...

    def generating(self) -> AbstractContextManager[TurnEngines]: ...

    def sync_weights(self, *, version: int | None = None) -> float: ...

    def shutdown(self) -> None: ...


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
    versions: list[int] = field(default_factory=list)  # the weight version of each response token
    last_version: int = 0  # the version of the latest turn
    env_reward: float | None = None
    env_error: str | None = None
    env_error_kind: str | None = None
    turn_start: int = 0  # where the latest turn starts in the response
    images: ImageInputs | None = None  # the sample's images in sequence order: the prompt's, then tool results'

    def add_turn(self, g: Generation, room: int) -> list[int]:
        """Append the policy's turn ``g`` (cut to ``room`` tokens); its ids."""
        ids = g.token_ids[:room]
        self.turn_start = len(self.response)
        self.response += ids
        self.logprobs += g.logprobs[:room]
        self.mask += [1] * len(ids)
        self.versions += (g.token_versions or [g.weight_version] * len(g.token_ids))[:room]
        self.last_version = (g.token_versions or [g.weight_version])[-1]
        self.turns += 1
        self.finish = "length" if len(g.token_ids) > room or g.finish_reason == "length" else "stop"
        return ids

    def generation(self) -> Generation:
        """The whole episode as one sample; its version: the oldest that sampled a token of it."""
        sampled = [v for v, m in zip(self.versions, self.mask, strict=True) if m] or [self.last_version]
        mixed = len(set(sampled)) > 1  # turns on several versions (asynchronous rollouts)
        return Generation(prompt_index=self.prompt_index, token_ids=self.response, logprobs=self.logprobs,
                          loss_mask=self.mask, finish_reason=self.finish, weight_version=min(sampled),
                          token_versions=self.versions if mixed else None)

    def apply(self, act: Act, budget: int) -> None:
        """The owner's answer to the turn: its appended ids (cut to the budget), reward, error, end."""
        if act.reward is not None:
            self.env_reward = (self.env_reward or 0.0) + act.reward
        if act.error is not None:
            self.env_error, self.env_error_kind = act.error, act.error_kind or "error"
        if act.keep is not None:  # the turn cut short (an agent's max_tokens or stop): as if never sampled
            end = self.turn_start + act.keep
            del self.response[end:], self.logprobs[end:], self.mask[end:], self.versions[end:]
        room = budget - len(self.response)
        if act.images is not None:  # an image whose placeholders do not all fit is left out, with the ids after it
            fits = sum(start + n <= room for start, n in act.image_runs)
            if fits < len(act.image_runs):
                room = act.image_runs[fits][0]
            self.images = stack_images([self.images, first_images(act.images, fits)])
        appended = act.appended[:room]
        self.response += appended
        self.logprobs += [0.0] * len(appended)
        self.mask += [0] * len(appended)
        self.versions += [self.last_version] * len(appended)  # not sampled: the version of the turn before
        if act.done or len(act.appended) >= room:
            self.done = True
            if not act.done:
                self.finish = "length"
            elif act.finish is not None:
                self.finish = act.finish


class MultiTurnRollout:
    """:class:`~hybridrl.interfaces.Rollout` of multi-turn episodes (module docstring)."""

    def __init__(self, workers: MultiTurnWorkers, *, prompts: Iterator[PromptBatch], reward: RewardRunner,
                 params: SamplingParams, actors: EpisodeActors, on_error: str, environment: str | None) -> None:
        self.workers, self.prompts, self.reward, self.params = workers, prompts, reward, params
        self.actors, self.on_error, self.environment = actors, on_error, environment
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    @property
    def weight_version(self) -> int:
        return self.workers.weight_version

    def step(self, *, seed: int, timer: Timer) -> RolloutStep:
        with timer("gen"):
            batch, metrics = self._episodes(next(self.prompts), self.params, seed=seed)
        with timer("reward"):
            scores = self.reward.submit(batch) if len(batch) else PendingReward.finished(self.reward.empty())
        return RolloutStep(batch=batch, scores=scores, metrics=metrics)

    def generate(self, prompts: PromptBatch, params: SamplingParams, *, seed: int) -> RolloutBatch:
        return self._episodes(prompts, params, seed=seed)[0]

    def sync_weights(self, *, version: int | None = None) -> float:
        return self.workers.sync_weights(version=version)

    def shutdown(self) -> None:
        self.workers.shutdown()

    def _episodes(self, prompts: PromptBatch, params: SamplingParams, *,
                  seed: int) -> tuple[RolloutBatch, dict[str, float]]:
        try:
            return self._run(prompts, params, seed=seed)
        finally:
            self.actors.close_all()  # episodes a failed step left open (a finished one is closed already)

    def _run(self, prompts: PromptBatch, params: SamplingParams, *,
             seed: int) -> tuple[RolloutBatch, dict[str, float]]:
        n = params.n
        contexts = prompts.token_lists()
        samples = {s: _Sample(prompt_index=s // n, prompt=contexts[s // n], images=prompts.meta[s // n].images)
                   for s in range(len(prompts) * n)}
        for s in range(self.rank, len(samples), self.world):
            self.actors.open(s, prompts.meta[s // n])
        with self.workers.generating() as engines:
            play(samples, prompts.meta, params, seed=seed, owns=lambda s: s % self.world == self.rank,
                 generate=engines.generate_ids, act=self._act)
            episodes = Episodes.of(list(samples.values()), counts=self._counts())
            raise_failures(episodes, on_error=self.on_error, environment=self.environment)
            batch = engines.dp_share(prompts, episodes.gens)
            with_episode_meta(batch, episodes, kept=engines.dp_prompts(len(prompts)), n=n)
        return batch, episodes.metrics()

    def _act(self, mine: list[OwnedTurn]) -> dict[int, Act]:
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

    def _counts(self) -> ToolCounts:
        """The tool counts of every rank's episodes this step, summed (the same on every rank)."""
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, self.actors.tools.take_counts(), group=host_group.get())
        return sum_counts(everyone)


def play(samples: dict[int, _Sample], metas: Sequence[SampleMeta], params: SamplingParams, *, seed: int,
         owns: Callable[[int], bool], generate: Generate,
         act: Callable[[list[OwnedTurn]], dict[int, Act]]) -> None:
    """The turn loop over ``samples`` (by sample index in the step; each ends when done): every live episode
    generates at once, then each one ``owns`` answers acts, and ``act`` returns every live episode's act."""
    n, budget = params.n, params.max_new_tokens
    for turn in range(budget):  # ends well before: every turn adds a token or ends its episode
        live = [s for s, x in samples.items() if not x.done]
        if not live:
            break
        left = [budget - len(samples[s].response) for s in live]
        images = [samples[s].images for s in live]  # all of each context's images so far, in sequence order
        gens = generate([samples[s].prompt + samples[s].response for s in live],
                        dataclasses.replace(params, n=1, max_new_tokens=max(left)),
                        seeds=[prompt_seed(prompt_seed(seed, s), turn) for s in live], max_new_tokens=left,
                        **({"images": images} if any(x is not None for x in images) else {}))
        mine = []
        for s, g, room in zip(live, gens, left, strict=True):
            x = samples[s]
            context = len(x.prompt) + len(x.response)
            ids = x.add_turn(g, room)
            if owns(s):
                mine.append(OwnedTurn(sample=s, ids=ids, logprobs=g.logprobs[:room], cut=x.finish == "length",
                                      turns=x.turns, meta=metas[s // n], seed=prompt_seed(seed, s),
                                      context_tokens=context, params=params))
        for s, a in act(mine).items():
            samples[s].apply(a, budget)


def play_share(actors: EpisodeActors, share: range, contexts: Sequence[list[int]], metas: Sequence[SampleMeta],
               params: SamplingParams, *, seed: int, generate: Generate) -> Episodes:
    """The episodes of the prompts at positions ``share``, all played here (one engine and its own actors: an
    engine rank of an asynchronous run); the same seeds as :class:`MultiTurnRollout` gives them."""
    n = params.n
    samples = {s: _Sample(prompt_index=s // n, prompt=list(contexts[s // n]), images=metas[s // n].images)
               for s in range(share.start * n, share.stop * n)}
    try:
        for s in samples:
            actors.open(s, metas[s // n])
        play(samples, metas, params, seed=seed, owns=lambda s: True, generate=generate, act=actors.act)
    finally:
        actors.close_all()
    return Episodes.of(list(samples.values()), counts=actors.tools.take_counts())


@dataclass(slots=True, kw_only=True)
class Episodes:
    """A step's (or an engine's share of a step's) finished episodes, as samples plus their environment outcome."""

    gens: list[Generation]  # sample order
    env: list[tuple[float | None, str | None]]  # (env_reward, env_error) of each
    error_kinds: list[str | None]  # how each failed (Act.error_kind), None where it did not
    turns: list[int]  # the policy's turns of each
    counts: ToolCounts
    images: list[ImageInputs | None]  # each one's images in sequence order (the prompt's, then tool results')

    @classmethod
    def of(cls, samples: Sequence[_Sample], *, counts: ToolCounts) -> Episodes:
        return cls(gens=[x.generation() for x in samples], env=[(x.env_reward, x.env_error) for x in samples],
                   error_kinds=[x.env_error_kind for x in samples], turns=[x.turns for x in samples], counts=counts,
                   images=[x.images for x in samples])

    @classmethod
    def joined(cls, parts: Sequence[Episodes]) -> Episodes:
        """Engine shares in engine order (their prompts are consecutive ranges): the whole step's."""
        return cls(gens=[g for p in parts for g in p.gens], env=[e for p in parts for e in p.env],
                   error_kinds=[k for p in parts for k in p.error_kinds], turns=[t for p in parts for t in p.turns],
                   counts=sum_counts([p.counts for p in parts]), images=[x for p in parts for x in p.images])

    def metrics(self) -> dict[str, float]:
        c = self.counts
        return {"multi_turn/turns_mean": sum(self.turns) / max(len(self.turns), 1),
                "multi_turn/tool_calls": float(c.calls), "multi_turn/tool_errors": float(c.errors),
                "multi_turn/tool_timeouts": float(c.timeouts), "multi_turn/tool_truncated": float(c.truncated),
                "multi_turn/env_errors": float(sum(error is not None for _, error in self.env)),
                **{f"multi_turn/env_errors/{kind}": float(n) for kind, n in sorted(self.failures().items())}}

    def failures(self) -> dict[str, int]:
        """The failed episodes by kind (``Act.error_kind``)."""
        return dict(Counter(k for k in self.error_kinds if k is not None))


def sum_counts(parts: Sequence[ToolCounts]) -> ToolCounts:
    c = ToolCounts()
    for part in parts:
        c.calls, c.errors, c.timeouts, c.truncated = (c.calls + part.calls, c.errors + part.errors,
                                                      c.timeouts + part.timeouts, c.truncated + part.truncated)
    return c


def with_episode_meta(batch: RolloutBatch, episodes: Episodes, *, kept: range, n: int) -> None:
    """Give this rank's DP share (``batch``, the prompts ``kept``) its episodes' environment rewards and errors, and
    their images (the prompt's and the tool results')."""
    env = episodes.env[kept.start * n:kept.stop * n]
    images = episodes.images[kept.start * n:kept.stop * n]
    batch.meta = [dataclasses.replace(m, env_reward=r, env_error=e, images=x)
                  for m, (r, e), x in zip(batch.meta, env, images, strict=True)]


def raise_failures(episodes: Episodes, *, on_error: str, environment: str | None, shown: int = 3) -> None:
    """Stop the step on a failed episode under ``reward.on_error=raise``; under ``zero`` say how many failed, by kind,
    and the first ``shown`` distinct reasons (their first lines; the rollout dump has each sample's whole reason)."""
    failed = [(s, error) for s, (_, error) in enumerate(episodes.env) if error is not None]
    if failed and on_error != "raise":
        distinct = list(dict.fromkeys(error.strip().splitlines()[0][:300] for _, error in failed))
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(episodes.failures().items()))
        say(f"warning: environment {environment!r}: {len(failed)} of {len(episodes.env)} episodes failed and score "
            f"0.0 (reward.on_error=zero) — {kinds}; the reasons: " + "; ".join(
                f"[{i + 1}] {r}" for i, r in enumerate(distinct[:shown]))
            + (f"; and {len(distinct) - shown} more" if len(distinct) > shown else ""))
    if failed and on_error == "raise":
        s, error = failed[0]
        raise EnvironmentFailed(
            f"environment {environment!r} (actor_rollout_ref.rollout.multi_turn.environment) failed in "
            f"{len(failed)} episode(s); the first, sample {s} of the step: {error}\nreward.on_error=zero would "
            "end such episodes, score them 0.0 and go on")
