"""Metrics to console / jsonl / wandb / tensorboard, and a progress line with rate and ETA.

Only rank 0 logs. ``metrics.jsonl`` gets one JSON object per step with ``step``; on resume, lines of
steps after the resume point are dropped first, so the file always describes one consistent run; a
fresh run moves an earlier run's file aside (``metrics.<time>.jsonl``) instead of emptying it.
wandb honours ``WANDB_MODE``; with neither ``WANDB_MODE`` nor an API key it runs offline (files under
``<output_dir>/wandb``) rather than failing on a machine without network.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from hybridrl.config.schema import TrainerConfig
from hybridrl.config.sft_schema import SFTTrainerConfig


class _Backend(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class JsonlBackend:
    """``metrics.jsonl``: one JSON object per line. A fresh run (``resume_step`` 0) moves an existing file
    aside to ``metrics.<time>.jsonl``; a resumed one keeps the lines up to ``resume_step``, dropping a torn
    last line (a crash mid-write) with a warning. Any other unreadable line is an error naming it."""

    def __init__(self, path: Path, *, resume_step: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step == 0 and path.exists() and path.stat().st_size:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
            old = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
            n = 1
            while old.exists():
                n += 1
                old = path.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}")
            os.replace(path, old)
            say(f"{path} is from an earlier run: moved to {old}")
        elif path.exists():  # keep the lines up to the resume point only
            kept = [line for line, row in _read_rows(path) if row.get("step", 0) <= resume_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
        self._f = path.open("a")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._f.write(json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, object)`` for each non-blank line; a torn last line is dropped with a warning."""
    lines = path.read_bytes().split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows: list[tuple[str, dict[str, Any]]] = []
    for i, raw in enumerate(lines[:last + 1]):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON object expected, got {type(row).__name__}")
        except (UnicodeDecodeError, ValueError) as e:
            if i == last:  # the write a crash interrupted
                say(f"warning: {path}:{i + 1}: dropping the torn last line ({type(e).__name__}: {e})")
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON object per line ({type(e).__name__}: {e}); "
                             "fix or move the file to resume") from None
        rows.append((line, row))
    return rows


class WandbBackend:
    def __init__(self, cfg: TrainerConfig | SFTTrainerConfig, config: Mapping[str, Any]) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or (None if os.environ.get("WANDB_API_KEY") else "offline")
        if mode == "offline" and "WANDB_MODE" not in os.environ:
            print("[hybridrl] wandb: no WANDB_API_KEY and no WANDB_MODE; logging offline "
                  f"under {cfg.output_dir}/wandb (sync later with `wandb sync`)", flush=True)
        self._run = wandb.init(project=cfg.project_name, name=cfg.experiment_name, config=dict(config),
                               dir=cfg.output_dir, mode=mode)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class TensorboardBackend:
    def __init__(self, out_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self._w = SummaryWriter(str(out_dir / "tensorboard"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._w.add_scalar(k, v, step)

    def close(self) -> None:
        self._w.close()


CONSOLE_KEYS = ("sft/loss", "sft/grad_norm", "reward/mean", "eval/accuracy", "actor/pg_loss", "actor/ppo_kl",
                "actor/kl_ref", "rollout/logprob_abs_diff", "response/length_mean", "timing/step")


class ConsoleBackend:
    """A line with progress, rate, ETA and the headline metrics: at most ~50 lines a run, at least
    one every 30 s, and always for evaluations and the last step."""

    def __init__(self, total_steps: int, start_step: int) -> None:
        self.progress = Progress(total_steps, start=start_step, label="step")
        self.total = total_steps
        self.every = max(total_steps // 50, 1)
        self.last_print = time.perf_counter()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now = time.perf_counter()
        due = step % self.every == 0 or step >= self.total or step <= 1 or now - self.last_print > 30
        if not due and not any(k.startswith("eval/") for k in metrics):
            return
        self.last_print = now
        shown = " ".join(f"{k}={_fmt(metrics[k])}" for k in CONSOLE_KEYS if k in metrics)
        print(f"{self.progress.update(step)} | {shown}", flush=True)

    def close(self) -> None:
        pass


class Progress:
    """``label 12/100 (12%) 3.1 s/step, ETA 4m33s`` — rate from the steps done in this process."""

    def __init__(self, total: int, *, start: int = 0, label: str = "") -> None:
        self.total, self.start, self.label = total, start, label
        self.t0 = time.perf_counter()

    def update(self, done: int) -> str:
        elapsed = time.perf_counter() - self.t0
        n = max(done - self.start, 0)
        rate = elapsed / n if n else math.nan
        eta = rate * (self.total - done) if n else math.nan
        pct = 100 * done / max(self.total, 1)
        return (f"{self.label} {done}/{self.total} ({pct:.0f}%) {rate:.2f} s/{self.label or 'it'}, "
                f"ETA {_duration(eta)}")


LOGGERS = ("console", "jsonl", "wandb", "tensorboard")  # trainer.loggers


class Tracker:
    def __init__(self, cfg: TrainerConfig | SFTTrainerConfig, *, config: Mapping[str, Any], rank: int,
                 resume_step: int = 0) -> None:
        self.backends: list[_Backend] = []
        if rank != 0:
            return
        out = Path(cfg.output_dir)
        for name in cfg.loggers:
            if name == "console":
                self.backends.append(ConsoleBackend(cfg.total_training_steps, resume_step))
            elif name == "jsonl":
                self.backends.append(JsonlBackend(out / "metrics.jsonl", resume_step=resume_step))
            elif name == "wandb":
                self.backends.append(WandbBackend(cfg, config))
            elif name == "tensorboard":
                self.backends.append(TensorboardBackend(out))
            else:
                raise ValueError(f"trainer.loggers: unknown logger {name!r}; valid: {', '.join(LOGGERS)}")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for b in self.backends:
            b.log(metrics, step)

    def close(self) -> None:
        for b in self.backends:
            b.close()


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _duration(seconds: float) -> str:
    if math.isnan(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def say(msg: str) -> None:
    """A status line from rank 0 (what hybridrl is doing right now)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[hybridrl] {msg}", file=sys.stdout, flush=True)
