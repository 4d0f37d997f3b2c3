"""``hybridrl validate`` on a fresh machine: what the run will build is pending, not an error."""

import glob
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridrl.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_missing_user_model_path_is_a_config_error_and_nothing_is_built(tmp_path: Path) -> None:
    """``build_if_missing`` builds only inside the hybridrl cache: a typo in a user's model path must not
    start the SFT bootstrap there (it used to write a tiny arithmetic model at the typo)."""
    cache, typo = tmp_path / "cache", tmp_path / "my-models" / "Qwen2.5-7B-Instrcut"
    env = dict(os.environ, HYBRIDRL_CACHE_DIR=str(cache))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "recipe=grpo_tiny",
                        f"actor_rollout_ref.model.path={typo}"], capture_output=True, text=True, env=env, timeout=120)
    took = time.perf_counter() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"actor_rollout_ref.model.path='{typo}': does not exist" in r.stderr
    assert "builds only inside the hybridrl cache" in r.stderr
    assert not typo.parent.exists() and not (cache / "tiny" / "sft-qwen2").exists()  # nothing built anywhere
    print(f"rejected in {took:.1f} s")


@pytest.mark.slow
def test_every_run_command_in_the_readme_validates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The ``torchrun ... launch/train.py`` lines of README.md and every docs/*.md page (and their ``launch/sft.py``,
    ``dpo.py`` and ``rm.py`` lines, with their trainer's checks) pass ``hybridrl validate`` at their world size (the
    same files, in the same order, as the project's before-stop hook reads). In this process: ``hybridrl validate`` is
    ``main(["validate", ...])`` (one interpreter start per line cost CI ~70 s)."""
    files = [REPO / "README.md", *sorted(glob.glob(str(REPO / "docs" / "*.md")))]
    text = "\n".join(open(f).read() for f in files).replace("\\\n", " ")
    runs = [m for m in re.finditer(r"(?:torchrun\s+(.*?)|python\s+)launch/(train|sft|dpo|rm)\.py\s+(.*)", text)]
    assert len(runs) >= 3 and {m.group(2) for m in runs} == {"train", "sft", "dpo", "rm"}
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path / "cache"))
    commands: dict[tuple[str, ...], str] = {}  # each distinct command once (pages repeat the quick starts)
    for m in runs:  # the offline launchers' lines with their own trainer's checks
        n = re.search(r"--nproc[-_]per[-_]node[= ](\d+)", m.group(1) or "")
        args = [a for a in shlex.split(m.group(3).split("#")[0].split("`")[0]) if "=" in a and not a.startswith("--")]
        trainer = "rl" if m.group(2) == "train" else m.group(2)
        commands.setdefault((*args, "--trainer", trainer, "--world-size", n.group(1) if n else "1"), m.group(0))
    # docs/multi-turn.md's agent command: another environment by its one key, the recipe's environment_kwargs stay
    assert any("actor_rollout_ref.rollout.multi_turn.environment=openai_agent" in c for c in commands), commands
    for command, line in commands.items():
        code = main(["validate", *command])
        assert code == 0, (line, capsys.readouterr().err)


def test_planning_for_another_machine_imports_no_backend() -> None:
    """``hybridrl validate --model-config``: config, plan and the plugins' own config checks — no Megatron,
    transformers or pyarrow (they cost seconds, and the planning machine may not even have them working)."""
    code = ("import sys\nfrom hybridrl.cli import main\n"
            "try:\n    main(['validate', 'recipe=grpo_qwen7b', '--model-config', "
            f"{str(REPO / 'recipes' / 'model_configs' / 'qwen2.5-7b.json')!r}, '--world-size', '8'])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('IMPORTED', sorted(m for m in ('megatron.core', 'transformers', 'pyarrow') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "config OK" in r.stdout and "IMPORTED []" in r.stdout, r.stdout[-2000:]
