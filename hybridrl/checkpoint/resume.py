"""Which checkpoint a run resumes (trainer.resume), and setting aside the ones that are not its history."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hybridrl.checkpoint.layout import (
    _STEP_DIR,
    LATEST,
    _fsync_dir,
    _read_latest,
    _write_latest,
    checkpoint_problem,
    checkpoint_root,
    step_dirs,
)
from hybridrl.config.errors import CheckpointError
from hybridrl.config.schema import RLConfig
from hybridrl.distributed import host_group
from hybridrl.tracking import say


def latest_complete(root: Path) -> Path | None:
    """The checkpoint ``resume=auto`` takes: the committed one (``latest``; without it the newest), or the
    next older complete one, with a warning for each skipped; None when ``root`` holds no checkpoint. Checkpoints
    none of which is usable are a :class:`CheckpointError` naming each (nothing is moved or deleted)."""
    dirs = present = step_dirs(root)
    pointer = _read_latest(root)
    skipped: list[tuple[Path, str]] = []
    if pointer is not None:
        committed = int(pointer.removeprefix("step_"))
        skipped += [(p, f"newer than {LATEST} ({pointer}): never committed") for s, p in dirs if s > committed]
        if not (root / pointer).is_dir():
            skipped.append((root / pointer, f"named by {LATEST}, and missing"))
        dirs = [(s, p) for s, p in dirs if s <= committed]
    for _, path in reversed(dirs):
        problem = checkpoint_problem(path)
        if problem is None:
            for p, why in skipped:
                say(f"warning: not resuming from {p}: {why}; falling back to {path.name}")
            return path
        skipped.append((path, problem))
    if not present:  # nothing to resume (a `latest` whose checkpoint was deleted: said, then removed at start)
        for p, why in skipped:
            say(f"warning: not resuming from {p}: {why}; starting at step 0")
        return None
    raise CheckpointError(
        f"trainer.resume=auto: no checkpoint in {root} can be resumed: "
        + "; ".join(f"{p.name}: {why}" for p, why in skipped)
        + ". Nothing was changed. To start over from step 0 set trainer.resume=never (they are then moved aside into "
          f"{root.name}/abandoned-<time>/, not deleted), or resume one by its path: trainer.resume=<its dir>")


def resolve_resume(cfg: RLConfig) -> Path | None:
    """``trainer.resume``: ``never`` → None; ``auto`` → :func:`latest_complete` (or None); else a path,
    which must be a complete checkpoint."""
    mode = cfg.trainer.resume
    if mode == "never":
        return None
    if mode == "auto":
        return latest_complete(checkpoint_root(cfg))
    path = Path(mode)
    if (problem := checkpoint_problem(path)) is not None:
        raise FileNotFoundError(f"trainer.resume={mode!r}: {path} is not a complete hybridrl checkpoint "
                                f"({problem}); valid: auto, never, or a checkpoints/step_<k> dir")
    return path


def resume_point(cfg: RLConfig) -> Path | None:
    """Collective, at start: ``trainer.resume`` resolved once (rank 0), and the checkpoints in
    ``trainer.output_dir`` that are not this run's history moved aside (:func:`set_aside_other_histories`)."""
    box: list[Any] = [None, None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            path = resolve_resume(cfg)
            set_aside_other_histories(checkpoint_root(cfg), resumed=path)
            box = [None if path is None else str(path), None]
        except (OSError, ValueError) as e:
            error, box = e, [None, (isinstance(e, CheckpointError), str(e))]
    dist.broadcast_object_list(box, src=0, group=host_group.get())
    if error is not None:
        raise error
    if box[1] is not None:
        user, message = box[1]
        raise CheckpointError(message) if user else RuntimeError(f"rank 0: {message}")
    return None if box[0] is None else Path(box[0])


def set_aside_other_histories(root: Path, *, resumed: Path | None) -> Path | None:
    """Move every ``step_*`` under ``root`` that is not ``resumed``'s history — newer than ``resumed`` when it
    lies in ``root``, else all — into ``root/abandoned-<time>/`` (returned; None if nothing moved), and point
    ``latest`` at ``resumed`` (removed when it lies elsewhere or is None)."""
    ours = resumed is not None and resumed.resolve().parent == root.resolve() and bool(_STEP_DIR.match(resumed.name))
    upto = int(resumed.name.removeprefix("step_")) if ours and resumed is not None else -1
    stray = [p for s, p in step_dirs(root) if s > upto]
    dest = None
    if stray:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = root / f"abandoned-{stamp}"
        n = 1
        while dest.exists():
            n += 1
            dest = root / f"abandoned-{stamp}-{n}"
        dest.mkdir()
        for p in stray:
            os.rename(p, dest / p.name)
        _fsync_dir(dest)
        _fsync_dir(root)
        why = (f"newer than the resumed {resumed.name}" if ours and resumed is not None
               else "not the history of this run (trainer.resume=never)" if resumed is None
               else f"not the history of this run (it resumes {resumed})")
        say(f"moved {', '.join(p.name for p in stray)} ({why}) aside to {dest}; resume=auto follows this run "
            "from now on (delete that directory when it is no longer needed)")
    if ours and resumed is not None:
        if _read_latest(root) != resumed.name:
            _write_latest(root, resumed.name)
    else:
        (root / LATEST).unlink(missing_ok=True)
    return dest
