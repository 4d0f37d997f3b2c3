"""Cached start models: reused while their recipe is unchanged, rebuilt once it changes, user models kept."""

import json
from pathlib import Path

import pytest

from hybridrl import bootstrap
from hybridrl.bootstrap import BUILD_INFO, _once, _sft_build_key, _stale_build


def test_build_key_follows_the_recipe_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "recipe").mkdir()
    recipe = tmp_path / "recipe" / "my_sft.yaml"
    recipe.write_text("optim:\n  lr: 1e-3\n")
    monkeypatch.setattr(bootstrap, "recipes_dir", lambda: tmp_path)
    first = _sft_build_key("my_sft")
    assert _sft_build_key("my_sft") == first
    recipe.write_text("optim:\n  lr: 3e-3\n")
    assert _sft_build_key("my_sft") != first
    monkeypatch.setattr(bootstrap, "TINY_MODEL", {**bootstrap.TINY_MODEL, "hidden": 64})
    recipe.write_text("optim:\n  lr: 1e-3\n")
    assert _sft_build_key("my_sft") != first


def test_build_key_follows_the_recipes_it_starts_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sft_tiny_early is ``defaults: [sft_tiny, _self_]`` plus a target: a change to sft_tiny changes it too (its
    cached student was kept when only the parent recipe changed)."""
    (tmp_path / "recipe").mkdir()
    parent = tmp_path / "recipe" / "base_sft.yaml"
    parent.write_text("trainer:\n  target_accuracy: 0.45\n")
    (tmp_path / "recipe" / "early.yaml").write_text("defaults:\n  - base_sft\n  - _self_\ntrainer:\n"
                                                    "  target_accuracy: 0.2\n")
    monkeypatch.setattr(bootstrap, "recipes_dir", lambda: tmp_path)
    first = _sft_build_key("early")
    parent.write_text("trainer:\n  target_accuracy: 0.45\n  test_freq: 50\n")
    assert _sft_build_key("early") != first


def test_build_key_ignores_the_settings_of_builds_the_recipe_does_not_name(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding the GSM8K task's settings to every key rebuilt grpo_tiny's cached arithmetic start model."""
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "arith.yaml").write_text("data:\n  build_if_missing: arithmetic\n")
    (tmp_path / "recipe" / "gsm.yaml").write_text("model:\n  build_if_missing: tiny_bpe\n")
    monkeypatch.setattr(bootstrap, "recipes_dir", lambda: tmp_path)
    arith, gsm = _sft_build_key("arith"), _sft_build_key("gsm")
    monkeypatch.setattr(bootstrap, "TINY_BPE", {**bootstrap.TINY_BPE, "vocab_size": 1024})
    assert _sft_build_key("arith") == arith and _sft_build_key("gsm") != gsm


def test_stale_only_when_built_here_from_other_inputs(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    assert not _stale_build(model, "k1")  # no build info: the user's own model, used as is
    (model / BUILD_INFO).write_text(json.dumps({"recipe": "sft_tiny", "key": "k1"}))
    assert not _stale_build(model, "k1")
    assert _stale_build(model, "k2")
    (model / BUILD_INFO).write_text("{not json")
    assert _stale_build(model, "k1")


def test_once_builds_while_needed_and_not_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "model"
    builds = []

    def build() -> None:
        builds.append(1)
        out.mkdir(exist_ok=True)
        (out / BUILD_INFO).write_text(json.dumps({"key": "new"}))

    def needed() -> bool:
        return not out.exists() or _stale_build(out, "new")

    _once([out], build, needed)
    _once([out], build, needed)
    assert len(builds) == 1
    (out / BUILD_INFO).write_text(json.dumps({"key": "old"}))  # recipe changed since
    _once([out], build, needed)
    assert len(builds) == 2


def test_built_data_is_rebuilt_when_its_generator_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Data built from an older generator (here: another build key) is written again; data without build info is
    the user's and kept, as are up-to-date builds."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path))
    train, test = tmp_path / "tiny" / "products" / "train.parquet", tmp_path / "tiny" / "products" / "test.parquet"
    bootstrap.ensure_data("products", [str(train)], [str(test)])
    info = train.with_name(f".train.{bootstrap.DATA_BUILD_INFO}")
    assert json.loads(info.read_text()) == {"kind": "products", "key": bootstrap._data_build_key("products")}
    mtime = train.stat().st_mtime_ns
    bootstrap.ensure_data("products", [str(train)], [str(test)])
    assert train.stat().st_mtime_ns == mtime  # up to date: not written again
    info.write_text(json.dumps({"kind": "products", "key": "older"}))
    bootstrap.ensure_data("products", [str(train)], [str(test)])
    assert train.stat().st_mtime_ns != mtime and json.loads(info.read_text())["key"] != "older"
    info.unlink()
    mtime = train.stat().st_mtime_ns
    bootstrap.ensure_data("products", [str(train)], [str(test)])
    assert train.stat().st_mtime_ns == mtime  # no build info: the user's file, kept
