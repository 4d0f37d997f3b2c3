"""The on-disk layout of RL checkpoints: step directories, the manifest, the commit protocol, retention."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from hybridrl.checkpoint.hashing import sha256_many
from hybridrl.config.schema import RLConfig

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
LATEST = "latest"
_SCRATCH = (".tmp_step_*", ".old_step_*", ".deleting_step_*")  # left by a crash; removed at the next save


def checkpoint_root(cfg: RLConfig) -> Path:
    return Path(cfg.trainer.output_dir) / "checkpoints"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The ``step_<k>`` directories under ``root`` (complete or not: see :func:`checkpoint_problem`), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


# --- completeness -------------------------------------------------------------------------------


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (None: it is): no manifest, or a file missing, of another
    size or another SHA-256 than the manifest says (every file is hashed, in parallel: :mod:`.hashing`; a manifest
    of an older hybridrl has them for files up to 8 MiB only)."""
    if not path.is_dir():
        return "no such directory"
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        entries = [(rel, int(e["bytes"]), e.get("sha256")) for rel, e in files.items()]
    except FileNotFoundError:
        return f"no {MANIFEST}: its save did not finish, or a hybridrl without manifests wrote it"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for rel, size, _ in entries:
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, {MANIFEST} says {size}"
    hashed = [(rel, sha) for rel, _, sha in entries if sha is not None]
    found = sha256_many([path / rel for rel, _ in hashed])
    for rel, sha in hashed:
        if found[path / rel] != sha:
            return f"{rel} does not match its SHA-256 in {MANIFEST}"
    return None


def _read_latest(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return name if _STEP_DIR.match(name) else None


# --- committing ---------------------------------------------------------------------------------


def remove_scratch(root: Path) -> None:
    """Delete what an interrupted save or commit left (``.tmp_step_*``, ``.old_step_*``, ``.deleting_step_*``)."""
    for pattern in _SCRATCH:
        for stale in root.glob(pattern) if root.is_dir() else []:
            shutil.rmtree(stale)


def commit(tmp: Path, final: Path, *, step: int, keep: int, digests: dict[str, str] | None = None) -> None:
    """Make the fully written ``tmp`` the checkpoint ``final`` (see :mod:`hybridrl.checkpoint.rl`), then apply
    retention. Every step leaves a state that :func:`latest_complete` resolves to a complete checkpoint.
    ``digests``: the SHA-256 of files under ``tmp`` by relative path, already computed (the others are here)."""
    root = final.parent
    _write_manifest(tmp, step=step, digests=digests or {})
    old = root / f".old_{final.name}"
    if final.exists():  # a re-saved step: the old one goes only once the new one is in place
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_latest(root, final.name)
    if old.exists():
        shutil.rmtree(old)
    _prune(root, newest=step, keep=keep)


def _write_manifest(d: Path, *, step: int, digests: dict[str, str]) -> None:
    """Record every file under ``d`` (size, SHA-256), fsyncing files and directories.

    Rank 0 fsyncs every rank's files: on one node that flushes them all; on a shared file system each
    writer's data is already on the server when it closes the file (NFS close-to-open, Lustre, GPFS)."""
    files: dict[str, dict[str, Any]] = {}
    for dirpath, _, names in os.walk(d):
        for name in sorted(names):
            path = Path(dirpath) / name
            with path.open("rb") as f:
                os.fsync(f.fileno())
                files[path.relative_to(d).as_posix()] = {"bytes": os.fstat(f.fileno()).st_size}
        _fsync_dir(Path(dirpath))
    missing = [d / rel for rel in files if rel not in digests]
    digests = digests | {p.relative_to(d).as_posix(): h for p, h in sha256_many(missing).items()}
    for rel, entry in files.items():
        entry["sha256"] = digests[rel]
    with (d / MANIFEST).open("w") as f:
        json.dump({"format": 1, "step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(d)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    with tmp.open("w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, *, newest: int, keep: int) -> None:
    """Keep ``keep`` checkpoints counting ``newest``: delete complete ones older than it beyond that; never a
    newer or an incomplete one (``keep`` 0 keeps all)."""
    if keep <= 0:
        return
    older = [p for s, p in step_dirs(root) if s < newest and checkpoint_problem(p) is None]
    for path in older[:max(len(older) - (keep - 1), 0)]:
        doomed = root / f".deleting_{path.name}"
        os.rename(path, doomed)  # never a half-deleted step_* on disk
        shutil.rmtree(doomed)
