"""``tests/gpu/run_all.sh --dry-run`` on CPU: every command the GPU checks would run resolves (each check's
overrides compose and validate for a CUDA run, the CLI arguments parse, the check modules import and
their nodes exist, the wheel list is the one both scripts read), and every check is listed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECKS = {  # the (a), (b) and, behind --full, (c)
    "grpo_tiny": "runs", "qwen2_1p5b_rl_step": "runs", "qwen2_1p5b_verify": "runs", "fused_logprob": "runs",
    "packing_thd": "runs", "optimizer_cpu_offload": "only with --full",
    "grpo_tiny_sglang_te": "only with --full", "qwen2_1p5b_rl_step_sglang_te": "only with --full",
    "sglang_swap_memory_saver": "only with --full", "sglang_swap_time_per_gb": "only with --full",
    "sglang_per_sample_seeds": "only with --full", "grpo_moe_tiny_vllm_r3": "only with --full",
    "grpo_moe_tiny_sglang_r3": "only with --full",
}


@pytest.mark.slow
def test_run_all_dry_run_resolves_every_check(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "HYBRIDRL_GPU_WORK": str(tmp_path)}
    proc = subprocess.run(["bash", "tests/gpu/run_all.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    table = proc.stdout.split("== what run_all.sh would run ==")[1].splitlines()
    listed = {line.split(" | ")[0].strip(): line.split(" | ")[1] for line in table if " | " in line}
    assert listed == CHECKS, listed
    assert "dry run: OK" in proc.stdout
    assert not (tmp_path / "qwen2-1.5b").exists()  # a dry run makes no model
