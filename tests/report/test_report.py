"""``hybridrl report``: figures of real runs' metrics as one HTML page or PNGs, runs overlaid by name."""

from __future__ import annotations

import base64
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from hybridrl.bootstrap import write_arithmetic_task
from hybridrl.cli import main
from hybridrl.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
PNG = b"\x89PNG\r\n\x1a\n"


real_run = pytest.mark.distributed  # on the run_dir fixture's real run: torchrun launches launch/train.py


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, torchrun) -> Path:
    """A real grpo_tiny run of 4 steps on a 2-layer model, evaluated at steps 0, 2 and 4 (~40 s on 2 cores)."""
    tmp = tmp_path_factory.mktemp("report")
    make_tiny_model(tmp / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    write_arithmetic_task(tmp / "train.parquet", tmp / "test.parquet")
    out = tmp / "grpo_run"
    torchrun([TRAIN, "recipe=grpo_tiny", f"actor_rollout_ref.model.path={tmp / 'model'}",
              "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{tmp / 'train.parquet'}]",
              f"data.val_files=[{tmp / 'test.parquet'}]", "data.build_if_missing=null", "data.train_batch_size=4",
              "data.val_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
              "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
              "trainer.total_training_steps=4", "trainer.test_freq=2", f"trainer.output_dir={out}",
              # a random model never adds; a keyword reward gives the curves something to show
              "reward.name=keyword", "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any"], nproc=1)
    return out


def images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)]


@real_run
def test_html_overlays_a_finished_run_and_one_still_writing(run_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    running = tmp_path / "running"
    running.mkdir()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (running / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])  # a write under way
    out = tmp_path / "report.html"
    assert main(["report", str(run_dir), str(running), "--name", "done", "--name", "live", "--out", str(out)]) == 0
    page = out.read_text()
    pngs = images(page)
    assert len(pngs) == 6 and all(p.startswith(PNG) and len(p) > 20_000 for p in pngs)  # overview … time
    for title in ("Overview", "Reward", "Evaluation", "Policy update", "Rollouts", "Time"):
        assert "<h2 id='" in page and f">{title}</h2>" in page
    assert "<td>done</td>" in page and "<td>live</td>" in page
    assert "left out a partial last line" in page and "http" not in page.split("<body>")[1]  # self-contained
    stdout = capsys.readouterr().out
    assert "live: 3 rows, last step 2" in stdout and "done: 5 rows, last step 4" in stdout
    # what grpo_tiny does not log is said, not drawn (it has no KL-in-reward); what it logs is drawn
    assert "KL penalty in the reward (value, coef): not logged" in page
    assert "reward mean (band: min–max): not logged" not in page


@real_run
def test_pngs_one_per_figure_and_one_chosen_figure(run_dir: Path, tmp_path: Path) -> None:
    assert main(["report", str(run_dir), "--out", str(tmp_path / "figs")]) == 0
    written = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert written == ["eval.png", "overview.png", "policy.png", "reward.png", "rollout.png", "time.png"]
    assert all((tmp_path / "figs" / n).read_bytes().startswith(PNG) for n in written)
    one = tmp_path / "overview.png"
    assert main(["report", str(run_dir), "--figures", "overview", "--out", str(one)]) == 0
    assert one.read_bytes().startswith(PNG)
    assert main(["report", str(run_dir), "--out", str(tmp_path / "all.png")]) == 2  # 6 figures, one file


@real_run
def test_eval_per_data_source_panels_come_from_the_logged_keys(run_dir: Path) -> None:
    from hybridrl.report.panels import figures
    from hybridrl.report.runs import load_run

    run = load_run(run_dir)
    [evaluation] = [f for f in figures(run.keys) if f.name == "eval"]
    per_source = [p for p in evaluation.panels if p.title.startswith("eval: ")]
    # val_kwargs.n=2: mean@2 and pass@2 (pass@1 = mean@2 is not drawn twice), for the task's one data source
    assert [p.keys for p in per_source] == [("eval/arithmetic/mean@2", "eval/arithmetic/pass@2")]
    steps, values = run.series("eval/arithmetic/pass@2")
    assert steps == [0, 2, 4] and all(0 <= v <= 1 for v in values)


@real_run
def test_a_run_without_most_metrics_is_noted_not_fatal(run_dir: Path, tmp_path: Path) -> None:
    """An SFT run's metrics beside an RL run: the RL panels say which run lacks them, the SFT figure is drawn."""
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "sft/loss": 4.0 / s, "sft/grad_norm": 1.0, "sft/lr": 1e-3}) + "\n" for s in range(1, 9)))
    out = tmp_path / "r.html"
    assert main(["report", str(run_dir), str(sft), "--figures", "overview,sft", "--out", str(out)]) == 0
    page = out.read_text()
    assert "reward (train): not logged by sft" in page and ">SFT</h2>" in page
    assert "loss (train, val): not logged by grpo_run" in page
    assert main(["report", str(sft), "--out", str(tmp_path / "sft.html")]) == 0  # SFT alone: one figure
    assert len(images((tmp_path / "sft.html").read_text())) == 1


@real_run
def test_rotated_metrics_files_are_named_and_readable(run_dir: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A fresh run moves an earlier run's file aside as metrics.<time>.jsonl (hybridrl.tracking)."""
    earlier = tmp_path / "out" / "metrics.20261201-003941.jsonl"
    earlier.parent.mkdir()
    shutil.copy(run_dir / "metrics.jsonl", earlier)
    assert main(["report", str(earlier.parent), "--out", str(tmp_path / "x.html")]) == 2
    assert "no metrics.jsonl; earlier runs' files here: metrics.20261201-003941.jsonl" in capsys.readouterr().err
    assert main(["report", str(earlier), "--figures", "overview", "--out", str(tmp_path / "x.html")]) == 0
    assert "out/metrics.20261201-003941" in (tmp_path / "x.html").read_text()


@real_run
def test_without_matplotlib_the_error_says_how_to_install_it(run_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """matplotlib is installed here; an import that fails stands in for a machine without it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["report", str(run_dir), "--out", str(tmp_path / "r.html")]) == 2
    assert "pip install 'hybridrl[report]'" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_a_run_that_has_not_finished_a_step_yet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/accura')  # the first write, under way
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.html")]) == 0
    assert "nothing to draw yet" in capsys.readouterr().out
    page = (tmp_path / "r.html").read_text()
    assert images(page) == [] and "left out a partial last line" in page


def test_a_written_metrics_file_is_drawn_without_a_run(tmp_path: Path) -> None:
    """The quick tier's report check: a hand-written metrics.jsonl (two evaluations, three steps) gives a page with
    figures, so ``hybridrl report`` needs nothing but the file."""
    rows = [{"step": 0, "eval/accuracy": 0.1}, *({"step": k, "reward/mean": 0.2 * k, "actor/pg_loss": 0.5 / k}
                                                 for k in (1, 2, 3)), {"step": 3, "eval/accuracy": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.html")]) == 0
    pngs = images((tmp_path / "r.html").read_text())
    assert pngs and all(p.startswith(PNG) for p in pngs)
