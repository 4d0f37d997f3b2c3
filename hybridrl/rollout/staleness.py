"""Bounded staleness for asynchronous rollouts: which prompt groups may start, which finished samples may train.

A sample trained at weight version ``v`` must have been started at a version ``≥ v − S``
(``async_training.staleness_threshold`` = S). The bound is enforced twice, as the peers' failures show it must be
(``../shared/reference/agentic-async.md`` §2.1):

- **at admission** (AReaL's capacity rule, ``areal/infra/staleness_manager.py``): with ``B`` groups trained per
  step, ``accepted`` groups finished and kept and ``running`` groups in flight, a new group may start at version
  ``v`` while ``accepted + running < (S + v + 1)·B`` (and ``running < max_in_flight``). S = 0 admits exactly one
  step's groups per version: the synchronous schedule.
- **at consumption**, per group: the admission rule is an aggregate and not strict — a long-tailed sample admitted
  early can still be running when the trainer has moved past its version + S (SkyRL says so in its docs). Such a
  group is dropped (counted in ``dropped``), never trained.

Version of a group: the *oldest* weight version that sampled any of its tokens (a partial rollout continued on
newer weights keeps its first version), so staleness = trained version − oldest token version.

Resume (AReaL#1388: staleness grew past its bound after a resume because the admission count was restored
with samples that the checkpoint did not hold): in-flight and buffered groups are not checkpointed, so a resumed
gate counts only what was trained: ``accepted := consumed``, ``running := 0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True, slots=True)
class StalenessGate:
    max_staleness: int  # S (async_training.staleness_threshold)
    groups_per_step: int  # B (data.train_batch_size: prompts, each a group of rollout.n samples)
    max_in_flight: int | None = None  # groups generating at once (None: bounded by the staleness rule alone)
    accepted: int = 0  # groups finished and kept (buffered or trained)
    running: int = 0  # groups admitted, not finished
    consumed: int = 0  # groups trained
    dropped: int = 0  # groups that finished too stale to train (consumption check) or were discarded

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"async_training.staleness_threshold={self.max_staleness}: must be >= 0")
        if self.groups_per_step < 1:
            raise ValueError(f"data.train_batch_size={self.groups_per_step}: must be >= 1")

    def capacity(self, version: int) -> int:
        """How many more groups may start now, at trainer weight version ``version``."""
        room = (self.max_staleness + version + 1) * self.groups_per_step - (self.accepted + self.running)
        if self.max_in_flight is not None:
            room = min(room, self.max_in_flight - self.running)
        return max(room, 0)

    def try_admit(self, version: int) -> bool:
        """Start one group at ``version`` if the bound allows it."""
        if self.capacity(version) < 1:
            return False
        self.running += 1
        return True

    def finished(self, *, kept: bool) -> None:
        """A running group ended: ``kept`` (to the buffer) or discarded (an aborted group not continued)."""
        if self.running < 1:
            raise RuntimeError("StalenessGate.finished without a running group")
        self.running -= 1
        if kept:
            self.accepted += 1
        else:
            self.dropped += 1

    def staleness(self, *, oldest_version: int, train_version: int) -> int:
        return train_version - oldest_version

    def admissible(self, *, oldest_version: int, train_version: int) -> bool:
        """The consumption check of one buffered group; a stale one is dropped (it leaves ``accepted``, which
        frees its place for a fresh group)."""
        if self.staleness(oldest_version=oldest_version, train_version=train_version) <= self.max_staleness:
            return True
        self.accepted -= 1
        self.dropped += 1
        return False

    def discard(self, groups: int) -> None:
        """``groups`` kept groups leave without training (the fresh groups of a batch dropped whole)."""
        self.accepted -= groups
        self.dropped += groups

    def trained(self, groups: int) -> None:
        """``groups`` kept groups went into a trainer step."""
        self.consumed += groups

    # ---- rounds of dynamic sampling (:mod:`hybridrl.rollout.async_dynamic`) ----
    def admit_round(self, groups: int) -> None:
        """A round of ``groups`` groups starts (the caller decides when: a step short of groups queues one
        whatever the count says, since it trains on the weights it is generated on)."""
        self.running += groups

    def round_ended(self, groups: int) -> None:
        """A round's ``groups`` groups ended (collected, or discarded unseen); those the step trains are then
        counted by :meth:`took`."""
        if self.running < groups:
            raise RuntimeError(f"StalenessGate.round_ended({groups}) with {self.running} groups running")
        self.running -= groups

    def took(self, groups: int, *, stale: int) -> None:
        """A step trained ``groups`` groups of its rounds; ``stale`` of its rounds' groups failed the consumption
        check (dropped)."""
        self.accepted += groups
        self.consumed += groups
        self.dropped += stale

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "dropped": self.dropped, "max_staleness": self.max_staleness,
                "groups_per_step": self.groups_per_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: only trained groups count (in-flight and buffered ones were not saved); see the module doc."""
        self.consumed = self.accepted = int(state["consumed"])
        self.dropped = int(state["dropped"])
        self.running = 0
