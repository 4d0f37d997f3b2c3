"""Metrics sinks: jsonl (with resume), console progress, wandb offline, mlflow; optional loggers checked statically."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.schema import TrainerConfig
from hybridrl.config.validate import validate
from hybridrl.tracking import Progress, Tracker

REPO = Path(__file__).resolve().parents[1]


def test_jsonl_one_object_per_step_and_resume_drops_later_steps(tmp_path: Path) -> None:
    cfg = TrainerConfig(output_dir=str(tmp_path), logger=["jsonl"], total_training_steps=5)
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
    cfg = TrainerConfig(output_dir=str(tmp_path), logger=["jsonl", "console"])
    t = Tracker(cfg, config={}, rank=1)
    t.log({"reward/mean": 1.0}, step=1)
    assert not (tmp_path / "metrics.jsonl").exists() and t.backends == []


def test_console_shows_rate_eta_and_thins_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = TrainerConfig(output_dir=str(tmp_path), logger=["console"], total_training_steps=200)
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


@pytest.mark.slow
def test_wandb_offline_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = TrainerConfig(output_dir=str(tmp_path), logger=["wandb"], project_name="p", experiment_name="e")
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
    cfg = TrainerConfig(output_dir=str(tmp_path), logger=["jsonl"])
    Tracker(cfg, config={}, rank=0, resume_step=2).close()
    assert f"warning: {path}:3: dropping the torn last line" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("bad", [b'{"step": 2, "rew\n', b'{"step": 2, "note": "\xff"}\n'])
def test_an_unreadable_line_in_the_middle_is_an_error_naming_file_and_line(tmp_path: Path, bad: bytes) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n' + bad + b'{"step": 3}\n')
    cfg = TrainerConfig(output_dir=str(tmp_path), logger=["jsonl"])
    with pytest.raises(ValueError, match=f"{path}:2: not a JSON object per line"):
        Tracker(cfg, config={}, rank=0, resume_step=3)


def test_a_fresh_run_moves_the_earlier_runs_metrics_aside(tmp_path: Path) -> None:
    """Issue 11: a fresh run (no resume) in a reused output dir emptied the previous run's metrics."""
    cfg = TrainerConfig(output_dir=str(tmp_path), logger=["jsonl"])
    for run in range(2):
        t = Tracker(cfg, config={}, rank=0)
        t.log({"reward/mean": float(run)}, step=1)
        t.close()
    [old] = tmp_path.glob("metrics.*.jsonl")
    assert json.loads(old.read_text())["reward/mean"] == 0.0
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward/mean"] == 1.0


@pytest.mark.slow
def test_mlflow_logs_params_and_step_metrics_to_a_local_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Without MLFLOW_TRACKING_URI the run goes to a sqlite store in the output dir; read back with mlflow's client."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = TrainerConfig(output_dir=str(tmp_path), logger=["mlflow"], project_name="p", experiment_name="e")
    t = Tracker(cfg, config={"trainer.seed": 1, "data.train_files": ["a.parquet"]}, rank=0)
    for step, reward in [(1, 0.25), (2, 0.5), (3, float("nan"))]:
        t.log({"reward/mean": reward, "eval/arithmetic/pass@4": reward / 2}, step=step)
    t.close()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert f"logging to {uri}" in capsys.readouterr().out
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("p").experiment_id])
    assert run.info.run_name == "e" and run.info.status == "FINISHED"
    assert run.data.params == {"trainer.seed": "1", "data.train_files": "['a.parquet']"}
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [m.step for m in history] == [1, 2, 3] and [m.value for m in history][:2] == [0.25, 0.5]
    assert math.isnan(history[2].value)
    # mlflow refuses '@' in a name
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/arithmetic/pass_at_4")][:2] == [0.125,
                                                                                                              0.25]


@pytest.mark.slow
def test_mlflow_honours_the_tracking_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = TrainerConfig(output_dir=str(tmp_path / "out"), logger=["mlflow"], project_name="p", experiment_name="e")
    for run in range(2):  # a second run joins the existing experiment
        t = Tracker(cfg, config={}, rank=0)
        t.log({"reward/mean": float(run)}, step=1)
        t.close()
    assert not (tmp_path / "out" / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("p").experiment_id])
    assert sorted(r.data.metrics["reward/mean"] for r in runs) == [0.0, 1.0]


@pytest.mark.slow
def test_optional_loggers_are_imported_only_when_chosen(tmp_path: Path) -> None:
    code = ("import sys\nfrom hybridrl.config.schema import TrainerConfig\nfrom hybridrl.tracking import Tracker\n"
            f"t = Tracker(TrainerConfig(output_dir={str(tmp_path)!r}, total_training_steps=3), config={{}}, rank=0)\n"
            "t.log({'reward/mean': 1.0}, step=1)\nt.close()\n"
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"


def _tracking_issues(loggers: str, *, recipe: str = "grpo_tiny", model_config: Path | None = None) -> list[str]:
    """The trainer.logger problems static validation finds in the recipe with these loggers."""
    cfg = compose_config([f"recipe={recipe}", f"trainer.logger={loggers}"])
    try:
        validate(cfg, world_size=None if model_config else 1, before_bootstrap=True, model_config=model_config)
    except ConfigError as e:
        return [str(i) for i in e.issues if i.key == "trainer.logger"]
    return []


def test_validation_rejects_a_chosen_logger_whose_package_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 16: logger=[..., wandb, tensorboard] without tensorboard started wandb, loaded the model and then
    died with a bare ModuleNotFoundError. A package can't be uninstalled here, so its lookup is made to fail."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert _tracking_issues("[console,jsonl,wandb,tensorboard]") == [
        "trainer.logger=['console', 'jsonl', 'wandb', 'tensorboard']: logger 'tensorboard': tensorboard not "
        "installed: pip install 'hybridrl[tensorboard]' (or drop it from the list)"]
    assert _tracking_issues("[console,jsonl]") == []
    # planning a run for another machine (hybridrl validate --model-config): its packages are not ours to check
    assert _tracking_issues("[console,tensorboard]", recipe="grpo_qwen7b",
                            model_config=REPO / "recipes" / "model_configs" / "qwen2.5-7b.json") == []


def test_mlflow_local_store_needs_sqlalchemy_only_without_a_tracking_server(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    [issue] = _tracking_issues("[console,mlflow]")
    assert "logger 'mlflow': sqlalchemy not installed: pip install 'hybridrl[mlflow]'" in issue
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert _tracking_issues("[console,mlflow]") == []


def test_an_unknown_logger_lists_the_valid_ones() -> None:
    assert _tracking_issues("[console,mlfow]") == [
        "trainer.logger=['console', 'mlfow']: unknown logger(s) ['mlfow']; valid: console, jsonl, wandb, "
        "tensorboard, mlflow"]


def test_tensorboard_writes_scalars_under_the_output_dir(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = TrainerConfig(output_dir=str(tmp_path), logger=["tensorboard"])
    t = Tracker(cfg, config={}, rank=0)
    for step in (1, 2):
        t.log({"reward/mean": step / 4, "eval/arithmetic/pass@4": 0.5}, step=step)
    t.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert [e.step for e in events.Scalars("eval/arithmetic/pass@4")] == [1, 2]
