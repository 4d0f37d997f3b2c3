"""The Slurm templates in launch/slurm/, run by bash on this machine with stand-ins for Slurm's commands.

``srun`` and ``scontrol`` (and, where a test only checks command lines, ``torchrun``) are small executables
put first on PATH that append one JSON line per call (argv, Slurm/torch env) to a record file. The stand-in
``srun`` then does what ``srun --ntasks-per-node=1`` does: it runs its command once per node, all nodes at
once, with ``SLURM_NODEID``/``SLURM_PROCID`` set. ``hybridrl validate`` is the real one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hybridrl.bootstrap import write_arithmetic_task
from hybridrl.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
MULTI, SINGLE = "launch/slurm/train.sbatch", "launch/slurm/train_1node.sbatch"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

STANDIN = """
import json, os, subprocess, sys

name = os.path.basename(sys.argv[0])
keep = ("SLURM_", "MASTER_", "TORCH_NCCL_", "OMP_NUM_THREADS", "NPROC_PER_NODE")
with open(os.environ["STANDIN_RECORD"], "a", encoding="utf-8") as f:
    f.write(json.dumps({"name": name, "argv": sys.argv[1:], "cwd": os.getcwd(),
                        "env": {k: v for k, v in os.environ.items() if k.startswith(keep)}}) + "\\n")
if name == "scontrol" and sys.argv[1] == "requeue":
    assert sys.argv[2:] == [os.environ["SLURM_JOB_ID"]], sys.argv
elif name == "scontrol":
    assert sys.argv[1:] == ["show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], sys.argv
    print("\\n".join(os.environ["STANDIN_HOSTS"].split()))
elif name == "srun":
    args = sys.argv[1:]
    first = next(i for i, a in enumerate(args) if not a.startswith("-"))
    assert "--ntasks-per-node=1" in args[:first], args
    nodes = int(os.environ["SLURM_NNODES"])
    procs = [subprocess.Popen(args[first:], env={**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n),
                                                 "SLURM_LOCALID": "0"}) for n in range(nodes)]
    sys.exit(max(p.wait() for p in procs))
"""

# reach Hydra byte for byte: spaces, both quotes, `$`, a glob, a semicolon (a shell would split, expand or run them)
TRICKY = "trainer.experiment_name='run 1: \"a b\" $HOME `id` *; ok'"
RECIPE = ["recipe=grpo_tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]  # valid on 1–8 ranks


def standins(tmp: Path, *names: str) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        exe = bin_dir / name
        exe.write_text(f"#!{sys.executable}\n{STANDIN}")
        exe.chmod(0o755)
    return bin_dir


def template_env(tmp: Path, *, standin: tuple[str, ...], nodes: int, hosts: str, **env: str) -> dict[str, str]:
    """The environment a batch script sees: the stand-ins first on PATH, the allocation's SLURM_* variables."""
    record = tmp / "record.jsonl"
    record.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NPROC_PER_NODE"))}
    return {**base, "PATH": f"{standins(tmp, *standin)}{os.pathsep}{os.environ['PATH']}",
            "STANDIN_RECORD": str(record), "STANDIN_HOSTS": hosts, "SLURM_NNODES": str(nodes),
            "SLURM_JOB_NODELIST": "gpu-[017-018]", "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(REPO),
            "OMP_NUM_THREADS": "1", **env}


