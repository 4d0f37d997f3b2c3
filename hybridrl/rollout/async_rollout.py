"""Asynchronous rollouts (``async_training.enable``) on a disaggregated placement: the engines generate the next
steps' batches while the trainer trains on this one, S = ``async_training.staleness_threshold`` versions behind
at most.

Schedule (per trainer step, every trainer rank; trainer rank 0 talks to the engines,
:mod:`hybridrl.rollout.disaggregated`):

1. **top up**: while the staleness gate (:mod:`hybridrl.rollout.staleness`) admits a whole step's groups at the
   trainer's weight version v, the next prompt batch is queued on the engines. The engines run their commands in
   order, so a batch queued after the update to version u generates on weights ≥ u;
2. **collect** the oldest queued batch (waiting only if the engines are behind) and check each of its groups at
   consumption: trained version − oldest token version ≤ S. A batch with a stale group is dropped whole (counted
   in ``async/dropped_samples``; the gate's admission rule makes this rare: it needs a resume or a reordering);
3. the loop trains on it, then syncs the weights — queued behind the generations already submitted.

Multi-turn (``multi_turn.enable``): a queued batch is a batch of whole episodes, each played out on the engine
rank that holds its prompt — its engine, tools and environment (:func:`hybridrl.rollout.multi_turn.play_share`), with
the seeds the synchronous rollout gives it; a turn that a partial rollout interrupts continues on the new weights,
so an episode's turns may span versions (its version: the oldest that sampled a token of it).

With S = 0 the gate admits one batch per version: the synchronous schedule, the same samples (the seeds are the
step's, whichever step queued the batch), the same run. S = 1 without partial rollouts is one-step-off-policy
(verl's ``one_step_off_policy``): generation of step k + 1 overlaps the update of step k; a weight update waits
for the generations queued before it. With ``partial_rollout`` it interrupts them instead: they continue on the new
weights (:mod:`hybridrl.rollout.partial`), each token carrying the version that sampled it, and
``mask_stale_prefix`` keeps the tokens of older versions out of the loss.

Metrics per step: ``async/staleness_mean`` and ``async/staleness_max`` (trained version − each sample's oldest
token version), ``async/dropped_samples`` (so far), ``async/partial_samples`` (this step's samples whose tokens
came from more than one version) and ``async/stale_prefix_tokens`` (their tokens sampled before the version that
finished them: out of the loss under ``mask_stale_prefix``), ``async/trainer_idle_ratio`` (the share of the last
step's wall time trainer rank 0 spent waiting for samples or for the engines to take weights) and
``async/engine_idle_ratio`` (the share the busiest engine spent not generating).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridrl.batch import RolloutBatch
from hybridrl.data.collate import PromptBatch
from hybridrl.interfaces import Generation, RolloutStep, SamplingParams
from hybridrl.rewards.execution import PendingReward, RewardRunner
from hybridrl.rollout.disaggregated import RemoteEngines
from hybridrl.rollout.multi_turn import Episodes, raise_failures, with_episode_meta
from hybridrl.rollout.partial import mask_stale_prefix
from hybridrl.rollout.single_turn import ColocatedWorkers
from hybridrl.rollout.staleness import StalenessGate
from hybridrl.seeds import prompt_seed, step_seed

if TYPE_CHECKING:
    from hybridrl.metrics import Timer


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeOptions:
    """Multi-turn (``multi_turn.enable``): what the trainer side applies to the episodes the engine ranks play."""

    on_error: str  # reward.on_error
    environment: str | None  # multi_turn.environment (named in a failure)


@dataclass(slots=True)
class Queued:
    ticket: int
    prompts: PromptBatch
    step: int  # the trainer step it was drawn for (its seed)
    position: dict[str, int]  # the loader's position before it was drawn (a resume draws it again)
    round: int = 0  # under dynamic sampling: its round of that step (its seed: hybridrl.rollout.async_dynamic)


class AsyncRollout:
    """:class:`~hybridrl.interfaces.Rollout` whose batches are generated ahead, within the staleness bound."""

    def __init__(self, workers: ColocatedWorkers, *, engines: RemoteEngines, prompts: Iterator[PromptBatch],
                 position: Callable[[], dict[str, int]], reward: RewardRunner, params: SamplingParams,
                 gate: StalenessGate, seed: int, mask_stale: bool = False,
                 episodes: EpisodeOptions | None = None) -> None:
        self.workers, self.engines, self.prompts, self.reward, self.params = workers, engines, prompts, reward, params
        self.position, self.gate, self.seed, self.mask_stale = position, gate, seed, mask_stale
        self.episodes = episodes  # multi-turn: whole episodes are played on the engine ranks
        self.queued: deque[Queued] = deque()
        self.next_step = 1  # the step the next drawn batch is for
        self._window = (time.perf_counter(), 0.0, 0.0)  # (start, rank 0's waits, engine busy) of the last step

    @property
    def weight_version(self) -> int:
        return self.workers.weight_version

    def step(self, *, seed: int, timer: Timer) -> RolloutStep:
        version = self.weight_version
        with timer("gen"):  # the wait for this step's samples (about 0 when the engines were ahead)
            batch, gens, episode_metrics = self._next(version, seed)
        staleness = [version - g.weight_version for g in gens]
        partial, stale_prefix = token_version_counts(gens)
        metrics = {"async/staleness_mean": sum(staleness) / len(staleness),
                   "async/staleness_max": float(max(staleness)),
                   "async/dropped_samples": float(self.gate.dropped * self.params.n),
                   "async/partial_samples": float(partial), "async/stale_prefix_tokens": float(stale_prefix),
                   **self._idle(), **episode_metrics}
        with timer("reward"):
            scores = self.reward.submit(batch) if len(batch) else PendingReward.finished(self.reward.empty())
        return RolloutStep(batch=batch, scores=scores, metrics=metrics)

    def _next(self, version: int, seed: int) -> tuple[RolloutBatch, list[Generation], dict[str, float]]:
        """This step's batch (this rank's DP share), all its samples and the episodes' metrics (multi-turn);
        batches with a stale group are dropped."""
        groups = self.gate.groups_per_step
        while True:
            self._top_up(version)
            queued = self.queued.popleft()
            made = self._collect(queued.ticket)
            gens = made.gens if isinstance(made, Episodes) else made
            for _ in range(groups):
                self.gate.finished(kept=True)
            oldest: dict[int, int] = {}
            for g in gens:
                oldest[g.prompt_index] = min(oldest.get(g.prompt_index, g.weight_version), g.weight_version)
            kept = [self.gate.admissible(oldest_version=v, train_version=version) for v in oldest.values()]
            if all(kept):
                break
            self.gate.discard(sum(kept))  # the rest of a dropped batch goes too
        if seed != step_seed(self.seed, queued.step) and not self.gate.dropped:
            raise RuntimeError(f"async rollout: the batch for step {queued.step} came at the loop's seed {seed}")
        self.gate.trained(groups)
        if isinstance(made, Episodes):
            made.gens = [mask_stale_prefix(g) for g in gens] if self.mask_stale else gens
            return self._episode_batch(queued.prompts, made), gens, made.metrics()
        trained = [mask_stale_prefix(g) for g in gens] if self.mask_stale else gens
        return self.engines.dp_share(queued.prompts, trained), gens, {}

    def _submit(self, prompts: PromptBatch, params: SamplingParams, *, seed: int) -> int:
        if self.episodes is not None:
            return self.engines.submit_episodes(prompts.token_lists(), prompts.meta, params, seed=seed)
        return self.engines.submit(prompts.token_lists(), params,
                                   seeds=[prompt_seed(seed, i) for i in range(len(prompts))])

    def _collect(self, ticket: int) -> list[Generation] | Episodes:
        parts = self.engines.collect_parts(ticket)
        return Episodes.joined(parts) if self.episodes is not None else [g for gens in parts for g in gens]

    def _episode_batch(self, prompts: PromptBatch, episodes: Episodes) -> RolloutBatch:
        """This rank's share of a batch of episodes, their environment outcome attached (``reward.on_error``)."""
        assert self.episodes is not None
        raise_failures(episodes, on_error=self.episodes.on_error, environment=self.episodes.environment)
        batch = self.engines.dp_share(prompts, episodes.gens)
        with_episode_meta(batch, episodes, kept=self.engines.dp_prompts(len(prompts)), n=self.params.n)
        return batch

    def _top_up(self, version: int) -> None:
        """Queue whole batches while the gate admits a step's groups at ``version``."""
        groups = self.gate.groups_per_step
        while self.gate.capacity(version) >= groups:
            for _ in range(groups):
                self.gate.try_admit(version)
            position = self.position()
            prompts = next(self.prompts)
            ticket = self._submit(prompts, self.params, seed=step_seed(self.seed, self.next_step))
            self.queued.append(Queued(ticket=ticket, prompts=prompts, step=self.next_step, position=position))
            self.next_step += 1

    def state_dict(self) -> dict[str, Any]:
        """The staleness count and the position of the oldest batch not trained yet (the batches generated ahead,
        and any in flight, are not saved: a resumed run draws them again and generates them on its weights)."""
        oldest = self.queued[0] if self.queued else None
        return {"gate": self.gate.state_dict(), "next_step": oldest.step if oldest else self.next_step,
                "sampler": oldest.position if oldest else self.position()}

    def load_state_dict(self, state: dict[str, Any] | None, *, step: int) -> None:
        """Continue after ``step`` trained steps: the gate counts only trained groups (AReaL#1388: a bound restored
        with the buffered samples grew past S), so admission restarts from the restored weights."""
        if self.queued:
            raise RuntimeError("AsyncRollout.load_state_dict after batches were queued: resume before the first step")
        gate = state["gate"] if state else {"consumed": step * self.gate.groups_per_step, "dropped": 0}
        self.gate.load_state_dict(gate)
        self.next_step = int(state["next_step"]) if state else step + 1
        if self.next_step != step + 1:
            raise RuntimeError(f"async rollout state is for step {self.next_step - 1}, the checkpoint for {step}")

    def _idle(self) -> dict[str, float]:
        start, waited, busy = self._window
        now, e = time.perf_counter(), self.engines
        wall = max(now - start, 1e-9)
        self._window = (now, e.waited_s, e.engine_busy_s)
        return {"async/trainer_idle_ratio": min((e.waited_s - waited) / wall, 1.0),
                "async/engine_idle_ratio": max(1.0 - (e.engine_busy_s - busy) / wall, 0.0)}

    def generate(self, prompts: PromptBatch, params: SamplingParams, *, seed: int) -> RolloutBatch:
        """Evaluation: queued behind the generations already submitted, on the weights of the latest update."""
        if self.episodes is None:
            return self.workers.generate(prompts, params, seed=seed)
        made = self._collect(self._submit(prompts, params, seed=seed))
        assert isinstance(made, Episodes)
        return self._episode_batch(prompts, made)

    def sync_weights(self, *, version: int | None = None) -> float:
        return self.workers.sync_weights(version=version)

    def shutdown(self) -> None:
        self.workers.shutdown()


def token_version_counts(gens: Sequence[Generation]) -> tuple[int, int]:
    """The samples whose tokens came from more than one weight version, and their tokens sampled before the
    version that finished them (partial rollouts; both 0 without)."""
    return (sum(len(set(g.token_versions or ())) > 1 for g in gens),
            sum(v < g.token_versions[-1] for g in gens for v in g.token_versions or ()))
