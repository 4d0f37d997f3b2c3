"""``hybridrl/checkpoint/hashing.py``: every file's SHA-256, on threads, shared out over ranks by size."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from hybridrl.checkpoint.hashing import files_under, sha256_many, share


def test_threads_give_each_files_own_sha256(tmp_path: Path) -> None:
    paths = []
    for i, size in enumerate([0, 1, 9 << 20, 3 << 20]):
        (tmp_path / "d").mkdir(exist_ok=True)
        paths.append(tmp_path / "d" / f"f{i}")
        paths[-1].write_bytes(os.urandom(size))
    assert files_under(tmp_path) == sorted(paths)
    expected = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    assert sha256_many(paths, threads=3) == expected == sha256_many(paths, threads=1)


def test_files_are_shared_largest_first_to_the_least_loaded_rank() -> None:
    assert share([5, 1, 9, 4, 4], 2) == [1, 1, 0, 1, 0]  # 9 → r0, 5 → r1, 4 → r1, 4 → r0 (a tie: the first), 1 → r1
    assert share([3, 3], 4) == [0, 1] and share([], 3) == []
