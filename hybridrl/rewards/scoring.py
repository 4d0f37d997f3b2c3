"""One scoring pass of a reward manager over some samples of a batch, as data: what came back per part.

A pass covers a list of batch positions. In ``batch`` mode the manager is called once on all of them; in
``each`` mode once per sample (to isolate failing samples). Every call yields a :class:`Part`: the positions
it covers and either the manager's output or a :class:`Failure`. The same functions run in the trainer's
reward thread and in a reward worker process (``pool.py``), so both report failures alike.

A manager names the failing sample of a batch call by setting ``sample_index`` (its position in the batch it
was given) on the exception it raises; the ``function`` reward does.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import RewardManager, RewardOutput


class RewardError(RuntimeError):
    """The reward could not score a batch: it raised (reward.on_error=raise), could not be built in a worker, or
    its worker died."""


class RewardTimeoutError(RewardError, TimeoutError):
    """Scoring (or starting the reward workers) took longer than ``reward.timeout_s``."""


# raised: the manager raised; timeout: still running at the deadline; crashed: its worker process died;
# not_reached: queued behind a timed-out or crashed sample of the same worker
FailureKind = Literal["raised", "timeout", "crashed", "not_reached"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    kind: FailureKind
    summary: str  # one line, e.g. "ValueError: boom"
    traceback: str = ""  # the original traceback's text (raised only)
    sample: int | None = None  # the failing sample's position in the batch, where known


@dataclass(slots=True, kw_only=True)
class Part:
    indices: list[int]  # the batch positions this call covered, in order
    output: RewardOutput | None = None
    failure: Failure | None = None


def score_part(manager: RewardManager, batch: RolloutBatch, indices: list[int]) -> Part:
    """One call of ``manager`` on ``batch`` (which holds exactly the samples at ``indices``)."""
    try:
        return Part(indices=indices, output=manager(batch))
    except Exception as e:  # reported to the runner, which applies reward.on_error
        local = getattr(e, "sample_index", None)
        sample = indices[local] if isinstance(local, int) and 0 <= local < len(indices) else None
        return Part(indices=indices, failure=Failure(kind="raised", summary=f"{type(e).__name__}: {e}",
                                                     traceback=traceback.format_exc(), sample=sample))


def score_each(manager: RewardManager, batch: RolloutBatch, indices: list[int]) -> Iterator[Part]:
    """One call per sample, in order (``batch`` holds exactly the samples at ``indices``)."""
    for k, i in enumerate(indices):
        part = score_part(manager, batch.index([k]), [i])
        if part.failure is not None and part.failure.sample is None:
            part.failure = dataclasses.replace(part.failure, sample=i)
        yield part


def unfinished(indices: Sequence[int], *, each: bool, kind: FailureKind, summary: str) -> list[Part]:
    """The parts of a task that did not come back: in ``each`` mode the first sample was the one in flight
    (``kind``), the rest were not reached; in ``batch`` mode the whole call failed."""
    if not indices:
        return []
    if not each:
        return [Part(indices=list(indices), failure=Failure(kind=kind, summary=summary))]
    first = Part(indices=[indices[0]], failure=Failure(kind=kind, summary=summary, sample=indices[0]))
    if len(indices) == 1:
        return [first]
    why = f"not scored: its worker stopped at sample {indices[0]} ({kind})"
    return [first, Part(indices=list(indices[1:]), failure=Failure(kind="not_reached", summary=why))]
