"""``hybridrl validate`` on a fresh machine: what the run will build is pending, not an error."""

import os
import subprocess
import sys
from pathlib import Path


def test_validate_recipe_before_its_start_model_is_built(tmp_path: Path) -> None:
    env = dict(os.environ, HYBRIDRL_CACHE_DIR=str(tmp_path / "empty-cache"))
    r = subprocess.run([sys.executable, "-m", "hybridrl.cli", "validate", "recipe=grpo_tiny"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert f"{tmp_path / 'empty-cache'}/tiny/sft-qwen2 does not exist yet: the run builds it first" in r.stdout
    assert "build_if_missing=sft:sft_tiny" in r.stdout and r.stdout.strip().endswith("config OK")
    assert not (tmp_path / "empty-cache").exists()  # validating builds nothing


def test_validate_still_reports_a_missing_model_nobody_builds(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "hybridrl.cli", "validate", "recipe=grpo_tiny",
                        f"actor_rollout_ref.model.path={tmp_path / 'nope'}",
                        "actor_rollout_ref.model.build_if_missing=null"], capture_output=True, text=True)
    assert r.returncode == 2
    assert f"actor_rollout_ref.model.path='{tmp_path / 'nope'}'" in r.stderr and "does not exist" in r.stderr
