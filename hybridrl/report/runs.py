"""A run's metrics as the report reads them: the rows of its ``metrics.jsonl`` (what ``trainer.logger``'
``jsonl`` writes, one object per logged step), tolerant of a run that is still writing its last line.

``RUN`` is a run's ``trainer.output_dir`` (its current ``metrics.jsonl``) or one metrics file — e.g. an
earlier run's ``metrics.<time>.jsonl``, which a fresh run in the same directory moved aside.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridrl.tracking import read_metrics_rows


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    name: str
    path: Path  # the metrics file read
    rows: list[dict[str, float]]
    mtime: float  # when the file was last written (a running run's is recent)
    notes: list[str] = field(default_factory=list)

    @property
    def keys(self) -> set[str]:
        return {k for row in self.rows for k in row if k != "step"}

    @property
    def last_step(self) -> int | None:
        return max((int(r["step"]) for r in self.rows), default=None)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of the rows holding ``key`` as a finite number, in step order."""
        points = sorted((int(r["step"]), float(r[key])) for r in self.rows
                        if isinstance(r.get(key), int | float) and math.isfinite(r[key]))
        return [s for s, _ in points], [v for _, v in points]


def metrics_file(run: Path) -> Path:
    """The metrics file of ``run`` (a run directory or a metrics file), with an error naming what exists."""
    if run.is_file():
        return run
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: no such run directory or metrics file")
    path = run / "metrics.jsonl"
    if not path.is_file():
        older = sorted(p.name for p in run.glob("metrics.*.jsonl"))
        hint = (f"; earlier runs' files here: {', '.join(older)} (pass one as RUN)" if older
                else "; the run logs it when trainer.logger includes jsonl")
        raise FileNotFoundError(f"{run}: no metrics.jsonl{hint}")
    return path


def load_run(run: Path, name: str | None = None) -> Run:
    path = metrics_file(run)
    lines, torn = read_metrics_rows(path)
    rows = [row for _, row in lines if isinstance(row.get("step"), int | float)]
    notes = []
    if torn:
        notes.append(f"left out a partial last line (a run still writing, or one that crashed): {torn}")
    if len(rows) < len(lines):
        notes.append(f"left out {len(lines) - len(rows)} line(s) without a numeric 'step'")
    if path.name == "metrics.jsonl":
        older = sorted(p.name for p in path.parent.glob("metrics.*.jsonl"))
        if older:
            notes.append(f"earlier runs in the same directory (pass a file as RUN to plot one): {', '.join(older)}")
    default = path.parent.name if path.name == "metrics.jsonl" else f"{path.parent.name}/{path.stem}"
    return Run(name=name or default, path=path, rows=rows, mtime=path.stat().st_mtime, notes=notes)


def load_runs(paths: list[Path], names: list[str] | None = None) -> list[Run]:
    """The runs, named by ``names`` (one per path) or by their directories; clashing names get a suffix."""
    if names and len(names) != len(paths):
        raise ValueError(f"--name given {len(names)} time(s) for {len(paths)} run(s): give one per run or none")
    runs = [load_run(p, names[i] if names else None) for i, p in enumerate(paths)]
    seen: dict[str, int] = {}
    out = []
    for r in runs:
        seen[r.name] = seen.get(r.name, 0) + 1
        out.append(r if seen[r.name] == 1 else Run(name=f"{r.name} ({seen[r.name]})", path=r.path, rows=r.rows,
                                                     mtime=r.mtime, notes=r.notes))
    return out


def age(run: Run, now: float | None = None) -> str:
    """How long ago the run last wrote its metrics, e.g. ``12 s``, ``3 min``, ``5 h``."""
    dt = max((now if now is not None else time.time()) - run.mtime, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if dt >= size:
            return f"{dt / size:.0f} {unit}"
    return f"{dt:.0f} s"
