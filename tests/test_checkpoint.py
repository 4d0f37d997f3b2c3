"""Checkpoints: bitwise resume, a SIGKILL mid-save, resharding TP=2 → TP=1 and PP=2×VPP=2 → TP=1, the
distributed optimizer's sharded state (bitwise resume at DP=2, resharded to DP=1), export-hf."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hybridrl.bootstrap import write_arithmetic_task
from hybridrl.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
TRAIN = str(REPO / "launch" / "train.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("ckpt")
    make_tiny_model(tmp / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    make_tiny_model(tmp / "model4", hidden=64, layers=4, heads=4, kv_heads=2, max_positions=128)  # PP=2 × VPP=2
    write_arithmetic_task(tmp / "train.parquet")
    return tmp


def cmd(tiny: Path, out: Path, *extra: str, nproc: int = 1, model: str = "model") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}", TRAIN, "recipe=grpo_tiny",
            f"actor_rollout_ref.model.path={tiny / model}",
            "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{tiny / 'train.parquet'}]",
            "data.val_files=[]", "data.build_if_missing=null", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.n=4", "trainer.total_training_steps=4", "reward.name=keyword",
            "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any", f"trainer.output_dir={out}",
            *extra]


def run(args: list[str]) -> None:
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:  # exited between pgrep and here
        return None


def metrics(out: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing", "perf"))} for r in rows}


def export(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    p = subprocess.run([sys.executable, "-m", "hybridrl.cli", "export-hf", str(ckpt), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def reference(tiny: Path) -> Path:
    """The uninterrupted 4-step run, checkpointing every 2 steps."""
    out = tiny / "ref"
    run(cmd(tiny, out, "trainer.save_every=2"))
    return out


@pytest.mark.distributed
def test_resume_is_bitwise_identical(tiny: Path, reference: Path) -> None:
    ckpts = reference / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000004"]
    resumed = tiny / "resumed"
    shutil.copytree(reference, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    run(cmd(tiny, resumed, "trainer.save_every=2"))  # trainer.resume=auto picks step 2
    assert metrics(resumed) == metrics(reference)  # steps 3, 4 recomputed: same samples, losses, grad norms
    a = export(ckpts / "step_00000004", tiny / "hf_ref")
    b = export(resumed / "checkpoints" / "step_00000004", tiny / "hf_resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert AutoModelForCausalLM.from_pretrained(tiny / "hf_ref") is not None  # transformers loads the export


@pytest.mark.distributed
def test_sigkill_mid_save_leaves_previous_checkpoint_and_resume_matches(tiny: Path, reference: Path) -> None:
    out = tiny / "killed"
    proc = subprocess.Popen(cmd(tiny, out, "trainer.save_every=1", "trainer.max_checkpoints_to_keep=0"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    partial = out / "checkpoints" / ".tmp_step_00000003"
    deadline = time.monotonic() + 300
    while not (partial / "megatron").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    # the trainer dies while it is writing step 3: SIGKILL to every process group of the run (torchrun's
    # worker has its own group, shared with the checkpoint writer's helper process)
    pids = subprocess.run(["pgrep", "-f", f"trainer.output_dir={out}"], capture_output=True, text=True).stdout
    for pgid in {_pgid(int(pid)) for pid in pids.split()} - {None}:
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    assert not (out / "checkpoints" / "step_00000004").exists()
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == [".tmp_step_00000003", "step_00000001", "step_00000002"], names
    run(cmd(tiny, out, "trainer.save_every=1", "trainer.max_checkpoints_to_keep=2"))  # resume=auto
    assert metrics(out) == metrics(reference)
    # the stale partial save is gone, old checkpoints were pruned to the newest two
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]


@pytest.mark.distributed
def test_checkpoint_saved_at_tp2_loads_at_tp1_with_identical_weights(tiny: Path) -> None:
    out = tiny / "tp2"
    tp2 = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
           "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"]
    run(cmd(tiny, out, *tp2, "trainer.total_training_steps=2", "trainer.save_every=2",
            "trainer.save_hf_weights=true", nproc=2))
    ckpt = out / "checkpoints" / "step_00000002"
    gathered_at_tp2 = load_file(ckpt / "hf" / "model.safetensors")  # TP-gathered by the TP=2 run itself
    resharded = export(ckpt, tiny / "hf_tp1")  # dist_checkpointing loads the TP=2 shards at TP=1
    assert gathered_at_tp2.keys() == resharded.keys()
    assert all(torch.equal(gathered_at_tp2[k], resharded[k]) for k in resharded)
    # and a TP=1 run resumes from it (model, optimizer, scheduler, sampler) and keeps training
    run(cmd(tiny, tiny / "tp1_resumed", f"trainer.resume={ckpt}", "trainer.total_training_steps=3"))
    assert sorted(metrics(tiny / "tp1_resumed")) == [3]


@pytest.mark.distributed
def test_checkpoint_saved_at_pp2_vpp2_loads_at_tp1_with_identical_weights(tiny: Path) -> None:
    """Model chunks are saved under their global layer numbers: the interleaved layout reshards to one rank."""
    out = tiny / "pp2vpp2"
    layout = [f"actor_rollout_ref.{role}.megatron.{size}=2" for role in ("actor", "ref")
              for size in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")]
    run(cmd(tiny, out, *layout, "trainer.total_training_steps=2", "trainer.save_every=2",
            "trainer.save_hf_weights=true", nproc=2, model="model4"))
    ckpt = out / "checkpoints" / "step_00000002"
    streamed_at_vpp = load_file(ckpt / "hf" / "model.safetensors")  # exported by the PP=2×VPP=2 run itself
    resharded = export(ckpt, tiny / "hf_pp2vpp2_tp1")  # dist_checkpointing loads the 4 chunks' shards at TP=1
    assert streamed_at_vpp.keys() == resharded.keys()
    assert all(torch.equal(streamed_at_vpp[k], resharded[k]) for k in resharded)
    # a TP=1 run resumes from it (model, optimizer, scheduler, sampler) and keeps training
    run(cmd(tiny, tiny / "pp2vpp2_tp1_resumed", f"trainer.resume={ckpt}", "trainer.total_training_steps=3",
            model="model4"))
    assert sorted(metrics(tiny / "pp2vpp2_tp1_resumed")) == [3]


@pytest.mark.distributed
def test_distributed_optimizer_state_resumes_bitwise_and_loads_at_dp1(tiny: Path) -> None:
    """The optimizer state is sharded over DP=2 and saved in Megatron's fully reshardable format."""
    distopt = "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true"
    out = tiny / "distopt"
    run(cmd(tiny, out, distopt, "trainer.save_every=2", nproc=2))
    resumed = tiny / "distopt_resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    run(cmd(tiny, resumed, distopt, "trainer.save_every=2", nproc=2))  # resume=auto picks step 2
    assert metrics(resumed) == metrics(out)  # Adam moments restored exactly on both shards
    a = export(out / "checkpoints" / "step_00000004", tiny / "hf_distopt")
    b = export(resumed / "checkpoints" / "step_00000004", tiny / "hf_distopt_resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # one rank takes the whole optimizer state (DP=1) and keeps training, on-policy
    step2 = f"trainer.resume={out / 'checkpoints' / 'step_00000002'}"
    run(cmd(tiny, tiny / "distopt_dp1", distopt, step2, "trainer.total_training_steps=3"))
    rows = metrics(tiny / "distopt_dp1")
    assert sorted(rows) == [3] and abs(rows[3]["actor/ppo_kl_first_mb"]) <= 1e-6, rows
    # the plain optimizer keeps its state in another format: the error names the key to keep
    plain = subprocess.run(cmd(tiny, tiny / "distopt_plain", step2, "trainer.total_training_steps=3"),
                           capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert plain.returncode != 0
    assert ("actor_rollout_ref.actor.megatron.use_distributed_optimizer=false: " in plain.stderr
            and "resume with actor_rollout_ref.actor.megatron.use_distributed_optimizer=true" in plain.stderr)
