"""The GPU checks of ``tests/gpu/run_all.sh``: what each runs (overrides, model, time limit) and the table.

``run_all.sh`` installs what a bare GPU box lacks, then runs this file: ``run [--full]`` or
``dry-run [--full] [--wheels DIR]``. Each check is one pytest node marked ``gpu``, run in its own
process (fresh GPU memory, its own time limit, its log under ``$HYBRIDRL_GPU_WORK/logs``). The node
appends one JSON record ``{"check": name, "figure": "...", ...}`` to ``$HYBRIDRL_GPU_REPORT``, then
asserts. The run ends with one line per check, ``name | pass/fail | figure``: a node that fails, is
skipped (a missing package or feature), times out or dies before reporting is a fail, with the reason.

This module is the one place for what the checks run; the test modules import it (``tests/gpu`` is on
``sys.path`` under pytest). Standard library only at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "tests" / "gpu"
TRAIN = REPO / "launch" / "train.py"
WHEELS = HERE / "wheels.txt"
QWEN2_1P5B = HERE / "qwen2.5-1.5b.json"  # Qwen2.5-1.5B's shapes; the model is made with random weights
REPORT_ENV, WORK_ENV = "HYBRIDRL_GPU_REPORT", "HYBRIDRL_GPU_WORK"
BUDGET_S = 8 * 60  # the default checks, install included, on one H200

# Dense bf16 peak of one H200 SXM (NVIDIA's datasheet, no sparsity): the MFU denominator. A large bf16
# matmul through torch measured ~790 TFLOP/s on this workplace's H200s (device docs, KINDS.md).
H200_BF16_PEAK_TFLOPS = 989.0

GRPO_TINY_STEPS = 20
ENGINE_OVERRIDES: dict[str, tuple[str, ...]] = {
    # the engine loads the checkpoint in the actor's dtype: the same bf16-rounded weights before the first sync
    "hf": ("+actor_rollout_ref.rollout.engine_kwargs.dtype=bfloat16",),
    # bfloat16 is the sglang engine's default on GPU, and its memory saver (release_memory frees memory)
    "sglang": ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.gpu_memory_utilization=0.4"),
}
# the sglang engine's parameter addresses are read by a test-only weight loader (tests/rollout/engines/sglang_probes.py)
SGLANG_STORAGE_PROBE = ("+actor_rollout_ref.rollout.engine_kwargs.server_args="
                        "{custom_weight_loader:[rollout.engines.sglang_probes.report_parameter_storage]}")


def work_dir() -> Path:
    """``$HYBRIDRL_GPU_WORK`` (default ``/tmp/hybridrl-gpu``): models, runs, logs and the report."""
    return Path(os.environ.get(WORK_ENV) or "/tmp/hybridrl-gpu")


def grpo_tiny_overrides(work: Path, engine: str) -> list[str]:
    """(a) the grpo_tiny recipe as it is (its own SFT-started tiny model, batch 64 prompts × 8), on CUDA in
    bf16 for ``GRPO_TINY_STEPS`` steps; eval at start and at the end."""
    return ["recipe=grpo_tiny", "trainer.device=cuda", "actor_rollout_ref.actor.megatron.dtype=bfloat16",
            f"trainer.total_training_steps={GRPO_TINY_STEPS}", f"trainer.output_dir={work / f'grpo_tiny_{engine}'}",
            "trainer.resume=never", *ENGINE_OVERRIDES[engine]]


def moe_r3_overrides(work: Path, engine: str) -> list[str]:
    """grpo_moe_tiny on CUDA with ``engine`` (vllm, sglang) recording its routing and the trainer replaying it (R3)."""
    return ["recipe=grpo_moe_tiny", "trainer.device=cuda", f"actor_rollout_ref.rollout.name={engine}",
            "actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            "trainer.total_training_steps=3", "trainer.test_freq=0", "trainer.val_before_train=false",
            f"trainer.output_dir={work / f'grpo_moe_tiny_{engine}_r3'}", "trainer.resume=never"]


def qwen2_1p5b_overrides(work: Path, engine: str) -> list[str]:
    """(b) two RL steps of the random ~1.5B Qwen2 on the arithmetic prompts, bf16, every offload on.

    16 prompts × 8 samples × ≤ 256 response tokens (~34k tokens per step) so the update is matmul-bound;
    a random model earns no reward, so an entropy bonus gives the update a gradient (weights do change)."""
    data = work / "data"
    out = [
        "recipe=grpo_tiny", f"actor_rollout_ref.model.path={work / 'qwen2-1.5b'}",
        "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{data / 'train.parquet'}]",
        "data.val_files=[]", "data.build_if_missing=null", "trainer.device=cuda",
        "actor_rollout_ref.actor.megatron.dtype=bfloat16",
        "actor_rollout_ref.actor.megatron.param_offload=true", "actor_rollout_ref.actor.megatron.grad_offload=true",
        "actor_rollout_ref.actor.megatron.optimizer_offload=true", "actor_rollout_ref.ref.megatron.param_offload=true",
        "data.train_batch_size=16", "actor_rollout_ref.rollout.n=8", "data.max_response_length=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.entropy_coeff=0.001",
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=0",
        f"trainer.output_dir={work / f'qwen2_1p5b_{engine}'}", "trainer.resume=never", *ENGINE_OVERRIDES[engine],
    ]
    return out + ([SGLANG_STORAGE_PROBE] if engine == "sglang" else [])


def qwen2_1p5b_flags() -> list[str]:
    """``hybridrl make-tiny-model`` flags for the shapes of ``qwen2.5-1.5b.json`` (fp32: the tool's only dtype)."""
    c = json.loads(QWEN2_1P5B.read_text())
    return ["--arch", c["model_type"], "--hidden", str(c["hidden_size"]), "--layers", str(c["num_hidden_layers"]),
            "--heads", str(c["num_attention_heads"]), "--kv-heads", str(c["num_key_value_heads"]),
            "--intermediate", str(c["intermediate_size"]), "--vocab", str(c["vocab_size"]),
            "--max-positions", str(c["max_position_embeddings"]), "--tie" if c["tie_word_embeddings"] else "--no-tie"]


def qwen2_1p5b_params() -> int:
    """Parameters of that shape (tied embeddings counted once), from the config alone."""
    c = json.loads(QWEN2_1P5B.read_text())
    h, v, i = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h  # q, k+v (with biases), o, MLP, 2 norms
    return v * h * (1 if c["tie_word_embeddings"] else 2) + c["num_hidden_layers"] * layer + h


def make_model_command(out: Path) -> list[str]:
    return [sys.executable, "-m", "hybridrl.cli", "make-tiny-model", str(out), *qwen2_1p5b_flags()]


def verify_command(model: Path) -> list[str]:
    return [sys.executable, "-m", "hybridrl.cli", "verify-model", str(model), "--tp", "1"]


def qwen2_1p5b_model(work: Path) -> Path:
    """The random ~1.5B Qwen2 under ``work`` (made once, ~6 GB of fp32 safetensors; atomically renamed into place)."""
    model = work / "qwen2-1.5b"
    if (model / "model.safetensors").is_file():
        return model
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / f".qwen2-1.5b.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(make_model_command(tmp), check=True, cwd=REPO)
    made, want = json.loads((tmp / "config.json").read_text()), json.loads(QWEN2_1P5B.read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings")
    if wrong := {k: (made.get(k), want[k]) for k in keys if made.get(k) != want[k]}:
        raise RuntimeError(f"make-tiny-model wrote other shapes than {QWEN2_1P5B.name}: {wrong} (made, wanted)")
    tmp.rename(model)
    return model


# --- the checks -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    node: str  # pytest node id, from the repo root
    timeout_s: int
    shows: str
    full: bool = False  # only with --full: needs Transformer Engine and SGLang on the box
    needs_model: bool = False  # the random ~1.5B Qwen2 (run_all starts making it in the background)
    overrides: Callable[[Path], list[str]] | None = None  # for `hybridrl validate` in --dry-run
    model_config: Path | None = None  # architecture to plan with (None: the tiny recipe model's)


def _node(file: str, test: str) -> str:
    return f"tests/gpu/{file}::{test}"


CHECKS: tuple[Check, ...] = (
    Check("grpo_tiny", _node("test_grpo_tiny_gpu.py", "test_grpo_tiny[hf]"), 180,
          f"grpo_tiny, {GRPO_TINY_STEPS} steps, bf16, hf engine, Megatron local spec: max logprob_abs_diff, "
          "max |ppo_kl_first_mb|, reward/mean first 5 vs last 5 steps",
          overrides=lambda w: grpo_tiny_overrides(w, "hf")),
    Check("qwen2_1p5b_rl_step", _node("test_qwen2_1p5b_gpu.py", "test_rl_step[hf]"), 180,
          "random Qwen2 ~1.5B (Qwen2.5-1.5B shapes), bf16, all offload on, hf engine: tokens/s, MFU, peak memory, "
          "memory while generating, weight sync time, in place", needs_model=True,
          overrides=lambda w: qwen2_1p5b_overrides(w, "hf"), model_config=QWEN2_1P5B),
    Check("qwen2_1p5b_verify", _node("test_qwen2_1p5b_gpu.py", "test_verify_model"), 90,
          "hybridrl verify-model on that model (Megatron on the GPU vs transformers fp32): logit diff, round trip",
          needs_model=True),
    Check("fused_logprob", _node("test_fused_logprob_gpu.py", "test_fused_logprob_gpu"), 60,
          "fused log-prob + entropy (Triton): error vs fp64 and vs the current path; 4096 tokens x 151936 vocab x "
          "1024 hidden, bf16 fwd+bwd: peak memory and time, current vs fused LM head (>= 4x less memory)"),
    Check("packing_thd", _node("test_packing_gpu.py", "test_packed_equals_padded_on_the_gpu"), 120,
          "one RL step of a tiny Qwen2, fp32: packed rows (THD) vs a padded row per sample — log-probs, step "
          "metrics, weights after the step"),
    Check("optimizer_cpu_offload", _node("test_optimizer_offload_gpu.py",
                                         "test_optimizer_cpu_offload_trains_as_the_device_optimizer"), 90,
          "a tiny Qwen2 in bf16, 2 steps: Megatron's HybridDeviceOptimizer with verl's Qwen3-VL-8B settings "
          "(optim.override_optimizer_config: CPU offload, fraction 1, precision-aware) and megatron.optimizer_offload "
          "vs the device optimizer: max |delta weight|, device memory held", full=True),
    Check("grpo_tiny_sglang_te", _node("test_grpo_tiny_gpu.py", "test_grpo_tiny[sglang]"), 420,
          "(a) with Transformer Engine's spec and the sglang engine", full=True,
          overrides=lambda w: grpo_tiny_overrides(w, "sglang")),
    Check("qwen2_1p5b_rl_step_sglang_te", _node("test_qwen2_1p5b_gpu.py", "test_rl_step[sglang]"), 420,
          "(b) with TE and sglang: in-place swap, weight version, memory around release_memory, swap time",
          full=True, needs_model=True, overrides=lambda w: qwen2_1p5b_overrides(w, "sglang"), model_config=QWEN2_1P5B),
    Check("sglang_swap_memory_saver", _node("test_sglang_gpu.py", "test_colocated_swap_with_memory_saver"), 300,
          "engine alone: release with the memory saver, in-place swap from CUDA tensors, samples = fresh engine",
          full=True),
    Check("sglang_swap_time_per_gb", _node("test_sglang_gpu.py", "test_swap_time_per_gb"), 300,
          "engine alone: seconds per GiB of an in-place bf16 swap (512 MB buckets, CUDA IPC)", full=True),
    *(Check(f"grpo_moe_tiny_{engine}_r3", _node("test_router_replay_gpu.py", f"test_r3_through_the_engine[{engine}]"),
            420, f"grpo_moe_tiny, 3 steps, {engine} recording each position's experts, the trainer replaying them "
            "(R3): router_replay/engine_mismatch per step, logprob_abs_diff", full=True,
            overrides=lambda w, e=engine: moe_r3_overrides(w, e),
            model_config=REPO / "tests" / "gpu" / "tiny-qwen3-moe.json") for engine in ("vllm", "sglang")),
    Check("sglang_per_sample_seeds", _node("test_sglang_gpu.py", "test_per_sample_seeds_fix_each_prompts_samples"),
          300, "engine alone: per-sample seeds with enable_deterministic_inference", full=True),
)


def check_named(name: str) -> Check:
    return next(c for c in CHECKS if c.name == name)


def report(*, check: str, figure: str, **details: Any) -> None:
    """One record for ``check``: ``figure`` is its cell in the table; ``details`` go to the JSON report."""
    line = json.dumps({"check": check, "figure": figure, **details}, ensure_ascii=False)
    print("GPU-REPORT", line, flush=True)
    if path := os.environ.get(REPORT_ENV):
        with open(path, "a") as f:
            f.write(line + "\n")


def read_metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def last_error(text: str) -> str:
    """The last ``SomethingError: ...`` line of ``text`` (else its last line), shortened."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Failed)\b.*:", line)]
    return ((errors or lines or ["(no output)"])[-1])[:300]


def megatron_line(text: str) -> str:
    """The run's own statement of its layer spec (``init_parallel`` prints it once), e.g. ``local spec``."""
    found = re.findall(r"^megatron: (.*)$", text, re.M)
    if not found:
        return "spec unknown"
    return "TE spec" if "TE layer spec" in found[-1] else "local spec"


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


# --- run ----------------------------------------------------------------------------------------


def run(checks: list[Check], *, work: Path) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_checks: no CUDA device is visible to torch; run this on a GPU machine (or use --dry-run)")
        return 1
    start = time.time()
    start = float(os.environ.get("HYBRIDRL_GPU_START", start))  # run_all.sh's start: the install counts too
    (work / "logs").mkdir(parents=True, exist_ok=True)
    report_path = work / "report.jsonl"
    report_path.unlink(missing_ok=True)
    env = {**os.environ, WORK_ENV: str(work), REPORT_ENV: str(report_path), "PYTHONUNBUFFERED": "1"}
    env.setdefault("HYBRIDRL_CACHE_DIR", str(work / "cache"))  # grpo_tiny builds its SFT start here once
    env.setdefault("HYBRIDRL_CHECK_COLLECTIVES", "1")  # every collective: CUDA tensors on NCCL, CPU ones on gloo
    print(f"== GPU checks on {torch.cuda.get_device_name(0)}: torch {torch.__version__}, "
          f"{_versions('megatron-core', 'transformers', 'transformer-engine', 'sglang')}; work dir {work}", flush=True)

    maker = None
    if any(c.needs_model for c in checks) and not (work / "qwen2-1.5b" / "model.safetensors").is_file():
        print("   making the random ~1.5B Qwen2 in the background (CPU) while the first checks run", flush=True)
        log = (work / "logs" / "make_model.log").open("w")
        maker = subprocess.Popen([sys.executable, str(Path(__file__)), "make-model"], cwd=REPO, env=env,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rows: list[tuple[str, bool, str, float]] = []
    try:
        for check in sorted(checks, key=lambda c: c.needs_model):  # the model is made while the others run
            if check.needs_model and maker is not None:
                rc, maker = _wait(maker, timeout_s=600), None
                if rc != 0:
                    reason = f"making the model failed: {last_error((work / 'logs' / 'make_model.log').read_text())}"
                    rows += [(c.name, False, reason, 0.0) for c in checks if c.needs_model]
                    break
            rows.append(_run_check(check, work=work, env=env, report_path=report_path))
    finally:
        if maker is not None:  # interrupted, or no check waited for it
            _wait(maker, timeout_s=0)
    return _finish(rows, start)


def _run_check(check: Check, *, work: Path, env: dict[str, str], report_path: Path) -> tuple[str, bool, str, float]:
    log_path = work / "logs" / f"{check.name}.log"
    cmd = [sys.executable, "-m", "pytest", check.node, "-m", "gpu", "-q", "-s", "-rA", "-p", "no:cacheprovider"]
    print(f"-- {check.name}: {' '.join(cmd[1:])} (limit {check.timeout_s} s, log {log_path})", flush=True)
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        rc = _wait(proc, timeout_s=check.timeout_s)
    seconds = time.monotonic() - t0
    text = log_path.read_text(errors="replace")
    records = [json.loads(line) for line in report_path.read_text().splitlines()] if report_path.exists() else []
    figure = next((r["figure"] for r in reversed(records) if r["check"] == check.name), None)
    ok = rc == 0 and figure is not None
    if not ok:
        reason = (f"timed out after {check.timeout_s} s" if rc is None else _reason(text, rc))
        figure = f"{figure} — {reason}" if figure else reason
        print("\n".join(text.splitlines()[-40:]), flush=True)
    print(f"   {check.name}: {'pass' if ok else 'FAIL'} in {seconds:.0f} s", flush=True)
    return check.name, ok, figure, seconds


def _reason(text: str, rc: int) -> str:
    if skipped := re.search(r"^SKIPPED \[\d+\] [^\n]*?:\d+: (.*)$", text, re.M):
        return f"skipped: {skipped[1]}"
    if asserted := re.findall(r"^E\s+(\S.*)$", text, re.M):
        return asserted[0][:300]
    return f"pytest exit {rc}: {last_error(text)}"


def _wait(proc: subprocess.Popen[Any], *, timeout_s: float) -> int | None:
    """The exit code, or None after killing the process group it leads (timeout)."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
                break
        return None


def _finish(rows: list[tuple[str, bool, str, float]], start: float) -> int:
    total = time.time() - start
    width = max(len(name) for name, *_ in rows) if rows else 10
    over = f" — over the {BUDGET_S} s budget" if total > BUDGET_S else ""
    print(f"\n== GPU checks: {sum(ok for _, ok, _, _ in rows)}/{len(rows)} passed in {total:.0f} s{over} ==")
    for name, ok, figure, seconds in rows:
        print(f"{name:<{width}} | {'pass' if ok else 'fail'} | {figure} ({seconds:.0f} s)")
    return 0 if rows and all(ok for _, ok, _, _ in rows) else 1


def _versions(*names: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    def one(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"no {name}"

    return ", ".join(one(n) for n in names)


# --- dry run ------------------------------------------------------------------------------------


def dry_run(checks: list[Check], *, full: bool, work: Path, wheels: Path | None) -> int:
    """Resolve everything ``run`` would run, without a GPU; print the table of what would run."""
    problems: list[str] = []
    files = [TRAIN, WHEELS, QWEN2_1P5B, REPO / "recipes" / "recipe" / "grpo_tiny.yaml",
             *sorted({REPO / c.node.split("::")[0] for c in checks})]
    problems += [f"missing file: {p.relative_to(REPO)}" for p in files if not p.is_file()]
    problems += wheel_problems(wheels)

    from hybridrl.bootstrap import TINY_MODEL
    from hybridrl.cli import build_parser
    from hybridrl.cli import main as hybridrl_main
    from hybridrl.models.tiny import TinyModelSpec, make_tiny_model

    parser = build_parser()
    model = work / "qwen2-1.5b"
    cli_problems: list[str] = []
    for cmd in (make_model_command(model), verify_command(model)):  # the CLI takes these arguments
        with _captured() as out:
            try:
                parser.parse_args(cmd[3:])
            except SystemExit:
                cli_problems.append(f"hybridrl {' '.join(cmd[3:])}: {out.getvalue().strip()}")
    if not cli_problems:  # and make-tiny-model accepts those sizes
        a = parser.parse_args(make_model_command(model)[3:])
        try:
            TinyModelSpec(arch=a.arch, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                          intermediate=a.intermediate, vocab=int(a.vocab), max_positions=a.max_positions, tie=a.tie)
        except ValueError as e:
            cli_problems.append(f"hybridrl make-tiny-model {' '.join(qwen2_1p5b_flags())}: {e}")
    problems += cli_problems

    commands: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="hybridrl-gpu-dry-") as tmp:
        with _captured():  # the recipe model's architecture (its weights are made on the first run)
            tiny = make_tiny_model(Path(tmp) / "tiny", **TINY_MODEL) / "config.json"
        for check in checks:
            if check.overrides is None:
                continue
            config = check.model_config or tiny
            argv = ["validate", *check.overrides(work), "--world-size", "1", "--model-config", str(config)]
            with _captured() as out:
                rc = hybridrl_main(argv)
            shown = " ".join(a if a != str(tiny) else "<tiny recipe model>/config.json" for a in argv)
            commands.append((check.name, f"hybridrl {shown}: {'ok' if rc == 0 else 'FAILED'}"))
            if rc != 0:
                problems.append(f"{check.name}: hybridrl {shown}:\n{out.getvalue().strip()}")

    collect = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              *[c.node for c in checks]], cwd=REPO, capture_output=True, text=True, check=False)
    if collect.returncode != 0:
        problems.append("pytest --collect-only of the check nodes failed:\n"
                        f"{collect.stdout[-3000:]}{collect.stderr[-2000:]}")

    print("== commands checked ==")
    for name, line in commands:
        print(f"{name}: {line}")
    print(f"hybridrl make-tiny-model OUT {' '.join(qwen2_1p5b_flags())} ({qwen2_1p5b_params() / 1e9:.2f}B "
          f"parameters, fp32) and hybridrl verify-model OUT --tp 1: {'FAILED' if cli_problems else 'ok'}")
    print(f"pytest collects {len(checks)} check nodes: {'ok' if collect.returncode == 0 else 'FAILED'}")
    print(f"wheels.txt ({', '.join(f'{n}=={v}' for n, v in wheel_pins())}), read by fetch_wheels.sh and run_all.sh"
          + (f"; {wheels} holds each, sha256 as in its MANIFEST.txt" if wheels else "") + ": "
          + ("FAILED" if any("wheel" in p for p in problems) else "ok"))
    for p in problems:
        print(f"PROBLEM: {p}")
    print("== what run_all.sh would run ==")
    width = max(len(c.name) for c in checks)
    for c in checks:
        when = "runs" if full or not c.full else "only with --full"
        print(f"{c.name:<{width}} | {when} | {c.node} (≤ {c.timeout_s} s): {c.shows}")
    default_s = sum(c.timeout_s for c in checks if not c.full)
    print(f"time limits of the default checks: {default_s} s in all (budget {BUDGET_S} s with the install)")
    print("dry run: OK" if not problems else f"dry run: {len(problems)} problem(s)")
    return 0 if not problems else 1


def wheel_pins() -> list[tuple[str, str]]:
    """``(name, version)`` of each line of wheels.txt (what fetch_wheels.sh fetches and run_all.sh installs)."""
    pins = []
    for raw in WHEELS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            pins.append((name.strip(), version.strip()) if sep else (line, ""))
    return pins


def wheel_problems(wheels: Path | None) -> list[str]:
    """wheels.txt pins exact versions; both scripts read it; ``wheels`` (if given) holds a verified copy of each."""
    import hashlib

    problems = [f"wheels.txt: {name!r} is not pinned (name==version)" for name, version in wheel_pins() if not version]
    for script in ("fetch_wheels.sh", "run_all.sh"):
        if "wheels.txt" not in (HERE / script).read_text():
            problems.append(f"{script} does not read wheels.txt: the list of wheels must live in one place")
    if wheels is None:
        return problems
    manifest = wheels / "MANIFEST.txt"
    if not manifest.is_file():
        return [*problems, f"{manifest}: missing (fill {wheels} with tests/gpu/fetch_wheels.sh)"]
    rows = [line.split("\t") for line in manifest.read_text().splitlines() if line and not line.startswith("#")]
    have = {_canonical(name): version for name, version, *_ in rows}
    for name, version in wheel_pins():
        if have.get(_canonical(name)) != version:
            problems.append(f"{wheels}: no {name}=={version} (it has {have.get(_canonical(name), 'none')}); "
                            "run fetch_wheels.sh again")
    import tomllib

    from packaging.requirements import Requirement

    for req in map(Requirement, tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]):
        if not req.specifier.contains(have.get(_canonical(req.name), "0"), prereleases=True):
            problems.append(f"{wheels}: no wheel for hybridrl's build requirement {req} (pip install -e . offline)")
    for _, _, sha, _, file in rows:
        path = wheels / file
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != sha:
            problems.append(f"{path}: missing or not the file MANIFEST.txt lists (sha256)")
    return problems


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@contextlib.contextmanager
def _captured() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        yield buf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_checks.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "dry-run"):
        sp = sub.add_parser(name)
        sp.add_argument("--full", action="store_true", help="also the checks that need Transformer Engine and SGLang")
        sp.add_argument("--wheels", type=Path, default=None, help="(dry-run) check this folder of fetched wheels")
    sub.add_parser("make-model", help="make the random ~1.5B Qwen2 under $HYBRIDRL_GPU_WORK")
    args = p.parse_args(argv)
    work = work_dir()
    if args.command == "make-model":
        print(qwen2_1p5b_model(work))
        return 0
    checks = [c for c in CHECKS if args.full or not c.full]
    if args.command == "dry-run":
        return dry_run(list(CHECKS), full=args.full, work=work, wheels=args.wheels)
    return run(checks, work=work)


if __name__ == "__main__":
    sys.exit(main())
