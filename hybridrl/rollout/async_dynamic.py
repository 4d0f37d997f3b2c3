"""DAPO's dynamic sampling in the asynchronous rollout: ``algorithm.filter_groups`` with ``async_training.enable``.

A step trains ``data.train_batch_size`` groups with signal, taken from rounds of ``data.gen_batch_size`` prompts —
the rule and its choices are the synchronous rollout's (:mod:`hybridrl.rollout.dynamic_sampling`: groups beyond the
step's in its last round are discarded, ``max_num_gen_batches`` caps the rounds and tops a short step up with
dropped groups). What is asynchronous is when the rounds are generated:

- **Labels.** A round is queued for a step k as its round r (one loader batch each, drawn when queued) and sampled
  with seed ``step_seed(seed, k) + r·2³²`` — the seed the synchronous rollout gives round r of step k. Step k
  takes its own rounds in r order; rounds of step k it did not need are discarded (the engines drop them, or let
  the running one finish and throw it away: ``dynamic_sampling/wasted_rounds``).
- **Ahead.** Rounds for step j are queued while ``j ≤ v + 1 + S`` at trainer weight version v: step j trains at
  version j − 1, so every round is at most S versions old when trained — the staleness bound in steps, as the
  staleness gate keeps it for whole batches (:mod:`hybridrl.rollout.staleness`; its group count is not used here:
  with filtering a step needs more groups than it trains). How many rounds go ahead for a step: at S = 0 the fewest
  that can fill it, ⌈train_batch_size / gen_batch_size⌉, which the synchronous run draws too; at S ≥ 1 as many as
  the last step's share p of groups with signal says, ⌈train_batch_size / (gen_batch_size·p)⌉, between that fewest
  and ``max_num_gen_batches`` (no cap: 4 × the fewest).
- **Short.** A step still short after its queued rounds queues another at once (behind what is queued; it trains on
  the weights it is generated on).
- **Checked again** when taken: a group whose oldest token version is more than S behind is dropped
  (``async/dropped_samples``); the rule above means none is, and partial rollouts keep a group's first version.

With S = 0 a step's rounds are the synchronous run's — the same loader batches, seeds and samples, so the same run.

Resume: the checkpoint holds the loader position of the oldest round queued for a later step (the rounds generated
ahead are drawn again and regenerated on the restored weights, as whole batches are without filtering) and the last
step's share of groups with signal.

Metrics: the synchronous rollout's ``dynamic_sampling/*`` (``gen_rounds``: the rounds this step took) plus
``dynamic_sampling/wasted_rounds``; ``async/*`` as :mod:`hybridrl.rollout.async_rollout` gives them, staleness over
the trained samples, ``partial_samples``/``stale_prefix_tokens`` over the samples of the rounds the step took.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import Generation, RolloutStep, Scored
from hybridrl.rewards.execution import PendingReward
from hybridrl.rollout.async_rollout import AsyncRollout, Queued, token_version_counts
from hybridrl.rollout.dynamic_sampling import GroupPool, gather_round, index_output, metric_values
from hybridrl.rollout.multi_turn import Episodes
from hybridrl.rollout.partial import mask_stale_prefix
from hybridrl.seeds import ROUND_SEED_STRIDE, step_seed

if TYPE_CHECKING:
    from hybridrl.config.plan import Plan
    from hybridrl.config.schema import RLConfig
    from hybridrl.metrics import Timer

NO_CAP_AHEAD = 4  # without max_num_gen_batches: at most this many times the fewest rounds are queued ahead a step


class AsyncDynamicSamplingRollout(AsyncRollout):
    """:class:`AsyncRollout` whose steps are rounds of groups filtered for signal (the module docstring)."""

    def __init__(self, *args: Any, cfg: RLConfig, plan: Plan, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cfg, b = cfg, plan.batch
        self.want, self.per_round, self.n = b.prompts_per_step, b.prompts_per_generation, b.n
        self.cap = cfg.algorithm.filter_groups.max_num_gen_batches
        self.fewest = -(-self.want // self.per_round)
        self.training = 1  # the step the next call of step() is
        self.admitted: dict[int, int] = {}  # rounds queued so far for each step not yet trained
        self.planned: dict[int, int] = {}  # rounds to queue ahead for each step, fixed when the first is queued
        self.signal_rate = 1.0  # the last step's share of groups with signal

    def step(self, *, seed: int, timer: Timer) -> RolloutStep:
        version, k = self.weight_version, self.training
        if seed != step_seed(self.seed, k):
            raise RuntimeError(f"async dynamic sampling: step {k} came at seed {seed}, not {step_seed(self.seed, k)}")
        pool = GroupPool(want=self.want, n=self.n, refill=self.cap > 0)
        rounds, errors, stale, gens, episodes = 0, 0, 0, list[Generation](), list[Episodes]()
        self.next_step = max(self.next_step, k)
        while not pool.full:
            self._top_up(version)
            queued = self._round_of(k)
            if queued is None:  # the cap
                break
            with timer("gen"):
                made = self._collect(queued.ticket)
            self.gate.round_ended(self.per_round)
            share, made_gens = self._share(queued, made)
            gens += made_gens
            if isinstance(made, Episodes):
                episodes.append(made)
            with timer("reward"):
                scored = self.reward.submit(share).result() if len(share) else self.reward.empty()
                errors += scored.errors
                whole, output, metric_B = gather_round(share, scored.output,
                                                       metric_values(self.cfg, share, scored.output))
                fresh = self._fresh_rows(whole.weight_version, version)
                stale += (len(whole) - len(fresh)) // self.n
                if fresh:
                    pool.add(whole.index(fresh), index_output(output, fresh), metric_B[fresh])
            rounds += 1
        wasted = self._discard_rest(k)
        batch, output, refilled = pool.finish(rounds=rounds, cap=self.cap, why=f" ({stale} groups too stale)")
        self.gate.took(self.want, stale=stale)
        scored_groups = pool.signal_groups + pool.no_signal_groups
        self.signal_rate = pool.signal_groups / scored_groups if scored_groups else self.signal_rate
        self.training += 1
        self.admitted.pop(k, None)
        self.planned.pop(k, None)
        mine = self.engines.dp_prompts(self.want)
        rows = list(range(mine.start * self.n, mine.stop * self.n))
        return RolloutStep(batch=batch.index(rows),
                           scores=PendingReward.finished(Scored(output=index_output(output, rows), errors=errors)),
                           metrics=self._metrics(version, batch, gens, episodes, counts={
                               "gen_rounds": rounds, "kept_groups": pool.signal_groups,
                               "dropped_groups": pool.no_signal_groups, "refilled_groups": refilled,
                               "wasted_rounds": wasted}))

    # ---- rounds ----
    def _top_up(self, version: int) -> None:
        """Queue rounds ahead, step by step, while the step they are for is within S versions of ``version``."""
        while self.next_step <= version + 1 + self.gate.max_staleness:
            k = self.next_step
            if self.admitted.get(k, 0) >= self._planned(k):
                self.next_step += 1
                continue
            self._queue(k)

    def _planned(self, k: int) -> int:
        if k not in self.planned:
            if self.gate.max_staleness == 0:  # only what the synchronous run draws: its samples, exactly
                self.planned[k] = self.fewest
            else:
                limit = self.cap if self.cap > 0 else NO_CAP_AHEAD * self.fewest
                need = -(-self.want // max(self.per_round * self.signal_rate, 1e-9))
                self.planned[k] = int(min(max(need, self.fewest), limit))
        return self.planned[k]

    def _queue(self, k: int) -> Queued:
        r = self.admitted.get(k, 0)
        self.admitted[k] = r + 1
        self.gate.admit_round(self.per_round)
        position = self.position()
        prompts = next(self.prompts)
        ticket = self._submit(prompts, self.params, seed=step_seed(self.seed, k) + r * ROUND_SEED_STRIDE)
        queued = Queued(ticket=ticket, prompts=prompts, step=k, position=position, round=r)
        self.queued.append(queued)
        return queued

    def _round_of(self, k: int) -> Queued | None:
        """Step ``k``'s next round: the oldest queued for it, else one queued now (None: the cap is reached)."""
        for queued in self.queued:
            if queued.step == k:
                self.queued.remove(queued)
                return queued
        if self.cap and self.admitted.get(k, 0) >= self.cap:
            return None
        queued = self._queue(k)
        self.queued.remove(queued)
        return queued

    def _discard_rest(self, k: int) -> int:
        """Drop the rounds queued for step ``k`` that it did not need; how many."""
        rest = [q for q in self.queued if q.step == k]
        for queued in rest:
            self.queued.remove(queued)
            self.engines.discard(queued.ticket)
            self.gate.round_ended(self.per_round)
        return len(rest)

    def _share(self, queued: Queued, made: list[Generation] | Episodes) -> tuple[RolloutBatch, list[Generation]]:
        """This rank's DP share of a collected round (stale prefixes masked when asked) and all its samples."""
        if isinstance(made, Episodes):
            made.gens = [mask_stale_prefix(g) for g in made.gens] if self.mask_stale else made.gens
            return self._episode_batch(queued.prompts, made), made.gens
        gens = [mask_stale_prefix(g) for g in made] if self.mask_stale else made
        return self.engines.dp_share(queued.prompts, gens), gens

    def _fresh_rows(self, versions_B: torch.Tensor, version: int) -> list[int]:
        """The rows of a whole round whose group passes the consumption check (its oldest version ≥ v − S)."""
        oldest_G = versions_B.reshape(-1, self.n).min(-1).values
        fresh_G = (version - oldest_G) <= self.gate.max_staleness
        return [g * self.n + i for g in fresh_G.nonzero().flatten().tolist() for i in range(self.n)]

    def _metrics(self, version: int, batch: RolloutBatch, gens: Sequence[Generation], episodes: list[Episodes], *,
                 counts: dict[str, int]) -> dict[str, float]:
        staleness = (version - batch.weight_version).float()
        partial, stale_prefix = token_version_counts(gens)
        return {"async/staleness_mean": float(staleness.mean()), "async/staleness_max": float(staleness.max()),
                "async/dropped_samples": float(self.gate.dropped * self.n), "async/partial_samples": float(partial),
                "async/stale_prefix_tokens": float(stale_prefix), **self._idle(),
                **(Episodes.joined(episodes).metrics() if episodes else {}),
                **{f"dynamic_sampling/{key}": float(value) for key, value in counts.items()}}

    # ---- resume ----
    def state_dict(self) -> dict[str, Any]:
        """As :meth:`AsyncRollout.state_dict`; the oldest queued round is the first of a later step's."""
        return {**super().state_dict(), "signal_rate": self.signal_rate}

    def load_state_dict(self, state: dict[str, Any] | None, *, step: int) -> None:
        super().load_state_dict(state, step=step)
        self.training = self.next_step = step + 1
        self.signal_rate = float(state.get("signal_rate", 1.0)) if state else 1.0
