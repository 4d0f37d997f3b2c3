"""Step metrics, reduced over data-parallel ranks (model-parallel peers hold identical batches).

Metrics are host-side numbers: they are reduced over Megatron's gloo data-parallel group, whatever the
trainer's backend (an NCCL group takes only CUDA tensors)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hybridrl.algorithms.rollout_correction import ratio_extremes
from hybridrl.batch import RolloutBatch


class DPMeans:
    """Means (and maxima, minima) whose numerators and denominators are summed over the DP group."""

    _MIN = "\0min:"  # a minimum is reduced as the maximum of its negation under this prefix

    def __init__(self) -> None:
        self._sums: dict[str, tuple[float, float]] = {}
        self._maxes: dict[str, float] = {}

    def add(self, name: str, total: float | torch.Tensor, count: float | torch.Tensor) -> None:
        s, c = self._sums.get(name, (0.0, 0.0))
        self._sums[name] = (s + float(total), c + float(count))

    def total(self, name: str, value: float | torch.Tensor) -> None:
        """A sum over DP ranks (not a mean)."""
        self.add(name, value, 1.0 / parallel_state.get_data_parallel_world_size())

    def max(self, name: str, value: float | torch.Tensor) -> None:
        self._maxes[name] = max(self._maxes.get(name, float("-inf")), float(value))

    def min(self, name: str, value: float | torch.Tensor) -> None:
        self.max(self._MIN + name, -float(value))

    def reduce(self) -> dict[str, float]:
        group = parallel_state.get_data_parallel_group_gloo()  # host-side bookkeeping: gloo on any machine
        # ranks may hold different names (e.g. a data source only in some ranks' shares): reduce the union
        names_by_rank: list[tuple[list[str], list[str]] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(names_by_rank, (sorted(self._sums), sorted(self._maxes)), group=group)
        for sums, maxes in filter(None, names_by_rank):
            for n in sums:
                self._sums.setdefault(n, (0.0, 0.0))
            for n in maxes:
                self._maxes.setdefault(n, float("-inf"))
        names = sorted(self._sums)
        sums = torch.tensor([v for n in names for v in self._sums[n]], dtype=torch.float64)
        dist.all_reduce(sums, group=group)
        out = {n: float(sums[2 * i] / sums[2 * i + 1]) if sums[2 * i + 1] else float("nan")
               for i, n in enumerate(names)}
        max_names = sorted(self._maxes)
        maxes = torch.tensor([self._maxes[n] for n in max_names], dtype=torch.float64)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        out |= {n.removeprefix(self._MIN): -float(v) if n.startswith(self._MIN) else float(v)
                for n, v in zip(max_names, maxes, strict=True)}
        return out


def rollout_metrics(batch: RolloutBatch, scores_B: torch.Tensor, entropy_BT: torch.Tensor) -> DPMeans:
    m = DPMeans()
    mask_BT = batch.loss_mask.float()  # the tokens trained on: entropy, log-prob agreement, advantages
    B, tokens = len(batch), mask_BT.sum()
    lengths_B = batch.response_mask.float().sum(-1)
    m.add("reward/mean", scores_B.sum(), B)
    m.max("reward/max", scores_B.max())  # the spread `hybridrl report` draws around the mean
    m.min("reward/min", scores_B.min())
    m.add("response/length_mean", lengths_B.sum(), B)
    m.max("response/length_max", lengths_B.max())
    m.add("response/clip_ratio", sum(s.finish_reason == "length" for s in batch.meta), B)
    m.add("prompt/length_mean", batch.prompt_mask.sum(), B)
    m.add("actor/entropy", (entropy_BT * mask_BT).sum(), tokens)
    m.add("rollout/weight_version", batch.weight_version.sum(), B)
    if batch.old_logprobs is not None:
        diff_BT = (batch.rollout_logprobs - batch.old_logprobs).abs() * mask_BT
        m.add("rollout/logprob_abs_diff", diff_BT.sum(), tokens)
        m.max("rollout/logprob_abs_diff_max", diff_BT.max())
        ratio_max, ratio_min = ratio_extremes(batch.old_logprobs, batch.rollout_logprobs, mask_BT)
        m.max("rollout_corr/ratio_max", ratio_max)  # π_old/π_rollout over tokens: the mismatch's extremes
        m.min("rollout_corr/ratio_min", ratio_min)
    if batch.advantages is not None:
        m.add("critic/advantages_mean", (batch.advantages * mask_BT).sum(), tokens)
    m.total("perf/tokens", lengths_B.sum() + batch.prompt_mask.sum())
    return m


class Timer:
    """``with timer("gen"):`` records ``timing/gen`` (wall seconds) and ``timing_cpu/gen`` (this
    process's CPU seconds; > wall when torch uses several threads)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            for key, dt in ((f"timing/{name}", time.perf_counter() - t0),
                            (f"timing_cpu/{name}", time.process_time() - c0)):
                self.times[key] = self.times.get(key, 0.0) + dt
