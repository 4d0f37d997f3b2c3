"""Checkpoints: bitwise resume, SIGKILLs at random moments of saves, resuming from an older step (newer
checkpoints moved aside), changed LR settings applied on resume, one run per output dir, resharding
TP=2 → TP=1 and PP=2×VPP=2 → TP=1, the distributed optimizer's sharded state (bitwise resume at DP=2,
resharded to DP=1), export-hf. The directory's rules on plain files: ``test_checkpoint_layout.py``."""

from __future__ import annotations

import json
import math
import os
import random
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
from hybridrl.checkpoint.rl import LATEST, checkpoint_problem, latest_complete, step_dirs
from hybridrl.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


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


def run(args: list[str]) -> str:
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p.stdout


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
    run(cmd(tiny, out, "trainer.save_freq=2"))
    return out


@pytest.mark.distributed
def test_resume_is_bitwise_identical(tiny: Path, reference: Path) -> None:
    ckpts = reference / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [LATEST, "step_00000002", "step_00000004"]
    assert all(checkpoint_problem(p) is None for _, p in step_dirs(ckpts))
    # trainer state and RNG are plain types and tensors: no pickled code runs when they load
    assert torch.load(ckpts / "step_00000004" / "trainer_state.pt", weights_only=True)["step"] == 4
    assert "numpy" in torch.load(ckpts / "step_00000004" / "rng" / "rank_00000.pt", weights_only=True)
    resumed = tiny / "resumed"
    shutil.copytree(reference, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    run(cmd(tiny, resumed, "trainer.save_freq=2", "trainer.save_hf_weights=true"))  # resume=auto picks step 2
    assert metrics(resumed) == metrics(reference)  # steps 3, 4 recomputed: same samples, losses, grad norms
    a = export(ckpts / "step_00000004", tiny / "hf_ref")  # export-hf of the reference's checkpoint
    b = load_file(resumed / "checkpoints" / "step_00000004" / "hf" / "model.safetensors")  # written by the run
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert AutoModelForCausalLM.from_pretrained(tiny / "hf_ref") is not None  # transformers loads the export


def _kill_run(out: Path) -> None:
    """SIGKILL every process group of the run (torchrun's worker has its own group, shared with the
    checkpoint writer's helper process)."""
    pids = subprocess.run(["pgrep", "-f", f"trainer.output_dir={out}"], capture_output=True, text=True).stdout
    for pgid in {_pgid(int(pid)) for pid in pids.split()} - {None}:
        os.killpg(pgid, signal.SIGKILL)


def _killed_during_a_save(args: list[str], out: Path, *, delay_s: float) -> str | None:
    """Start the run; ``delay_s`` after its first save starts writing, SIGKILL it. Returns what the kill
    interrupted, read from the directory (None: the run had finished)."""
    root = out / "checkpoints"

    def partial_saves() -> set[tuple[str, int, int]]:  # a killed save's leftover is replaced by the same name
        return {(p.name, p.stat().st_ino, p.stat().st_ctime_ns) for p in root.glob(".tmp_step_*")}

    before = partial_saves()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if partial_saves() - before:
                break
        except FileNotFoundError:  # removed while listed
            pass
        time.sleep(0.002)
    time.sleep(delay_s)
    _kill_run(out)
    proc.wait()
    if proc.returncode == 0:
        return None
    tmp = sorted(p.name for p in root.glob(".tmp_step_*"))
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else "none"
    return f"{tmp[-1]} being written" if tmp else f"the save done (latest: {latest})"


@pytest.mark.distributed
def test_sigkill_at_random_moments_of_saves_always_resumes_bitwise(tiny: Path, reference: Path) -> None:
    """A chain of runs on one output dir, each SIGKILLed during its first save (from the moment it starts
    writing: delay 0, then three seeded random delays up to 1.6 s, about a process's first save here (1.4 s): the
    writes, manifest, renames, ``latest``, retention; later saves take ~0.1 s, so a late kill lands in a
    later step or save), each followed by ``resume=auto``; the last run finishes (unless a late kill found
    it done). Every step's metrics equal the uninterrupted run's, so each resume restored an exact state.
    The commit's narrow windows (between rename and ``latest``, mid-retention) are hit deterministically
    in ``test_checkpoint_layout.py``. Time: each killed run costs one start (~8 s on 2 cores): ~30 s more than
    a single kill (it had five random kills; the CI budget took two of them: every commit's window is hit
    deterministically there)."""
    out = tiny / "killed"
    args = cmd(tiny, out, "trainer.save_freq=1", "trainer.max_checkpoints_to_keep=2")
    rng = random.Random(11)
    hit: list[str | None] = []
    for delay_s in (0.0, *(rng.uniform(0, 1.6) for _ in range(3))):
        hit.append(_killed_during_a_save(args, out, delay_s=delay_s))
        if hit[-1] is None:  # a kill after its last save came too late: the run is complete
            break
    else:
        run(args)  # resume=auto, to the end
    root = out / "checkpoints"
    assert metrics(out) == metrics(reference), hit
    resumed = latest_complete(root)
    assert resumed is not None and resumed.name == "step_00000004", hit
    assert [s for s, _ in step_dirs(root)] == [3, 4] and not list(root.glob(".*")), sorted(root.iterdir())
    print("kills:", hit)


@pytest.mark.distributed
def test_resume_from_an_older_step_moves_newer_checkpoints_aside(tiny: Path, reference: Path) -> None:
    """Issue 11: resuming step 2 of a run that reached step 4 and keeping 1 checkpoint deleted the new
    step 3 and kept step 4, which resume=auto then took. Now step 4 is moved aside at start, retention
    deletes only the older step 2, and resume=auto follows the new line."""
    out = tiny / "older"
    shutil.copytree(reference, out)
    root = out / "checkpoints"
    log = run(cmd(tiny, out, f"trainer.resume={root / 'step_00000002'}", "trainer.total_training_steps=3",
                  "trainer.save_freq=1", "trainer.max_checkpoints_to_keep=1"))
    [aside] = root.glob("abandoned-*")
    assert f"moved step_00000004 (newer than the resumed step_00000002) aside to {aside}" in log
    assert [p.name for p in aside.iterdir()] == ["step_00000004"]
    assert checkpoint_problem(aside / "step_00000004") is None  # moved, whole
    assert [s for s, _ in step_dirs(root)] == [3] and latest_complete(root) == root / "step_00000003"
    assert metrics(out) == {s: m for s, m in metrics(reference).items() if s <= 3}  # one consistent history


@pytest.mark.distributed
def test_changed_lr_schedule_and_lr_are_applied_on_resume(tiny: Path) -> None:
    """Issue 11: extending a cosine run from 2 to 4 steps left the LR at 0 for the new steps, and a new
    optim.lr was ignored (the scheduler state was loaded over both). Now both apply from the saved step,
    and the log names them; a changed optimizer kind is an error naming the key."""
    lr_key = "actor_rollout_ref.actor.optim.lr"
    out = tiny / "cosine"
    run(cmd(tiny, out, f"{lr_key}=1e-4", "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
            "trainer.total_training_steps=2", "trainer.save_freq=2"))
    log = run(cmd(tiny, out, f"{lr_key}=2e-4", "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
                  "trainer.total_training_steps=4", "trainer.save_freq=2"))
    assert f"{lr_key}: 0.0001 → 0.0002; trainer.total_training_steps: 2 → 4; LR decay over 8 optimizer steps " \
           "(saved: 4)" in log
    # 2 optimizer steps per RL step; actor/lr is the mean of the LRs set after each: optimizer steps 5 and 6 of 8
    expected = sum(2e-4 * 0.5 * (1 + math.cos(math.pi * n / 8)) for n in (5, 6)) / 2
    assert metrics(out)[3]["actor/lr"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.distributed
def test_a_second_run_on_the_same_output_dir_fails_at_once(tiny: Path) -> None:
    out = tiny / "locked"
    hold = ("import sys, time\nfrom hybridrl.run_lock import RunLock\nlock = RunLock(sys.argv[1])\n"
            "print('held', flush=True)\ntime.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        p = subprocess.run(cmd(tiny, out), capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        holder.kill()
        holder.wait()
    assert p.returncode != 0
    assert (f"trainer.output_dir={str(out)!r} is in use by another hybridrl run (pid {holder.pid} on host "
            f"{socket.gethostname()}") in p.stderr
    assert "loading" not in p.stdout and not (out / "metrics.jsonl").exists()  # before any model or file


@pytest.mark.distributed
def test_checkpoint_saved_at_tp2_loads_at_tp1_with_identical_weights(tiny: Path) -> None:
    out = tiny / "tp2"
    tp2 = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
           "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"]
    run(cmd(tiny, out, *tp2, "trainer.total_training_steps=2", "trainer.save_freq=2",
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
    run(cmd(tiny, out, *layout, "trainer.total_training_steps=2", "trainer.save_freq=2",
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
    hf = "trainer.save_hf_weights=true"  # the runs write the weights they end with (no export-hf process)
    run(cmd(tiny, out, distopt, "trainer.save_freq=2", hf, nproc=2))
    resumed = tiny / "distopt_resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    run(cmd(tiny, resumed, distopt, "trainer.save_freq=2", hf, nproc=2))  # resume=auto picks step 2
    assert metrics(resumed) == metrics(out)  # Adam moments restored exactly on both shards
    a, b = (load_file(o / "checkpoints" / "step_00000004" / "hf" / "model.safetensors") for o in (out, resumed))
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
