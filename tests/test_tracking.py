"""Metrics sinks: jsonl (with resume), console progress, wandb offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl.config.schema import TrainerConfig
from hybridrl.tracking import Progress, Tracker


def test_jsonl_one_object_per_step_and_resume_drops_later_steps(tmp_path: Path) -> None:
    cfg = TrainerConfig(output_dir=str(tmp_path), loggers=["jsonl"], total_training_steps=5)
    t = Tracker(cfg, config={}, rank=0)
    for step in range(1, 5):
        t.log({"reward/mean": step / 10}, step=step)
    t.close()
    t = Tracker(cfg, config={}, rank=0, resume_step=2)  # resumed from the step-2 checkpoint
    t.log({"reward/mean": 0.33}, step=3)
    t.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.33)]


def test_only_rank_zero_writes(tmp_path: Path) -> None:
    cfg = TrainerConfig(output_dir=str(tmp_path), loggers=["jsonl", "console"])
    t = Tracker(cfg, config={}, rank=1)
    t.log({"reward/mean": 1.0}, step=1)
    assert not (tmp_path / "metrics.jsonl").exists() and t.backends == []


def test_console_shows_rate_eta_and_thins_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = TrainerConfig(output_dir=str(tmp_path), loggers=["console"], total_training_steps=200)
    t = Tracker(cfg, config={}, rank=0)
    for step in range(1, 201):
        t.log({"reward/mean": 0.5, "actor/pg_loss": 0.1}, step=step)
    t.log({"eval/accuracy": 0.7}, step=200)
    lines = capsys.readouterr().out.splitlines()
    assert 50 <= len(lines) <= 60  # every 4th step, plus the first, last and evaluations
    assert lines[-2].startswith("step 200/200 (100%)") and "ETA 0m00s" in lines[-2]
    assert "reward/mean=0.5" in lines[-2] and "eval/accuracy=0.7" in lines[-1]


def test_progress_eta() -> None:
    p = Progress(10, start=0, label="step")
    p.t0 -= 4.0  # 4 s for the first 2 steps
    assert p.update(2) == "step 2/10 (20%) 2.00 s/step, ETA 0m16s"


def test_wandb_offline_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = TrainerConfig(output_dir=str(tmp_path), loggers=["wandb"], project_name="p", experiment_name="e")
    t = Tracker(cfg, config={"trainer.seed": 1}, rank=0)
    t.log({"reward/mean": 0.5}, step=1)
    t.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_resume_drops_a_torn_last_line_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11: a crash mid-write left half a line and the resume died (JSONDecodeError) after loading
    the models and the engine."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "reward/mean": 0.2}\n{"step": 3, "rew')
    cfg = TrainerConfig(output_dir=str(tmp_path), loggers=["jsonl"])
    Tracker(cfg, config={}, rank=0, resume_step=2).close()
    assert f"warning: {path}:3: dropping the torn last line" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("bad", [b'{"step": 2, "rew\n', b'{"step": 2, "note": "\xff"}\n'])
def test_an_unreadable_line_in_the_middle_is_an_error_naming_file_and_line(tmp_path: Path, bad: bytes) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n' + bad + b'{"step": 3}\n')
    cfg = TrainerConfig(output_dir=str(tmp_path), loggers=["jsonl"])
    with pytest.raises(ValueError, match=f"{path}:2: not a JSON object per line"):
        Tracker(cfg, config={}, rank=0, resume_step=3)


def test_a_fresh_run_moves_the_earlier_runs_metrics_aside(tmp_path: Path) -> None:
    """Issue 11: a fresh run (no resume) in a reused output dir emptied the previous run's metrics."""
    cfg = TrainerConfig(output_dir=str(tmp_path), loggers=["jsonl"])
    for run in range(2):
        t = Tracker(cfg, config={}, rank=0)
        t.log({"reward/mean": float(run)}, step=1)
        t.close()
    [old] = tmp_path.glob("metrics.*.jsonl")
    assert json.loads(old.read_text())["reward/mean"] == 0.0
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward/mean"] == 1.0
