"""Metrics to console / jsonl / wandb / tensorboard, and a progress line with rate and ETA.

Only rank 0 logs. ``metrics.jsonl`` gets one JSON object per step with ``step``; on resume, lines of
steps after the resume point are dropped first, so the file always describes one consistent run; a
fresh run moves an earlier run's file aside (``metrics.<time>.jsonl``) instead of emptying it.
wandb honours ``WANDB_MODE``; with neither ``WANDB_MODE`` nor an API key it runs offline (files under
``<output_dir>/wandb``) rather than failing on a machine without network. mlflow logs to
``MLFLOW_TRACKING_URI`` (a server, or any store mlflow knows), else to ``sqlite:///<output_dir>/mlflow.db``.
wandb, tensorboard and mlflow are optional: each is imported only when chosen, and :data:`LOGGER_PACKAGES`
says which module each needs and the extra that installs it (static validation checks it before any model
is built).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol


class TrackerSettings(Protocol):
    """What a tracker reads of a job's ``trainer`` config (RL, SFT and DPO trainers all have these keys)."""

    output_dir: str
    logger: list[str]  # LOGGERS entries
    project_name: str
    experiment_name: str
    total_training_steps: int | None  # resolved (from trainer.total_epochs where null) by validate()


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
            rows, torn = read_metrics_rows(path)
            if torn:
                say(f"warning: {torn}")
            kept = [line for line, row in rows if row.get("step", 0) <= resume_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
        self._f = path.open("a")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._f.write(json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics_rows(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """``(line, object)`` for each non-blank line of a ``metrics.jsonl``, and what was wrong with a torn last
    line (a crash, or a run still writing it), which is left out; None when there is none. Any other
    unreadable line is an error naming the file and line."""
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
            if i == last:  # the write a crash interrupted, or one still under way
                return rows, f"{path}:{i + 1}: dropping the torn last line ({type(e).__name__}: {e})"
            raise ValueError(f"{path}:{i + 1}: not a JSON object per line ({type(e).__name__}: {e}); "
                             "fix the line or move the file aside") from None
        rows.append((line, row))
    return rows, None


class WandbBackend:
    def __init__(self, cfg: TrackerSettings, config: Mapping[str, Any]) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or (None if os.environ.get("WANDB_API_KEY") else "offline")
        if mode == "offline" and "WANDB_MODE" not in os.environ:
            print("[hybridrl] wandb: no WANDB_API_KEY and no WANDB_MODE; logging offline "
                  f"under {cfg.output_dir}/wandb (sync later with `wandb sync`)", flush=True)
        self._run = wandb.init(project=cfg.project_name, name=cfg.experiment_name, config=dict(config),
                               dir=cfg.output_dir, mode=mode)  # type: ignore[arg-type]  # WANDB_MODE: wandb checks it

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowBackend:
    """A run named ``trainer.experiment_name`` in the experiment ``trainer.project_name`` (created if missing),
    with the flattened config as its params and each step's metrics. mlflow refuses some characters in names:
    ``@`` becomes ``_at_`` (``eval/<source>/pass_at_4``, as verl does), any other one ``_``."""

    def __init__(self, cfg: TrackerSettings, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(cfg.output_dir).resolve() / 'mlflow.db'}"
        if "MLFLOW_TRACKING_URI" not in os.environ:
            print(f"[hybridrl] mlflow: no MLFLOW_TRACKING_URI; logging to {uri} "
                  f"(view with `mlflow ui --backend-store-uri {uri}`)", flush=True)
        self._client = MlflowClient(tracking_uri=uri)
        exp = self._client.get_experiment_by_name(cfg.project_name)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(cfg.project_name)
        self._run_id = self._client.create_run(exp_id, run_name=cfg.experiment_name).info.run_id
        params = [Param(mlflow_name(k), str(v)[:6000]) for k, v in config.items()]  # mlflow caps a param value's length
        for i in range(0, len(params), 100):  # and a batch at 100 params
            self._client.log_batch(self._run_id, params=params[i:i + 100])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # mlflow's limit of metrics per batch
            self._client.log_batch(self._run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def mlflow_name(key: str) -> str:
    return re.sub(r"[^\w\-. :/]", "_", key.replace("@", "_at_"))


class TensorboardBackend:
    def __init__(self, out_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self._w = SummaryWriter(str(out_dir / "tensorboard"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._w.add_scalar(k, v, step)

    def close(self) -> None:
        self._w.close()


CONSOLE_KEYS = ("sft/loss", "sft/grad_norm", "dpo/loss", "rewards/accuracy", "val/rewards/accuracy", "reward/mean",
                "eval/accuracy", "actor/pg_loss", "actor/ppo_kl", "actor/kl_ref", "rollout/logprob_abs_diff",
                "response/length_mean", "timing/step")


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


LOGGERS: tuple[str, ...] = ("console", "jsonl", "wandb", "tensorboard", "mlflow")  # trainer.logger
# the optional loggers: the modules each imports; `pip install 'hybridrl[<logger>]'` installs them
LOGGER_MODULES: dict[str, tuple[str, ...]] = {"wandb": ("wandb",), "tensorboard": ("tensorboard",),
                                              "mlflow": ("mlflow",)}
MLFLOW_LOCAL_STORE = ("sqlalchemy", "alembic")  # mlflow's sqlite store (the default without MLFLOW_TRACKING_URI)


def missing_logger_packages(loggers: list[str]) -> dict[str, str]:
    """``{logger: what is missing and the pip command}`` for each chosen logger whose packages are not installed
    (found without importing them)."""
    import importlib.util

    missing = {}
    for name in loggers:
        modules = LOGGER_MODULES.get(name, ())
        if name == "mlflow" and os.environ.get("MLFLOW_TRACKING_URI", "sqlite:").startswith("sqlite:"):
            modules += MLFLOW_LOCAL_STORE
        if absent := [m for m in modules if importlib.util.find_spec(m) is None]:
            missing[name] = f"{', '.join(absent)} not installed: pip install 'hybridrl[{name}]'"
    return missing


class Tracker:
    def __init__(self, cfg: TrackerSettings, *, config: Mapping[str, Any], rank: int,
                 resume_step: int = 0) -> None:
        self.backends: list[_Backend] = []
        if rank != 0:
            return
        out = Path(cfg.output_dir)
        for name in cfg.logger:
            if name == "console":
                if cfg.total_training_steps is None:  # validate() resolves it from trainer.total_epochs
                    raise ValueError("trainer.total_training_steps is not resolved: validate the config first")
                self.backends.append(ConsoleBackend(cfg.total_training_steps, resume_step))
            elif name == "jsonl":
                self.backends.append(JsonlBackend(out / "metrics.jsonl", resume_step=resume_step))
            elif name == "wandb":
                self.backends.append(WandbBackend(cfg, config))
            elif name == "tensorboard":
                self.backends.append(TensorboardBackend(out))
            elif name == "mlflow":
                self.backends.append(MlflowBackend(cfg, config))
            else:
                raise ValueError(f"trainer.logger: unknown logger {name!r}; valid: {', '.join(LOGGERS)}")

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
