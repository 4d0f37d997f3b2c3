"""The checkpoint directory's rules, on plain files (no training): manifest, ``latest``, the commit order
under a crash at every step of it, retention, other histories moved aside, changed settings on resume,
RNG state that loads with ``weights_only=True``. The same code under real training runs and SIGKILLs:
``tests/checkpoint/test_checkpoint.py``."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import hybridrl.checkpoint.layout as ckpt_layout
import hybridrl.checkpoint.rl as ckpt
from hybridrl.checkpoint.rl import (
    LATEST,
    MANIFEST,
    changed_settings,
    checkpoint_problem,
    commit,
    latest_complete,
    remove_scratch,
    set_aside_other_histories,
    step_dirs,
)
from hybridrl.config.errors import CheckpointError
from hybridrl.config.schema import RLConfig


def save(root: Path, step: int, *, keep: int = 0, payload: str = "") -> Path:
    """A checkpoint with a small and a large (9 MiB) file, committed like save_checkpoint does."""
    remove_scratch(root)
    tmp = root / f".tmp_step_{step:08d}"
    (tmp / "megatron").mkdir(parents=True)
    (tmp / "trainer_state.pt").write_text(f"state of step {step} {payload}")
    (tmp / "megatron" / "__0_0.distcp").write_bytes(bytes(9 << 20))
    final = root / f"step_{step:08d}"
    commit(tmp, final, step=step, keep=keep)
    return final


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_manifest_and_latest_are_written_and_a_damaged_newest_falls_back(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    s1, s2 = save(tmp_path, 1), save(tmp_path, 2)
    assert (tmp_path / LATEST).read_text() == "step_00000002\n" and (s2 / MANIFEST).is_file()
    assert checkpoint_problem(s2) is None and latest_complete(tmp_path) == s2
    (s2 / "trainer_state.pt").write_text("state of step 2 but different")
    assert checkpoint_problem(s2) == "trainer_state.pt has 29 bytes, manifest.json says 16"
    (s2 / "trainer_state.pt").write_text("state of step 2 ")
    with (s2 / "megatron" / "__0_0.distcp").open("r+b") as f:  # one bit of a large shard flips: its hash says so
        f.seek(7 << 20)
        f.write(b"\x01")
    assert checkpoint_problem(s2) == "megatron/__0_0.distcp does not match its SHA-256 in manifest.json"
    with (s2 / "megatron" / "__0_0.distcp").open("r+b") as f:
        f.truncate(10)
    assert checkpoint_problem(s2) == f"megatron/__0_0.distcp has 10 bytes, manifest.json says {9 << 20}"
    assert latest_complete(tmp_path) == s1
    assert f"not resuming from {s2}: megatron/__0_0.distcp has 10 bytes" in capsys.readouterr().out
    (s1 / "trainer_state.pt").write_text("state of step 9 ")  # same size, other content
    assert checkpoint_problem(s1) == "trainer_state.pt does not match its SHA-256 in manifest.json"
    with pytest.raises(CheckpointError) as e:  # none usable: the run stops, never a silent start at step 0
        latest_complete(tmp_path)
    assert str(e.value).startswith(f"trainer.resume=auto: no checkpoint in {tmp_path} can be resumed: "
                                   "step_00000002: megatron/__0_0.distcp has 10 bytes")
    assert "step_00000001: trainer_state.pt does not match its SHA-256" in str(e.value)
    assert "set trainer.resume=never" in str(e.value) and names(tmp_path) == ["latest", "step_00000001",
                                                                               "step_00000002"]
    (s1 / MANIFEST).unlink()
    assert str(checkpoint_problem(s1)).startswith("no manifest.json: its save did not finish")


def test_resume_from_an_older_step_keeps_the_new_history(tmp_path: Path) -> None:
    """Issue 11: with step_{10,20,30}, a run resumed from step_10 that saves step 15 at
    max_checkpoints_to_keep=1 kept only step_30 (and resume=auto then took it); now step_20 and step_30 are
    moved aside at start, retention deletes only step_10, and resume=auto takes step_15."""
    s10 = save(tmp_path, 10)
    save(tmp_path, 20)
    save(tmp_path, 30)
    aside = set_aside_other_histories(tmp_path, resumed=s10)
    assert aside is not None and aside.name.startswith("abandoned-") and names(aside) == ["step_00000020",
                                                                                        "step_00000030"]
    assert (tmp_path / LATEST).read_text() == "step_00000010\n"
    s15 = save(tmp_path, 15, keep=1)
    assert [p.name for _, p in step_dirs(tmp_path)] == ["step_00000015"] and latest_complete(tmp_path) == s15
    assert all(checkpoint_problem(p) is None for p in aside.iterdir())  # nothing was deleted


def test_retention_never_deletes_a_newer_checkpoint(tmp_path: Path) -> None:
    save(tmp_path, 10)
    save(tmp_path, 30)
    (tmp_path / LATEST).write_text("step_00000010\n")  # step 30 written by someone else, never committed here
    save(tmp_path, 15, keep=1)
    assert [s for s, _ in step_dirs(tmp_path)] == [15, 30]
    assert latest_complete(tmp_path) == tmp_path / "step_00000015"  # latest, not the uncommitted newer one


@pytest.mark.parametrize("resumed", [None, "elsewhere"])
def test_a_fresh_run_or_a_resume_from_elsewhere_moves_every_checkpoint_aside(tmp_path: Path,
                                                                            resumed: str | None) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    save(root, 1)
    save(root, 2)
    other = save(tmp_path / "other" / "checkpoints", 7) if resumed else None
    aside = set_aside_other_histories(root, resumed=other)
    assert aside is not None and names(aside) == ["step_00000001", "step_00000002"]
    assert step_dirs(root) == [] and not (root / LATEST).exists() and latest_complete(root) is None


def test_incomplete_step_dirs_are_skipped_and_never_pruned(tmp_path: Path) -> None:
    save(tmp_path, 1)
    (tmp_path / "step_00000002").mkdir()  # e.g. half copied by hand: no manifest
    assert latest_complete(tmp_path) == tmp_path / "step_00000001"
    save(tmp_path, 3, keep=1)
    assert [s for s, _ in step_dirs(tmp_path)] == [2, 3]


def test_resaving_a_step_replaces_it_only_once_the_new_one_is_whole(tmp_path: Path) -> None:
    save(tmp_path, 1)
    save(tmp_path, 2, payload="old")
    s2 = save(tmp_path, 2, payload="new")
    assert (s2 / "trainer_state.pt").read_text().endswith("new") and checkpoint_problem(s2) is None
    assert names(tmp_path) == [LATEST, "step_00000001", "step_00000002"]


class Crash(Exception):
    pass


def save_crashing(root: Path, step: int, *, keep: int, crash_at: int, monkeypatch: pytest.MonkeyPatch) -> bool:
    """``save``, with its ``crash_at``-th rename/replace/rmtree raising instead (True if it did)."""
    real = {"rename": os.rename, "replace": os.replace, "rmtree": shutil.rmtree}
    calls = [0]

    def failing(name: str, *args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == crash_at:
            raise Crash(name)
        return real[name](*args, **kwargs)  # type: ignore[operator]

    monkeypatch.setattr(ckpt_layout.os, "rename", lambda *a, **k: failing("rename", *a, **k))
    monkeypatch.setattr(ckpt_layout.os, "replace", lambda *a, **k: failing("replace", *a, **k))
    monkeypatch.setattr(ckpt_layout.shutil, "rmtree", lambda *a, **k: failing("rmtree", *a, **k))
    try:
        save(root, step, keep=keep, payload="new")
        return False
    except Crash:
        return True
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("resave", [False, True])
def test_a_crash_at_any_point_of_a_commit_leaves_a_complete_checkpoint_to_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resave: bool) -> None:
    """Every file-system mutation of ``commit`` (renames, ``latest``, retention) is made to fail in turn, as
    a SIGKILL there would stop it: what remains always resolves to a complete checkpoint, the new one or
    the last committed one, and the next save cleans up."""
    for crash_at in range(1, 20):
        root = tmp_path / str(crash_at)
        root.mkdir()
        for s in (1, 2, *((3,) if resave else ())):
            save(root, s, keep=3)
        crashed = save_crashing(root, 3, keep=2, crash_at=crash_at, monkeypatch=monkeypatch)
        found = latest_complete(root)
        assert found is not None and checkpoint_problem(found) is None, (crash_at, names(root))
        assert found.name in ("step_00000002", "step_00000003"), (crash_at, found)
        if not crashed:  # every mutation has been crashed at
            assert crash_at == (7 if resave else 5)
            return
        save(root, 4, keep=2)  # the next save cleans up what the crash left
        assert [p for p in names(root) if p.startswith(".")] == [], (crash_at, names(root))
        assert latest_complete(root) == root / "step_00000004"
    pytest.fail("commit made more file-system mutations than expected")


def test_changed_optimizer_settings_are_listed_and_a_changed_optimizer_kind_is_rejected(tmp_path: Path) -> None:
    cfg = RLConfig()
    cfg.trainer.total_training_steps = 100  # as resolve_total_steps leaves it before a resume compares
    saved = OmegaConf.create({"actor_rollout_ref": {"actor": {"optim": {
        **OmegaConf.to_container(OmegaConf.structured(cfg.actor_rollout_ref.actor.optim)),  # type: ignore[dict-item]
        "lr": 5e-7, "lr_decay_style": "cosine"}}}, "trainer": {"total_training_steps": 10}})
    assert changed_settings(saved, cfg, path=tmp_path) == [
        ("actor_rollout_ref.actor.optim.lr", 5e-7, 1e-6),
        ("actor_rollout_ref.actor.optim.lr_decay_style", "cosine", "constant"),
        ("trainer.total_training_steps", 10, 100)]
    saved.actor_rollout_ref.actor.optim.optimizer = "sgd"
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.optim.optimizer=adam: .* was saved with "
                                         r"actor_rollout_ref.actor.optim.optimizer=sgd .* resume with "
                                         r"actor_rollout_ref.actor.optim.optimizer=sgd"):
        changed_settings(saved, cfg, path=tmp_path)


def test_rng_state_loads_with_weights_only(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.save(ckpt._rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    ckpt._set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
