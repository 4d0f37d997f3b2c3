"""Validation metrics: the unbiased pass@k estimator, mean@n / pass@k per data source, reduced over DP."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.trainers.eval_metrics import add_sampled_accuracy, pass_at_k, reported_ks


def brute_force_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The share of k-subsets of the samples that contain a correct one (the estimator's definition)."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_the_subset_count(n: int) -> None:
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)
    assert pass_at_k(n, 1, 1) == pytest.approx(1 / n)  # pass@1 is the per-sample accuracy


def test_pass_at_k_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match="0 ≤ c ≤ n and 1 ≤ k ≤ n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="got n=4, c=1, k=8"):
        pass_at_k(4, 1, 8)


def test_reported_ks() -> None:
    assert reported_ks(1) == [1] and reported_ks(4) == [1, 2, 4] and reported_ks(6) == [1, 2, 4, 6]


def sampled_batch(outcomes: dict[int, tuple[str, list[bool]]]) -> tuple[RolloutBatch, torch.Tensor]:
    """A batch of n samples per prompt; ``outcomes``: prompt → (data source, which samples are correct)."""
    rows = [(g, source, ok) for g, (source, oks) in outcomes.items() for ok in oks]
    b = len(rows)
    batch = RolloutBatch(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                         response_ids=torch.ones(b, 3, dtype=torch.long),
                         response_mask=torch.ones(b, 3, dtype=torch.long), rollout_logprobs=torch.zeros(b, 3),
                         weight_version=torch.zeros(b, dtype=torch.long),
                         group_index=torch.tensor([g for g, _, _ in rows]),
                         meta=[SampleMeta(data_source=s) for _, s, _ in rows], pad_token_id=0)
    return batch, torch.tensor([ok for _, _, ok in rows])


class Sums:
    """DPMeans' add() without the reduction: numerators and denominators."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}

    def add(self, name: str, total: float, count: float) -> None:
        s = self.sums.setdefault(name, [0.0, 0.0])
        s[0] += float(total)
        s[1] += float(count)

    def means(self) -> dict[str, float]:
        return {k: s / c for k, (s, c) in self.sums.items()}


def test_per_source_mean_and_pass_at_k() -> None:
    batch, correct = sampled_batch({0: ("gsm8k", [True, False, False, False]), 1: ("gsm8k", [False] * 4),
                                    2: ("math", [True, True, False, True])})
    m = Sums()
    add_sampled_accuracy(m, batch, correct, n=4)  # type: ignore[arg-type]
    got = m.means()
    assert got["eval/gsm8k/mean@4"] == pytest.approx((0.25 + 0.0) / 2)
    assert got["eval/gsm8k/pass@2"] == pytest.approx((0.5 + 0.0) / 2)  # 1 - C(3,2)/C(4,2) = 0.5
    assert got["eval/gsm8k/pass@4"] == pytest.approx(0.5)
    assert got["eval/math/mean@4"] == pytest.approx(0.75) and got["eval/math/pass@2"] == pytest.approx(1.0)
    assert sorted(got) == sorted(f"eval/{s}/{m}" for s in ("gsm8k", "math")
                                 for m in ("mean@4", "pass@1", "pass@2", "pass@4"))


def test_n_1_reports_the_accuracy_only_and_a_short_group_is_an_error() -> None:
    batch, correct = sampled_batch({0: ("", [True]), 1: ("", [False])})
    m = Sums()
    add_sampled_accuracy(m, batch, correct, n=1)  # type: ignore[arg-type]
    assert m.means() == {"eval/all/mean@1": 0.5}
    batch, correct = sampled_batch({0: ("gsm8k", [True, False])})
    with pytest.raises(ValueError, match="validation prompt 0 has 2 samples, expected val_kwargs.n=4"):
        add_sampled_accuracy(Sums(), batch, correct, n=4)  # type: ignore[arg-type]


DP_WORKER = """
import json, sys, torch.distributed as dist
from hybridrl.megatron.parallel import ParallelConfig, destroy_parallel, init_parallel
from hybridrl.metrics import DPMeans
init_parallel(ParallelConfig())
m = DPMeans()
rank = dist.get_rank()
m.add("eval/gsm8k/mean@4", 0.5, 1)
m.add("eval/math/mean@4" if rank else "eval/aime/mean@4", 1.0 * rank, 1)  # a source only one rank holds
m.max("eval/length_max", 3.0 + rank)
if rank == 0:
    m.max("eval/only_rank0_max", 7.0)
m.min("eval/ratio_min", 0.5 + rank)
out = m.reduce()
if rank == 0:
    print("RESULT " + json.dumps(out))
destroy_parallel()  # else gloo's threads may still run at exit: "terminate called without an active exception"
"""


@pytest.mark.distributed
def test_dp_reduction_takes_the_union_of_names(torchrun: Any, tmp_path: Path) -> None:
    """Before: DPMeans reduced each rank's own sorted names, so a data source held by one DP rank only made
    the all-reduce mix up (or mismatch) the ranks' vectors."""
    script = tmp_path / "worker.py"
    script.write_text(DP_WORKER)
    proc = torchrun([str(script)], nproc=2)
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out == {"eval/aime/mean@4": 0.0, "eval/gsm8k/mean@4": 0.5, "eval/math/mean@4": 1.0,
                   "eval/length_max": 4.0, "eval/only_rank0_max": 7.0, "eval/ratio_min": 0.5}
