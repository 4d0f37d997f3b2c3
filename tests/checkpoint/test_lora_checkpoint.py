"""LoRA end to end: a short LoRA-GRPO run (4 steps, the trainer's loop with the hf engine), its checkpoints
(adapters + their optimizer state + the base's path and hash) resuming bitwise, and ``export-hf --merged`` /
``--adapter`` (peft loads the adapter onto the base and reproduces the merged model's logits).

Slow (3–6 min on 2 shared cores): two training launches and four ``export-hf`` processes, each paying
Megatron's ~15 s import.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core import dist_checkpointing
from safetensors.torch import load_file

from hybridrl.bootstrap import write_arithmetic_task
from hybridrl.lora.checkpoint import LORA_RECORD, base_fingerprint, check_base, read_record, record_config
from hybridrl.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.optim.lr=1e-2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("lora_ckpt")
    make_tiny_model(tmp / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    make_tiny_model(tmp / "other", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128, seed=7)
    write_arithmetic_task(tmp / "train.parquet")
    return tmp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(tiny: Path, out: Path, *extra: str) -> None:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", str(REPO / "launch" / "train.py"), "recipe=grpo_lora_tiny",
            f"actor_rollout_ref.model.path={tiny / 'model'}", "actor_rollout_ref.model.build_if_missing=null",
            f"data.train_files=[{tiny / 'train.parquet'}]", "data.val_files=[]", "data.build_if_missing=null",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=4",
            "trainer.total_training_steps=4", "reward.name=keyword", "+reward.kwargs.keywords=['1','2','3','4','5']",
            "+reward.kwargs.mode=any", "trainer.save_freq=2", "trainer.save_hf_weights=true",
            f"trainer.output_dir={out}", *LORA, *extra]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


def export(ckpt: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", "export-hf", str(ckpt), str(out), *flags],
                          capture_output=True, text=True, timeout=300)


def metrics(out: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # data/prompts_*: the dataset's length filter, logged with the first step a launch runs
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing", "perf", "data/"))} for r in rows}


@pytest.fixture(scope="module")
def reference(tiny: Path) -> Path:
    out = tiny / "ref"
    train(tiny, out)
    return out


@pytest.mark.distributed
def test_lora_grpo_runs_and_the_engine_gets_the_merged_weights(reference: Path) -> None:
    m = metrics(reference)
    assert sorted(m) == [1, 2, 3, 4]
    for step in m.values():
        assert all(math.isfinite(v) for v in step.values() if isinstance(v, float))
        # the engine samples with W + s·B·A: its log-probs are the actor's (which has the adapters on)
        assert step["rollout/logprob_abs_diff"] < 1e-4
    assert m[1]["actor/kl_ref"] < m[4]["actor/kl_ref"]  # the ref (adapters off) stays the base; the actor moves


@pytest.mark.distributed
def test_lora_checkpoint_holds_adapters_and_resumes_bitwise(tiny: Path, reference: Path) -> None:
    ckpts = reference / "checkpoints"
    step4 = ckpts / "step_00000004"
    record = read_record(step4)
    assert record is not None and record["base_sha256"] == base_fingerprint(tiny / "model")
    assert record["lora"]["rank"] == 4 and len(record["lora"]["projections"]) == 7
    saved = dist_checkpointing.load_tensors_metadata(str(step4 / "megatron"))
    assert saved and all("_lora." in k for k in saved)  # adapters only: no base weight is copied
    resumed = tiny / "resumed"
    shutil.copytree(reference, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    train(tiny, resumed)  # trainer.resume=auto picks step 2
    assert metrics(resumed) == metrics(reference)
    a, b = tiny / "adapter_ref", tiny / "adapter_resumed"
    for ckpt, out in ((step4, a), (resumed / "checkpoints" / "step_00000004", b)):
        assert export(ckpt, out, "--adapter").returncode == 0
    sa, sb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.distributed
def test_lora_checkpoint_refuses_another_base(tiny: Path, reference: Path) -> None:
    step2 = reference / "checkpoints" / "step_00000002"
    record = read_record(step2)
    with pytest.raises(ValueError, match="adapters only fit the base they were trained on"):
        check_base(step2, record, lora=record_config(record), base_model=str(tiny / "other"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is a LoRA checkpoint"):
        check_base(step2, record, lora=None, base_model=str(tiny / "model"))
    assert (step2 / LORA_RECORD).is_file()


@pytest.mark.distributed
def test_export_merged_is_the_engine_stream_and_peft_reproduces_it(tiny: Path, reference: Path) -> None:
    """``--merged`` equals, bitwise, what the run streamed to the engine (``save_hf_weights`` writes the same
    ``export_weights`` stream as the weight sync); peft 0.21.2 loads ``--adapter`` onto the base and its logits
    equal the merged model's within 1e-5 (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    step4 = reference / "checkpoints" / "step_00000004"
    merged_dir, adapter_dir = tiny / "merged", tiny / "adapter"
    assert export(step4, merged_dir, "--merged").returncode == 0
    assert export(step4, adapter_dir, "--adapter").returncode == 0
    merged, streamed = load_file(merged_dir / "model.safetensors"), load_file(step4 / "hf" / "model.safetensors")
    assert merged.keys() == streamed.keys() and all(torch.equal(merged[k], streamed[k]) for k in merged)
    base = load_file(tiny / "model" / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q])
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])  # not adapted

    ids = torch.tensor([[5, 17, 3, 9, 22, 41, 7, 2, 30, 11]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()(input_ids=ids).logits
        base_model = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base_model, adapter_dir).eval()
        got = peft_model(input_ids=ids).logits
    assert float((got - want).abs().max()) < 1e-5
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"

    full = export(step4, tiny / "bad", "--adapter", "--merged")
    assert full.returncode != 0 and "not allowed with argument" in full.stderr


def test_export_hf_flags() -> None:
    """``--merged`` is the default (full HF weights, as before LoRA); ``--adapter`` asks for the peft folder."""
    from hybridrl.cli import build_parser

    parse = build_parser().parse_args
    assert not parse(["export-hf", "CKPT", "OUT"]).adapter
    assert not parse(["export-hf", "CKPT", "OUT", "--merged"]).adapter
    assert parse(["export-hf", "CKPT", "OUT", "--adapter"]).adapter
