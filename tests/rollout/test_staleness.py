"""The bounded-staleness gate: AReaL's admission capacity, the per-group consumption check, and resume."""

from __future__ import annotations

import random

import pytest

from hybridrl.rollout.staleness import StalenessGate


def test_capacity_is_areals_formula() -> None:
    g = StalenessGate(max_staleness=2, groups_per_step=4, max_in_flight=5)
    assert g.capacity(0) == 5  # min(5 − 0, 3·4 − 0)
    for _ in range(5):
        assert g.try_admit(0)
    assert not g.try_admit(0) and g.capacity(0) == 0  # max_in_flight
    for _ in range(5):
        g.finished(kept=True)
    assert g.capacity(0) == 5 and (g.accepted, g.running) == (5, 0)  # min(5, 12 − 5) = 5
    for _ in range(5):
        g.try_admit(0)
    for _ in range(3):
        g.finished(kept=True)
    assert g.capacity(0) == 2  # min(5 − 2, 12 − (8 + 2))
    assert g.capacity(1) == 3  # min(5 − 2, 16 − 10)
    g.finished(kept=False)  # an aborted group that is not continued
    assert (g.running, g.dropped, g.accepted) == (1, 1, 8)


def test_staleness_zero_admits_one_step_per_version() -> None:
    g = StalenessGate(max_staleness=0, groups_per_step=3)
    for version in range(4):
        admitted = 0
        while g.try_admit(version):
            admitted += 1
        assert admitted == 3
        for _ in range(3):
            g.finished(kept=True)
            assert g.admissible(oldest_version=version, train_version=version)
        g.trained(3)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_the_bound_holds_group_by_group_under_long_tails(staleness: int) -> None:
    """A simulated producer with long-tailed, out-of-order finishes and a consumer training B groups per version:
    every trained group started at a version ≥ trained − S; the late ones are dropped by the consumption check."""
    rng = random.Random(staleness)
    B = 4
    g = StalenessGate(max_staleness=staleness, groups_per_step=B, max_in_flight=3 * B)
    version, running, buffer, trained_staleness = 0, [], [], []  # running: (finish_time, start_version)
    for tick in range(2000):
        while g.try_admit(version):
            running.append((tick + (rng.expovariate(0.05) if rng.random() < 0.1 else rng.randint(1, 6)), version))
        done = [r for r in running if r[0] <= tick]
        running = [r for r in running if r[0] > tick]
        for _, start in done:
            g.finished(kept=True)
            buffer.append(start)
        buffer = [s for s in buffer if g.admissible(oldest_version=s, train_version=version)]
        if len(buffer) >= B and tick % 3 == 0:  # the trainer takes B groups and makes a new version
            batch, buffer = buffer[:B], buffer[B:]
            trained_staleness += [version - s for s in batch]
            g.trained(B)
            version += 1
    assert version > 100
    assert max(trained_staleness) <= staleness
    assert g.accepted + g.running - g.consumed == len(buffer) + len(running)
    if staleness == 0:  # nothing is admitted past the current step: nothing is ever stale
        assert g.dropped == 0
    else:  # the admission rule alone would have trained the long tails too stale: the consumption check dropped them
        assert max(trained_staleness) == staleness and g.dropped > 0


def test_a_long_tail_group_past_the_bound_is_dropped_at_consumption() -> None:
    g = StalenessGate(max_staleness=1, groups_per_step=1)
    assert g.try_admit(0) and g.try_admit(0)  # (1 + 0 + 1)·1 = 2
    g.finished(kept=True)  # the first finishes and trains at version 0
    assert g.admissible(oldest_version=0, train_version=0)
    g.trained(1)
    assert g.try_admit(1)
    g.finished(kept=True)  # the version-1 group overtakes the still running version-0 one
    assert g.admissible(oldest_version=1, train_version=1)
    g.trained(1)
    g.finished(kept=True)  # the version-0 group, finished at version 2: staleness 2 > 1
    assert not g.admissible(oldest_version=0, train_version=2)
    assert (g.dropped, g.accepted, g.consumed) == (1, 2, 2)


def test_resume_counts_only_trained_groups() -> None:
    """AReaL#1388: a resumed run restored its admission count with buffered groups that the checkpoint did not
    hold, and admitted too few (or, counted the other way, too stale) groups after it."""
    g = StalenessGate(max_staleness=1, groups_per_step=2)
    for v in range(3):
        while g.try_admit(v):
            pass
        for _ in range(g.running):
            g.finished(kept=True)
        g.trained(2)
    assert (g.accepted, g.consumed) == (8, 6)  # two groups buffered
    resumed = StalenessGate(max_staleness=1, groups_per_step=2)
    resumed.load_state_dict(g.state_dict())
    assert (resumed.accepted, resumed.running, resumed.consumed) == (6, 0, 6)
    assert resumed.capacity(3) == StalenessGate(max_staleness=1, groups_per_step=2).capacity(0) == 4


def test_bad_settings_name_their_keys() -> None:
    with pytest.raises(ValueError, match="async_training.staleness_threshold=-1"):
        StalenessGate(max_staleness=-1, groups_per_step=2)
    with pytest.raises(ValueError, match="data.train_batch_size=0"):
        StalenessGate(max_staleness=0, groups_per_step=0)


def test_dynamic_sampling_rounds_count_as_running_until_they_end_and_only_trained_groups_are_kept() -> None:
    """The round accounting of ``hybridrl/rollout/async_dynamic.py``: a round's groups run until collected or
    discarded; a step then counts the groups it trained and the stale ones it dropped, and a resume restores
    exactly the trained count."""
    gate = StalenessGate(max_staleness=1, groups_per_step=4)
    gate.admit_round(3)
    gate.admit_round(3)
    assert gate.running == 6 and gate.capacity(0) == 2
    gate.round_ended(3)
    gate.round_ended(3)
    gate.took(4, stale=1)
    assert (gate.running, gate.accepted, gate.consumed, gate.dropped) == (0, 4, 4, 1)
    with pytest.raises(RuntimeError, match="round_ended"):
        gate.round_ended(1)
    resumed = StalenessGate(max_staleness=1, groups_per_step=4)
    resumed.load_state_dict(gate.state_dict())
    assert (resumed.accepted, resumed.consumed, resumed.dropped, resumed.running) == (4, 4, 1, 0)
