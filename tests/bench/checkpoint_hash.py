"""Benchmark: hashing every checkpoint file (SHA-256, :mod:`hybridrl.checkpoint.hashing`) against writing it.

    python tests/bench/checkpoint_hash.py [--files 4] [--mib 512] [--repeats 3] [--threads N]

Workload: ``--files`` shard files of ``--mib`` MiB of random bytes (a rank's Megatron shards), in a temp dir on the
file system of ``$TMPDIR``. Baseline: writing them and fsyncing each (what a save does). Measured, medians over
``--repeats``: the write; the hash of the just-written files (in the page cache, as at save time) on 1 thread and on
``--threads`` (default: hashing.THREADS); GB/s of each and the ratio hash / write. The last line scales the
measured rates to a 7B GRPO checkpoint (bf16 weights + fp32 master weights + two fp32 Adam moments: 14 bytes a
parameter, ~98 GB) shared over 8 ranks of one node, each hashing its ~12 GB with the threads measured here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from hybridrl.checkpoint.hashing import THREADS, sha256_many


def _write(paths: list[Path], data: bytes) -> float:
    t = time.perf_counter()
    for p in paths:
        with p.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t


def _hash(paths: list[Path], threads: int) -> float:
    t = time.perf_counter()
    sha256_many(paths, threads=threads)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=THREADS)
    a = ap.parse_args()
    data = os.urandom(a.mib << 20)
    gb = a.files * len(data) / 1e9
    times: dict[str, list[float]] = {"write+fsync": [], "sha256 1 thread": [], f"sha256 {a.threads} threads": []}
    with tempfile.TemporaryDirectory() as d:
        paths = [Path(d) / f"__{i}_0.distcp" for i in range(a.files)]
        for r in range(a.repeats):
            times["write+fsync"].append(_write(paths, data))
            times["sha256 1 thread"].append(_hash(paths, 1))
            times[f"sha256 {a.threads} threads"].append(_hash(paths, a.threads))
            print(f"repeat {r + 1}/{a.repeats} done", flush=True)
    base = statistics.median(times["write+fsync"])
    print(f"{a.files} files × {a.mib} MiB = {gb:.2f} GB, medians of {a.repeats}:")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:<20} {m:7.2f} s  {gb / m:6.2f} GB/s  ratio to write+fsync {m / base:.3f}")
    per_rank_gb = 7e9 * 14 / 1e9 / 8
    t_hash = per_rank_gb / (gb / statistics.median(times[f"sha256 {a.threads} threads"]))
    t_write = per_rank_gb / (gb / base)
    print(f"7B checkpoint (~98 GB) over 8 ranks, {per_rank_gb:.1f} GB each: hash ~{t_hash:.1f} s on {a.threads} "
          f"threads per rank vs write ~{t_write:.1f} s at this disk's rate (+{100 * t_hash / t_write:.0f}%)")


if __name__ == "__main__":
    main()
