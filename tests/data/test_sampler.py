"""DistributedPromptSampler: disjoint DP shards, seeded epochs, drop_last, exact mid-epoch resume."""

from __future__ import annotations

import itertools

import pytest

from hybridrl.data.sampler import DistributedPromptSampler, SamplerConfig


def samplers(n: int, dp_size: int, **cfg: int | bool) -> list[DistributedPromptSampler]:
    config = SamplerConfig(**cfg)  # type: ignore[arg-type]
    return [DistributedPromptSampler(n, config=config, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]


def global_batches(ranks: list[DistributedPromptSampler], epochs: int) -> list[list[int]]:
    """The global batches of ``epochs`` epochs: the ranks' shards concatenated in rank order."""
    out = []
    for _ in range(epochs):
        for shards in zip(*ranks, strict=True):
            out.append([i for shard in shards for i in shard])
    return out


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_rank_shards_are_disjoint_and_make_the_global_batch(dp_size: int) -> None:
    ranks = samplers(37, dp_size, train_batch_size=8, seed=3)
    reference = global_batches(samplers(37, 1, train_batch_size=8, seed=3), 1)
    per_rank = [list(s) for s in samplers(37, dp_size, train_batch_size=8, seed=3)]
    assert len(per_rank[0]) == len(ranks[0]) == 4  # 37 // 8, drop_last
    for k, batch in enumerate(reference):
        shards = [set(p[k]) for p in per_rank]
        assert all(len(s) == 8 // dp_size for s in shards)
        assert set().union(*shards) == set(batch)
        assert sum(len(s) for s in shards) == len(set(batch)) == 8


def test_epochs_reshuffle_deterministically_by_seed_and_epoch() -> None:
    [s] = samplers(40, 1, train_batch_size=10, seed=7)
    e0, e1 = list(s), list(s)
    assert s.epoch == 2
    assert sorted(itertools.chain(*e0)) == list(range(40)) == sorted(itertools.chain(*e1))
    assert e0 != e1
    [again] = samplers(40, 1, train_batch_size=10, seed=7)
    assert list(again) == e0 and list(again) == e1
    [other] = samplers(40, 1, train_batch_size=10, seed=8)
    assert list(other) != e0


def test_no_shuffle_keeps_dataset_order() -> None:
    [s] = samplers(6, 1, train_batch_size=3, shuffle=False)
    assert list(s) == [[0, 1, 2], [3, 4, 5]]


def test_drop_last_true_skips_and_false_wraps_around() -> None:
    [dropping] = samplers(10, 1, train_batch_size=4, shuffle=False, drop_last=True)
    assert list(dropping) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    [filling] = samplers(10, 1, train_batch_size=4, shuffle=False, drop_last=False)
    assert list(filling) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    [tiny] = samplers(3, 1, train_batch_size=4, shuffle=False, drop_last=False)
    assert list(tiny) == [[0, 1, 2, 0]]
    with pytest.raises(ValueError, match="fewer than one global batch"):
        samplers(3, 1, train_batch_size=4)


@pytest.mark.parametrize("stop_after", [1, 3, 5, 6, 9])
def test_resume_mid_epoch_matches_the_uninterrupted_order(stop_after: int) -> None:
    # 5 global batches per epoch; stop points include an epoch boundary (5) and the next epoch
    cfg = dict(train_batch_size=8, seed=11)
    uninterrupted = global_batches(samplers(43, 2, **cfg), epochs=3)[:12]

    first = samplers(43, 2, **cfg)
    seen: list[list[int]] = []
    streams = [iter(s) for s in first]
    while len(seen) < stop_after:
        try:
            seen.append([i for it in streams for i in next(it)])
        except StopIteration:  # the epoch ended: start the next one, as a training loop does
            streams = [iter(s) for s in first]
    state = first[0].state_dict()
    assert state == first[1].state_dict()

    resumed = samplers(43, 4, **cfg)  # a different DP size resumes the same global order
    for s in resumed:
        s.load_state_dict(state)
    while len(seen) < 12:
        seen.extend(global_batches(resumed, epochs=1))
    assert seen[:12] == uninterrupted


def test_load_rejects_a_state_from_other_data() -> None:
    [s] = samplers(20, 1, train_batch_size=4, seed=1)
    [other] = samplers(20, 1, train_batch_size=4, seed=2)
    with pytest.raises(ValueError, match="saved seed=1, now 2"):
        other.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="divisible by the data-parallel size 3"):
        samplers(20, 3, train_batch_size=4)
