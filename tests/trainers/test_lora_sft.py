"""LoRA-SFT (``launch/sft.py recipe=sft_lora_tiny``): the loss drops with only the adapters training, the start-up
line reports the trainable parameters and optimizer state, and the saved HF checkpoint is the merged model
(adapted projections moved, everything else bitwise the base's).

~1 min: one SFT launch (Megatron's import ~15 s) of 30 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_lora_sft_trains_adapters_and_saves_merged_weights(tmp_path: Path) -> None:
    out, saved = tmp_path / "out", tmp_path / "saved"
    cmd = [sys.executable, str(REPO / "launch" / "sft.py"), "recipe=sft_lora_tiny", f"model.path={tmp_path / 'random'}",
           f"data.train_files=[{tmp_path / 'train.parquet'}]", f"data.val_files=[{tmp_path / 'test.parquet'}]",
           "trainer.total_training_steps=30", "optim.lr_warmup_steps=2", "data.train_batch_size=32",
           "data.micro_batch_size_per_gpu=16", "trainer.test_freq=30", "model.target_modules=[q_proj,v_proj,down_proj]",
           f"trainer.output_dir={out}", f"trainer.save_path={saved}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_CACHE_DIR": str(tmp_path)}  # builds model + data here
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "LoRA r=16 alpha=32 on q_proj, v_proj, down_proj: " in proc.stdout
    assert "trainable parameters" in proc.stdout and "optimizer state" in proc.stdout

    losses = [json.loads(line)["sft/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5])

    base, merged = load_file(tmp_path / "random" / "model.safetensors"), load_file(saved / "model.safetensors")
    assert base.keys() == merged.keys()
    adapted = {n for n in base if n.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))}
    assert adapted and all(not torch.equal(base[n], merged[n]) for n in adapted)
    assert all(torch.equal(base[n], merged[n]) for n in base.keys() - adapted)  # the frozen base, bitwise
