"""SFT on the Megatron actor (launch/sft.py): the loss drops and the saved HF checkpoint is usable."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("sft")
    out, saved = tmp / "out", tmp / "saved"
    cmd = [sys.executable, str(REPO / "launch" / "sft.py"), "recipe=sft_tiny", f"model.path={tmp / 'random'}",
           f"data.train_files=[{tmp / 'train.parquet'}]", f"data.val_files=[{tmp / 'test.parquet'}]",
           "trainer.total_training_steps=40", "trainer.target_accuracy=null", "optim.lr_warmup_steps=2",
           "data.train_batch_size=32",
           "data.micro_batch_size_per_gpu=16", "trainer.test_freq=20", f"trainer.output_dir={out}",
           f"trainer.save_path={saved}"]
    # the recipe builds its random model and data when missing (build_if_missing): only inside the cache
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_CACHE_DIR": str(tmp)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {"out": out, "saved": saved, "random": tmp / "random", "stdout": Path(proc.stdout)}


@pytest.mark.slow
def test_a_second_run_on_the_same_output_dir_fails_before_writing(sft_run: dict[str, Path]) -> None:
    """Reproduces: SFT took no lock, so a second run on the output dir rotated the first one's metrics."""
    from test_run_lock import HOLD

    out, metrics = sft_run["out"], (sft_run["out"] / "metrics.jsonl").read_bytes()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        proc = subprocess.run([sys.executable, str(REPO / "launch" / "sft.py"), "recipe=sft_tiny",
                               f"model.path={sft_run['random']}", f"data.train_files=[{out.parent / 'train.parquet'}]",
                               f"data.val_files=[{out.parent / 'test.parquet'}]", f"trainer.output_dir={out}",
                               f"trainer.save_path={out.parent / 'saved_again'}"],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_CACHE_DIR": str(out.parent)})
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0
    assert f"trainer.output_dir={str(out)!r} is in use by another hybridrl run (pid {holder.pid}" in proc.stderr
    assert (out / "metrics.jsonl").read_bytes() == metrics and not (out.parent / "saved_again").exists()


def test_sft_loss_drops(sft_run: dict[str, Path]) -> None:
    rows = [json.loads(line) for line in (sft_run["out"] / "metrics.jsonl").read_text().splitlines()]
    losses = [r["sft/loss"] for r in rows]
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    # held-out NLL (data.val_files) every trainer.test_freq=20 steps: it drops with the training loss
    val = [(r["step"], r["val/loss"]) for r in rows if "val/loss" in r]
    assert [s for s, _ in val] == [20, 40] and val[1][1] < val[0][1] < losses[0], (val, losses[0])


def test_saved_checkpoint_is_a_trained_hf_model(sft_run: dict[str, Path]) -> None:
    saved, random = sft_run["saved"], sft_run["random"]
    model = AutoModelForCausalLM.from_pretrained(saved)
    tok = AutoTokenizer.from_pretrained(saved)
    assert tok.decode(tok("12+34=")["input_ids"]) == "12+34="
    before, after = load_file(random / "model.safetensors"), load_file(saved / "model.safetensors")
    assert before.keys() == after.keys()  # same HF names, tied embeddings stay tied (no lm_head)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert model.config.tie_word_embeddings and "lm_head.weight" not in after
    assert not any(p.name.startswith(".") for p in saved.parent.iterdir() if "saved" in p.name)  # no temp left


@pytest.mark.distributed
def test_saved_checkpoint_passes_verify_model(sft_run: dict[str, Path]) -> None:
    out = subprocess.run([sys.executable, "-m", "hybridrl.cli", "verify-model", str(sft_run["saved"])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].endswith("roundtrip=exact")


def _memorize(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """SFT of the random tiny model on 8 sums, held out = the same 8 (a target it can reach in ~50 steps)."""
    rows = [{"prompt": f"{a}+{b}=", "ground_truth": str(a + b)}
            for a, b in [(1, 2), (3, 4), (12, 5), (7, 7), (20, 31), (9, 1), (44, 4), (6, 60)]]
    pairs = tmp / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, str(REPO / "launch" / "sft.py"), "recipe=sft_tiny", "data.build_if_missing=null",
           f"data.train_files=[{pairs}]", f"data.val_files=[{pairs}]", "data.train_batch_size=8",
           "data.micro_batch_size_per_gpu=8", "trainer.test_freq=10", "optim.lr=3e-3",
           f"trainer.output_dir={tmp / 'out'}", f"trainer.save_path={tmp / 'saved'}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_CACHE_DIR": str(tmp)}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_target_accuracy_stops_the_run_once_greedy_decoding_reproduces_the_targets(tmp_path: Path) -> None:
    """``trainer.target_accuracy``: the run stops at the first check that reaches it (not at the step cap), and the
    saved model's greedy decoding (transformers ``generate``) reproduces as many held-out targets as
    ``val/greedy_accuracy`` said — the teacher-forced metric is greedy decoding's accuracy."""
    proc = _memorize(tmp_path, "trainer.total_training_steps=400", "trainer.target_accuracy=1.0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    checks = [(r["step"], r["val/greedy_accuracy"]) for r in rows if "val/greedy_accuracy" in r]
    assert checks[-1][1] == 1.0 and all(a < 1.0 for _, a in checks[:-1]), checks
    assert rows[-1]["step"] == checks[-1][0] < 400 and checks[-1][0] % 10 == 0
    assert f"reached trainer.target_accuracy=1 at step {checks[-1][0]} of at most 400" in proc.stdout + proc.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    tok = AutoTokenizer.from_pretrained(tmp_path / "saved")
    for line in (tmp_path / "pairs.jsonl").read_text().splitlines():
        row = json.loads(line)
        ids = tok(row["prompt"], return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
        assert tok.decode(out, skip_special_tokens=True) == row["ground_truth"], row
    # partway, the metric counted a row right exactly when its greedy decoding was: 0 < accuracy < 1 was logged
    assert any(0 < a < 1 for _, a in checks), checks


@pytest.mark.slow
def test_a_target_not_reached_within_the_cap_fails_and_saves_nothing(tmp_path: Path) -> None:
    proc = _memorize(tmp_path, "trainer.total_training_steps=10", "optim.lr_warmup_steps=2",
                     "trainer.target_accuracy=1.0")
    assert proc.returncode != 0
    assert re.search(r"val/greedy_accuracy was at most 0\.\d{3} in trainer\.total_training_steps=10 steps, below "
                     r"trainer\.target_accuracy=1; nothing was saved to", proc.stderr), proc.stderr[-3000:]
    assert not (tmp_path / "saved").exists()
