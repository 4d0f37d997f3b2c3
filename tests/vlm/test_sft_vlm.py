"""SFT of a vision-language model (``sft_vlm_tiny``'s path on a small random Qwen2.5-VL): the rows' images reach the
vision tower, which trains (``model.freeze_vision_tower``: stays as loaded while the language model trains); the saved
checkpoint is a complete Qwen2.5-VL that transformers and its processor load (the processor's files travel with it)
and its held-out loss is transformers' on the same rows. ~15 s each; Qwen3-VL at context parallel 2 (two ranks)
~30 s."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridrl.data.dots import DotsTaskConfig, write_dots_splits
from hybridrl.models.tiny import TinyModelSpec
from hybridrl.models.tiny_vlm import make_tiny_vlm
from hybridrl.vlm.sglang_compat import transformers_rope_rules

SFT = str(Path(__file__).resolve().parents[2] / "launch" / "sft.py")


@pytest.mark.e2e
# a frozen tower: the LoRA case (frozen with the base; model.freeze_vision_tower is tests/vlm/test_vlm_policy.py's
# tp1pp2-frozen layout)
@pytest.mark.parametrize(("frozen", "family", "cp", "lora"), [
    (False, "qwen2_5_vl", 1, 0), (False, "qwen3_vl", 2, 0), (True, "qwen3_vl", 1, 4)],
    ids=["trained", "qwen3_vl-cp2", "qwen3_vl-lora"])
def test_sft_on_images_trains_the_tower_and_saves_a_loadable_vlm(tmp_path: Path, frozen: bool, family: str,
                                                                 cp: int, lora: int) -> None:
    """LoRA: adapters on the language model, the tower frozen with the base weights; the saved model is merged."""
    import subprocess

    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = make_tiny_vlm(tmp_path / "model", text=TinyModelSpec(hidden=64, layers=2, heads=2, kv_heads=2, seed=5),
                          family=family)
    data = write_dots_splits(tmp_path / "dots", DotsTaskConfig(num_train=32, num_test=8, seed=4))
    out, saved = tmp_path / "out", tmp_path / "saved"
    launcher = [sys.executable] if cp == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                                  str(cp)]
    cmd = [*launcher, SFT, "recipe=sft_vlm_tiny", f"megatron.context_parallel_size={cp}", f"model.path={model}",
           "model.build_if_missing=null",
           f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]", "data.build_if_missing=null",
           "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4", "trainer.total_training_steps=3",
           "trainer.test_freq=3", "trainer.target_accuracy=null", "optim.lr=1e-2", "optim.lr_warmup_steps=0",
           f"trainer.output_dir={out}",
           f"trainer.save_path={saved}", "megatron.use_remove_padding=true",  # padded rows all the same
           f"model.freeze_vision_tower={str(frozen and not lora).lower()}",
           *([f"model.lora_rank={lora}", "model.lora_alpha=8", "model.target_modules=all-linear"] if lora else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1",
                                                                                  **__import__("os").environ})
    assert proc.returncode == 0, proc.stderr[-4000:]
    start, after = load_file(model / "model.safetensors"), load_file(saved / "model.safetensors")
    assert after.keys() == start.keys()
    tower = [k for k in start if k.startswith(("visual.", "model.visual."))]
    moved = max(float((after[k] - start[k]).abs().max()) for k in tower)
    assert moved == 0.0 if frozen else moved > 1e-3
    assert max(float((after[k] - start[k]).abs().max()) for k in start if k not in tower) > 1e-3
    assert (saved / "processor_config.json").is_file()
    val = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "val/loss" in line][-1]
    # the saved model's held-out loss, by transformers with the processor's pixels
    import pyarrow.parquet as pq

    from hybridrl.data.multimodal import encode_prompt

    with transformers_rope_rules():
        hf = AutoModelForImageTextToText.from_pretrained(saved, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(saved)
    nll, tokens = 0.0, 0
    for row in pq.read_table(data["test"]).to_pylist():
        enc = encode_prompt(processor, row["prompt"], row["images"], base_dir=None, where="test")
        target = processor.tokenizer(row["ground_truth"], add_special_tokens=False)["input_ids"] + [
            processor.tokenizer.eos_token_id]
        ids = torch.tensor([enc.input_ids + target])
        with torch.no_grad():
            logits = hf(input_ids=ids, pixel_values=enc.pixel_values, image_grid_thw=enc.image_grid_thw,
                        mm_token_type_ids=(ids == hf.config.image_token_id).int()).logits[0]
        n = len(enc.input_ids)
        logp = logits[n - 1:-1].log_softmax(-1).gather(-1, ids[0, n:, None])
        nll, tokens = nll - float(logp.sum()), tokens + len(target)
    assert nll / tokens == pytest.approx(val["val/loss"], rel=1e-4)
