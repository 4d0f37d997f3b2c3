"""The dynamic-sampling rollout (DAPO, Yu et al. 2025, §3.2): rounds of another rollout's steps until the step
holds ``data.train_batch_size`` groups with signal (the rule and its settings:
:mod:`hybridrl.algorithms.dynamic_sampling`); the step trains on the first ``data.train_batch_size`` kept groups
(generation order: round, then position).

Choices and deviations:
- A non-finite metric value makes its group count as unequal: it is kept, and the step guard sees it.
- **The cap** (``max_num_gen_batches`` > 0): when the last allowed round leaves fewer than ``train_batch_size``
  groups with signal, the step is topped up with dropped groups, first generated first
  (``dynamic_sampling/refilled_groups``). Their GRPO advantage is 0, so they dilute the step but keep its
  batch at the plan's size, which the fixed mini-batch arithmetic needs. verl raises instead. Validation
  requires ``gen_batch_size × max_num_gen_batches ≥ train_batch_size``, so a refill always fills the step.
  Without a cap, a task the policy always (or never) solves makes the loop generate forever, as in verl.
- Groups with signal beyond ``train_batch_size`` in the last round are discarded, not carried into the next
  step (as verl). Each round takes one loader batch, so a resumed run continues after the rounds used.
- Round r samples with seed ``seed + r·2³²``: round 0 is exactly what a run without filtering samples.
- A prompt drawn twice in one step (rounds across an epoch boundary) keeps its dataset index in both groups;
  if both land on one DP rank, the advantage estimator sees one group of 2n samples.
- Distribution: each rank scores its DP share of a round; the shares, reward outputs and metric values are
  gathered over the DP group (gloo, host objects), so every rank of it decides from the whole round, and
  model-parallel peers, which hold identical shares, decide alike (as they compute identical advantages).
  The step's groups are then cut into DP shares as the rollout cuts prompts (``plan.batch.dp_prompts``): a
  group's samples stay on one rank.
- The scores are needed before the log-prob passes, so scoring does not overlap them; the rounds' generation
  counts in ``timing/gen``, their scoring (and the gather) in ``timing/reward``. ``reward/errors`` counts the
  samples that failed to score in every round, dropped groups included.
- Metrics (the same on every rank): ``dynamic_sampling/gen_rounds``, ``kept_groups`` and ``dropped_groups``
  (groups with and without signal over the rounds, surplus included), ``refilled_groups``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hybridrl.algorithms.dynamic_sampling import group_signal
from hybridrl.batch import RolloutBatch
from hybridrl.config.schema import RLConfig
from hybridrl.data.collate import PromptBatch
from hybridrl.interfaces import RewardOutput, Rollout, RolloutStep, SamplingParams, Scored
from hybridrl.rewards.execution import PendingReward
from hybridrl.rewards.overlong import overlong_penalty_B
from hybridrl.seeds import ROUND_SEED_STRIDE
from hybridrl.tracking import say

if TYPE_CHECKING:
    from hybridrl.config.plan import Plan
    from hybridrl.metrics import Timer

class GroupPool:
    """One step's groups of ``n`` consecutive samples in generation order: the first ``want`` with signal and,
    with ``refill``, the first ``want`` without (to top the step up at the cap)."""

    def __init__(self, *, want: int, n: int, refill: bool) -> None:
        self.want, self.n, self.refill = want, n, refill
        self._kept: list[tuple[RolloutBatch, RewardOutput]] = []
        self._spare: list[tuple[RolloutBatch, RewardOutput]] = []
        self.num_kept = self.num_spare = 0  # groups held
        self.signal_groups = self.no_signal_groups = 0  # groups seen

    @property
    def full(self) -> bool:
        return self.num_kept >= self.want

    @property
    def can_fill(self) -> bool:
        return self.full or (self.refill and self.num_kept + self.num_spare >= self.want)

    def add(self, batch: RolloutBatch, output: RewardOutput, metric_B: torch.Tensor) -> None:
        """A whole round (every DP rank's samples, in prompt order), its reward output and metric values."""
        groups_GN = batch.group_index.reshape(-1, self.n)
        assert bool((groups_GN == groups_GN[:, :1]).all()), "the rollout hands out a prompt's n samples in a row"
        signal_G = group_signal(metric_B, self.n)
        self.signal_groups += int(signal_G.sum())
        self.no_signal_groups += int((~signal_G).sum())
        keep_G = signal_G.nonzero().flatten()[: self.want - self.num_kept]
        self._kept += [_select(batch, output, keep_G, self.n)] if len(keep_G) else []
        self.num_kept += len(keep_G)
        if self.refill:
            spare_G = (~signal_G).nonzero().flatten()[: self.want - self.num_spare]
            self._spare += [_select(batch, output, spare_G, self.n)] if len(spare_G) else []
            self.num_spare += len(spare_G)

    def finish(self, *, rounds: int, cap: int, why: str = "") -> tuple[RolloutBatch, RewardOutput, int]:
        """:meth:`take` after ``rounds`` rounds under ``max_num_gen_batches=cap``, saying when dropped groups fill
        the step; a pool that cannot fill it is an error (``why``: what else the message should say)."""
        if not self.can_fill:  # validation keeps gen_batch_size × max_num_gen_batches ≥ train_batch_size
            raise RuntimeError(f"dynamic sampling: {self.num_kept + self.num_spare} groups after {rounds} rounds, "
                               f"fewer than data.train_batch_size={self.want}{why}")
        batch, output, refilled = self.take()
        if refilled:
            say(f"dynamic sampling: {self.num_kept} groups with signal after algorithm.filter_groups."
                f"max_num_gen_batches={cap} rounds; {refilled} dropped groups fill the step")
        return batch, output, refilled

    def take(self) -> tuple[RolloutBatch, RewardOutput, int]:
        """Exactly ``want`` groups (those with signal first) and how many of them are refills."""
        assert self.can_fill, "GroupPool.take before the pool can fill the step"
        refilled = self.want - min(self.num_kept, self.want)
        parts = self._kept + (self._spare if refilled else [])
        batch = RolloutBatch.cat([b for b, _ in parts])
        rows = list(range(self.want * self.n))
        return batch.index(rows), index_output(cat_outputs([o for _, o in parts]), rows), refilled


class DynamicSamplingRollout:
    """:class:`~hybridrl.interfaces.Rollout` that wraps another: its steps are rounds of ``inner``'s steps until
    the step holds ``data.train_batch_size`` groups with signal (the module docstring). Evaluation and weight
    sync are the inner rollout's."""

    def __init__(self, inner: Rollout, *, cfg: RLConfig, plan: Plan) -> None:
        self.inner, self.cfg, self.plan = inner, cfg, plan

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def generate(self, prompts: PromptBatch, params: SamplingParams, *, seed: int) -> RolloutBatch:
        return self.inner.generate(prompts, params, seed=seed)

    def sync_weights(self, *, version: int | None = None) -> float:
        return self.inner.sync_weights(version=version)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def step(self, *, seed: int, timer: Timer) -> RolloutStep:
        """Rounds of generation and scoring until the step is full; this rank's DP share of the step's groups,
        their scores (already in hand) and the step's counts."""
        f, b = self.cfg.algorithm.filter_groups, self.plan.batch
        pool = GroupPool(want=b.prompts_per_step, n=b.n, refill=f.max_num_gen_batches > 0)
        rounds, errors = 0, 0
        while not pool.full and (f.max_num_gen_batches == 0 or rounds < f.max_num_gen_batches):
            round_ = self.inner.step(seed=seed + rounds * ROUND_SEED_STRIDE, timer=timer)
            with timer("reward"):
                scored = round_.scores.result()
                errors += scored.errors
                metric_B = metric_values(self.cfg, round_.batch, scored.output)
                pool.add(*gather_round(round_.batch, scored.output, metric_B))
            rounds += 1
        batch, output, refilled = pool.finish(rounds=rounds, cap=f.max_num_gen_batches)
        mine = b.dp_prompts(self.plan.dp_rank_of(dist.get_rank()))
        rows = list(range(mine.start * b.n, mine.stop * b.n))
        counts = {"dynamic_sampling/gen_rounds": rounds, "dynamic_sampling/kept_groups": pool.signal_groups,
                  "dynamic_sampling/dropped_groups": pool.no_signal_groups,
                  "dynamic_sampling/refilled_groups": refilled}
        return RolloutStep(batch=batch.index(rows),
                           scores=PendingReward.finished(Scored(output=index_output(output, rows), errors=errors)),
                           metrics={k: float(v) for k, v in counts.items()})


def metric_values(cfg: RLConfig, batch: RolloutBatch, output: RewardOutput) -> torch.Tensor:
    """``[B]`` float: each sample's ``algorithm.filter_groups.metric``."""
    metric = cfg.algorithm.filter_groups.metric
    if metric == "acc":
        return (output.correct_B if output.correct_B is not None else output.scores_B > 0).float().cpu()
    scores_B = output.scores_B.float().cpu()
    if metric == "score":
        return scores_B
    assert metric == "seq_reward", metric  # validation checks it is one of FILTER_METRICS
    return scores_B + overlong_penalty_B(cfg.reward.overlong_buffer, batch.response_mask,
                                         max_length=cfg.data.max_response_length).cpu()


def index_output(out: RewardOutput, rows: Sequence[int]) -> RewardOutput:
    idx = torch.tensor(list(rows), dtype=torch.long)
    return RewardOutput(scores_B=out.scores_B[idx], correct_B=None if out.correct_B is None else out.correct_B[idx],
                        info={k: [v[i] for i in rows] for k, v in out.info.items()})


def cat_outputs(outs: Sequence[RewardOutput]) -> RewardOutput:
    """One output for the samples of ``outs`` in order (``correct_B`` only if every non-empty part has it)."""
    sized = [o for o in outs if len(o.scores_B)]
    with_correct = all(o.correct_B is not None for o in sized)
    keys = dict.fromkeys(k for o in outs for k in o.info)
    return RewardOutput(
        scores_B=torch.cat([o.scores_B.float().cpu() for o in outs]),
        correct_B=torch.cat([o.correct_B.bool().cpu() for o in sized if o.correct_B is not None])
        if with_correct else None,
        info={k: [x for o in outs for x in o.info.get(k, [None] * len(o.scores_B))] for k in keys})


def _select(batch: RolloutBatch, output: RewardOutput, groups: torch.Tensor, n: int) -> tuple[RolloutBatch,
                                                                                               RewardOutput]:
    rows = (groups[:, None] * n + torch.arange(n)).flatten().tolist()
    return batch.index(rows), index_output(output, rows)


def gather_round(local: RolloutBatch, output: RewardOutput,
                 metric_B: torch.Tensor) -> tuple[RolloutBatch, RewardOutput, torch.Tensor]:
    """The whole round from every DP rank's share (DP rank order = prompt order), over the DP gloo group."""
    from megatron.core import parallel_state  # here: validation imports this module's rules, never Megatron

    group = parallel_state.get_data_parallel_group_gloo()
    parts: list[Any] = [None] * dist.get_world_size(group)
    output = RewardOutput(scores_B=output.scores_B.cpu(),
                          correct_B=None if output.correct_B is None else output.correct_B.cpu(), info=output.info)
    dist.all_gather_object(parts, (local.to("cpu"), output, metric_B), group=group)
    return (RolloutBatch.cat([p[0] for p in parts]), cat_outputs([p[1] for p in parts]),
            torch.cat([p[2] for p in parts]))
