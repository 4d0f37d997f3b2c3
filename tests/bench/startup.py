"""Benchmark: start-up of the prompt data path — time to the first batch and peak RSS per rank.

    python tests/bench/startup.py [--prompts 200000] [--ranks 1 2] [--repeats 1] [--baseline REV]

Workload (fixed): a parquet of ``--prompts`` synthetic GSM8K-style rows in verl's layout (``prompt``,
``ground_truth``, ``data_source``, ``extra_info``), a byte-level BPE tokenizer with a ChatML template
trained here (the tiny real-task recipe's kind), ``data.max_prompt_length=72`` (about a sixth of the
prompts are longer and dropped). Each world size runs under ``torchrun`` with gloo, 1 torch thread per
rank, and every rank does what ``build_components`` does before the model: load the tokenizer, build the
``PromptDataset`` of the train file and its ``PromptLoader`` (global batch 256), and take the first batch.

Measured per rank: seconds from after ``init_process_group`` to the first batch ready (the model build and
rollout are not included: they do not depend on the dataset), the CPU seconds the rank spent meanwhile
(steadier than wall time on a shared machine), RSS after the imports, and peak RSS (``ru_maxrss``). Also
printed: the kept-prompt count and a hash of the first batch, which must be equal between two code versions
that claim the same filter and sampler order. Medians over ``--repeats``.

``--baseline REV`` also runs ``hybridrl/data/dataset.py`` as it was at git revision ``REV`` (read with
``git show`` into the work directory and imported in its place; the loader, sampler and collate are the
working tree's), interleaved with the working tree's, and prints the ratios baseline / now measured in the
same run. ``6e4e85e`` is the last revision where every rank read and tokenized every row.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

MAX_PROMPT_LENGTH = 72
BATCH = 256


def write_workload(out: Path, prompts: int) -> tuple[Path, Path]:
    """The parquet and the tokenizer directory (made once per ``out``)."""
    from hybridrl.data.rows import write_rows
    from hybridrl.data.synthetic_gsm8k import gsm8k_like_rows
    from hybridrl.models.bpe_tokenizer import train_bpe_tokenizer

    data, tok_dir = out / "train.parquet", out / "tokenizer"
    if data.exists() and tok_dir.exists():
        return data, tok_dir
    base = gsm8k_like_rows(5000, seed=0)
    tokenizer = train_bpe_tokenizer((r["question"] + "\n" + r["answer"] for r in base), vocab_size=1024,
                                    model_max_length=1024)
    tokenizer.save_pretrained(tok_dir)
    rng = random.Random(0)
    rows = []
    for i in range(prompts):
        r = base[i % len(base)]
        tail = " Show your work." * rng.choice((0, 0, 0, 1, 2))  # some prompts exceed the length limit
        rows.append({"prompt": f"{r['question']}{tail} (#{i})", "ground_truth": r["answer"].split("#### ")[-1],
                     "data_source": "gsm8k_like", "extra_info": {"index": i, "split": "train"}})
    write_rows(rows, data)
    return data, tok_dir


def worker(data: Path, tok_dir: Path, out: Path, impl: Path | None = None) -> None:
    if impl is not None:  # the baseline's dataset module, imported in place of the working tree's
        spec = importlib.util.spec_from_file_location("hybridrl.data.dataset", impl)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["hybridrl.data.dataset"] = module
        spec.loader.exec_module(module)
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
    from hybridrl.data.loader import PromptLoader
    from hybridrl.data.sampler import SamplerConfig

    torch.set_num_threads(1)
    rss_imports = _rss_mb()
    dist.init_process_group("gloo")
    dist.barrier()  # gloo connects lazily; the trainer has run collectives (init_parallel) before its dataset
    t0, cpu0 = time.perf_counter(), _cpu_s()
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    dataset = PromptDataset([data], tokenizer=tokenizer, config=PromptDatasetConfig(
        prompt_key="prompt", ground_truth_key="ground_truth", max_prompt_length=MAX_PROMPT_LENGTH))
    loader = PromptLoader(dataset, sampler=SamplerConfig(train_batch_size=BATCH, seed=1), dp_rank=0, dp_size=1)
    batch = next(iter(loader))
    seconds, cpu_seconds = time.perf_counter() - t0, _cpu_s() - cpu0
    digest = hashlib.sha256(batch.input_ids.numpy().tobytes() + batch.index.numpy().tobytes()
                            + repr([(m.ground_truth, m.data_source, dict(m.extra)) for m in batch.meta]).encode())
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "seconds": seconds, "cpu_s": cpu_seconds,
              "rss_imports_mb": rss_imports,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "kept": len(dataset),
              "first_batch": digest.hexdigest()[:16]}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(world: int, data: Path, tok_dir: Path, work: Path, port: int, impl: Path | None) -> list[dict]:
    out = Path(tempfile.mkdtemp(dir=work))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={port}",
           __file__, "--worker", str(data), str(tok_dir), str(out), *([str(impl)] if impl else [])]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=200_000)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=None, help="keep the parquet/tokenizer here between runs")
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="also run hybridrl/data/dataset.py of this git revision, interleaved, and print ratios")
    p.add_argument("--worker", nargs="+", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="hybridrl-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    data, tok_dir = write_workload(work, args.prompts)
    print(f"workload: {args.prompts} prompts in {data} ({data.stat().st_size / 2**20:.1f} MiB), "
          f"ready in {time.perf_counter() - t:.1f} s", flush=True)
    impls: dict[str, Path | None] = {"now": None}
    if args.baseline:
        base = work / f"dataset_{args.baseline}.py"
        base.write_text(subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[2]), "show",
                                        f"{args.baseline}:hybridrl/data/dataset.py"],
                                       check=True, capture_output=True, text=True).stdout)
        impls = {args.baseline: base, "now": None}
    print(f"{'code':>8} {'ranks':>5} {'first batch s (max rank)':>25} {'CPU s (max rank)':>17} "
          f"{'RSS after imports MiB':>22} {'peak RSS MiB (max rank)':>24} {'kept':>8} first-batch hash", flush=True)
    for i, world in enumerate(args.ranks):
        runs: dict[str, list[list[dict]]] = {name: [] for name in impls}
        for k in range(args.repeats):  # interleaved: both codes see the same load
            for j, (name, impl) in enumerate(impls.items()):
                runs[name].append(run(world, data, tok_dir, work, 29600 + 40 * i + 4 * k + j, impl))
        rows = {}
        for name, rs in runs.items():
            secs = statistics.median(max(r["seconds"] for r in ranks) for ranks in rs)
            cpu = statistics.median(max(r["cpu_s"] for r in ranks) for ranks in rs)
            base_rss = statistics.median(max(r["rss_imports_mb"] for r in ranks) for ranks in rs)
            peak = statistics.median(max(r["peak_rss_mb"] for r in ranks) for ranks in rs)
            hashes = sorted({r["first_batch"] for ranks in rs for r in ranks})
            kept = sorted({r["kept"] for ranks in rs for r in ranks})
            rows[name] = (secs, cpu, peak)
            print(f"{name:>8} {world:>5} {secs:>25.1f} {cpu:>17.1f} {base_rss:>22.0f} {peak:>24.0f} "
                  f"{','.join(map(str, kept)):>8} {','.join(hashes)}", flush=True)
        if len(rows) == 2:
            (s0, c0, p0), (s1, c1, p1) = rows.values()
            print(f"{'ratio':>8} {world:>5} {s0 / s1:>24.2f}x {c0 / c1:>16.2f}x {'':>22} {p0 / p1:>23.2f}x  "
                  "(baseline / now)",
                  flush=True)


if __name__ == "__main__":
    main()