def recorded_calls(tmp: Path) -> list[dict]:
    record = tmp / "record.jsonl"
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def run_template(template: str, overrides: list[str], tmp: Path, *, standin: tuple[str, ...], nodes: int,
                 hosts: str, timeout: float = 120, **env: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    full_env = template_env(tmp, standin=standin, nodes=nodes, hosts=hosts, **env)
    proc = subprocess.run(["bash", template, *overrides], cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    return proc, recorded_calls(tmp)


@pytest.mark.slow
def test_multinode_template_launches_one_torchrun_per_node(tmp_path: Path) -> None:
    user = [*RECIPE, TRICKY, "trainer.dist_timeout_s=2400"]
    proc, calls = run_template(MULTI, user, tmp_path, standin=("srun", "scontrol", "torchrun"), nodes=2,
                               hosts="gpu-017 gpu-018", SLURM_GPUS_ON_NODE="4", SLURM_CPUS_PER_TASK="64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "config OK" in proc.stderr  # validate ran (its plan goes to the job log) before anything started
    assert [c["name"] for c in calls[:2]] == ["scontrol", "srun"]
    # the job's CPUs reach the step (srun does not inherit --cpus-per-task)
    assert calls[1]["argv"][:4] == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=64"]
    torchruns = sorted((c for c in calls if c["name"] == "torchrun"), key=lambda c: c["env"]["SLURM_NODEID"])
    assert len(torchruns) == 2
    for node, call in enumerate(torchruns):
        assert call["argv"] == [
            f"--node-rank={node}", "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=static",
            "--master-addr=gpu-017", "--master-port=24242",  # 20000 + job id mod 20000
            "--rdzv-conf=timeout=2400",  # trainer.dist_timeout_s of the composed config
            "launch/train.py", *user, "trainer.nnodes=2", "trainer.n_gpus_per_node=4"]
        assert call["cwd"] == str(REPO)
        assert call["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert torchruns[0]["argv"][10] == TRICKY  # byte-identical, not re-parsed by a shell


@pytest.mark.slow
def test_multinode_template_reads_the_timeout_and_port_it_is_given(tmp_path: Path) -> None:
    """The recipe's default dist_timeout_s, an explicit MASTER_PORT and NPROC_PER_NODE without GPUs."""
    proc, calls = run_template(MULTI, RECIPE, tmp_path, standin=("srun", "scontrol", "torchrun"),
                               nodes=2, hosts="a b", MASTER_PORT="31000", NPROC_PER_NODE="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    argv = next(c["argv"] for c in calls if c["name"] == "torchrun")
    assert "--rdzv-conf=timeout=3600" in argv and "--master-port=31000" in argv and "--master-addr=a" in argv
    assert "--nproc-per-node=2" in argv and argv[-1] == "trainer.n_gpus_per_node=2"


@pytest.mark.slow
def test_single_node_template(tmp_path: Path) -> None:
    user = [*RECIPE, TRICKY]
    proc, calls = run_template(SINGLE, user, tmp_path, standin=("srun", "scontrol", "torchrun"), nodes=1,
                               hosts="gpu-017", SLURM_GPUS_ON_NODE="4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [c["name"] for c in calls] == ["torchrun"]
    assert calls[0]["argv"] == ["--standalone", "--nproc-per-node=4", "launch/train.py", *user,
                                "trainer.nnodes=1", "trainer.n_gpus_per_node=4"]


@pytest.mark.slow
@pytest.mark.parametrize("template", [MULTI, SINGLE])
def test_config_error_stops_the_job_before_any_node_starts(tmp_path: Path, template: str) -> None:
    proc, calls = run_template(template, [*RECIPE, "data.train_batch_size=-3"], tmp_path,
                               standin=("srun", "scontrol", "torchrun"), nodes=2, hosts="a b",
                               SLURM_GPUS_ON_NODE="4")
    assert proc.returncode == 2
    assert "data.train_batch_size" in proc.stderr
    assert calls == []  # neither scontrol, srun nor torchrun ran


def test_template_without_ranks_per_node_says_what_to_set(tmp_path: Path) -> None:
    proc, calls = run_template(MULTI, ["recipe=grpo_tiny"], tmp_path, standin=("srun", "scontrol", "torchrun"),
                               nodes=2, hosts="a b")
    assert proc.returncode == 2 and "NPROC_PER_NODE" in proc.stderr and calls == []


@pytest.mark.distributed
def test_two_node_loopback_run_through_the_template(tmp_path: Path) -> None:
    """A real 2-"node" × 1-rank GRPO step: the template's srun starts two real torchruns (node ranks 0 and 1,
    static rendezvous on 127.0.0.1) that form one gloo world of 2. ~1–2 min on 2 cores (two Megatron imports)."""
    model = make_tiny_model(tmp_path / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    train, test = tmp_path / "train.parquet", tmp_path / "test.parquet"
    write_arithmetic_task(train, test)
    out = tmp_path / "run"
    user = ["recipe=grpo_tiny", f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{train}]",
            f"data.val_files=[{test}]", "data.build_if_missing=null", f"trainer.output_dir={out}",
            "trainer.device=cpu", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "trainer.total_training_steps=1", "trainer.test_freq=0", "trainer.val_before_train=false",
            "trainer.dist_timeout_s=300", "reward.timeout_s=60"]
    proc, calls = run_template(MULTI, user, tmp_path, standin=("srun", "scontrol"), nodes=2,
                               hosts="127.0.0.1 127.0.0.2", NPROC_PER_NODE="1", MASTER_PORT=str(_free_port()),
                               timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    srun = next(c for c in calls if c["name"] == "srun")
    assert srun["argv"][3:] == ["bash", "launch/slurm/node.sh", "--nnodes=2", "--nproc-per-node=1",
                                "--rdzv-backend=static", "--master-addr=127.0.0.1",
                                f"--master-port={srun['env']['MASTER_PORT']}", "--rdzv-conf=timeout=300",
                                "launch/train.py", *user, "trainer.nnodes=2", "trainer.n_gpus_per_node=1"]
    assert "world 2:" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    # the length filter's counts, from the tokenization the two ranks shared
    total = len(pq.read_table(train))
    assert rows[0]["data/prompts_total"] == total
    assert rows[0]["data/prompts_kept"] + rows[0]["data/prompts_dropped"] == total
    assert rows[0]["data/prompts_kept"] > 0


@pytest.mark.slow
def test_validate_get_prints_only_the_values_on_stdout() -> None:
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "validate", "--world-size", "2",
                           "--get", "trainer.dist_timeout_s", "--get", "data.train_batch_size", "--",
                           *RECIPE, "trainer.dist_timeout_s=999.5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["999.5", "64"]
    assert "config OK" in proc.stderr  # the plan goes to stderr (the job log)
    typo = subprocess.run([sys.executable, "-m", "hybridrl.cli", "validate", "--get", "trainer.dist_timeout",
                           "--", *RECIPE], capture_output=True, text=True, timeout=120)
    assert typo.returncode == 2 and typo.stdout == ""
    assert "'trainer.dist_timeout' is not a config key; did you mean trainer.dist_timeout_s" in typo.stderr


@pytest.mark.distributed
def test_a_preempted_job_saves_its_step_requeues_itself_and_its_next_start_resumes(tmp_path: Path) -> None:
    """SIGTERM to the batch shell during step 2 of a 2-rank run of the 1-node template (what ``--signal=B:TERM@120``
    or a preemption delivers): the shell forwards it to torchrun, the ranks save their step and exit 0, and the job
    requeues itself (``scontrol requeue 4242``) and exits 0. The requeued start, the same command, resumes from that
    checkpoint and runs to the end. ~40 s (two starts of a tiny 2-rank run)."""
    import signal
    import time

    model = make_tiny_model(tmp_path / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    train = tmp_path / "train.parquet"
    write_arithmetic_task(train)
    out = tmp_path / "run"
    user = ["recipe=grpo_tiny", f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{train}]", "data.val_files=[]",
            "data.build_if_missing=null",
            f"trainer.output_dir={out}", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.total_training_steps=5", "trainer.test_freq=0"]
    env = template_env(tmp_path, standin=("scontrol",), nodes=1, hosts="127.0.0.1", NPROC_PER_NODE="2")
    log = tmp_path / "job.log"
    with log.open("wb") as f:
        job = subprocess.Popen(["bash", SINGLE, *user], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while job.poll() is None and "step 2/5" not in log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "preempted (rank 0: SIGTERM" in text and "requeueing job 4242" in text, text[-4000:]
    assert [c["argv"] for c in recorded_calls(tmp_path)] == [["requeue", "4242"]]
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and saved[0] >= "step_00000002", saved
    again, _ = run_template(SINGLE, user, tmp_path, standin=("scontrol",), nodes=1, hosts="127.0.0.1",
                            NPROC_PER_NODE="2", timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"resuming from {out / 'checkpoints' / saved[0]}" in again.stdout + again.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5][: len(steps)] and steps[-1] == 5, steps
