"""HF snapshots never clobber (``save_hf_checkpoint``: ``export-hf``, ``trainer.save_path``, the checkpoints'
``hf/``), and a damaged safetensors file is named when it is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hybridrl.checkpoint.export import export_hf
from hybridrl.hf.tensors import SafetensorsReader
from hybridrl.hf.write import SNAPSHOT_MARKER, save_hf_checkpoint
from hybridrl.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden=32, layers=1, heads=2, kv_heads=1)


def write(tiny: Path, out: Path, **kwargs: object) -> None:
    state = load_file(tiny / "model.safetensors")
    save_hf_checkpoint([list(state.items())], out, source_dir=tiny, key="trainer.save_path", **kwargs)  # type: ignore[arg-type]


def test_a_folder_with_other_files_is_refused_unless_overwrite(tiny: Path, tmp_path: Path) -> None:
    """Issue 11: the folder at the output path was deleted, unrelated files with it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"trainer.save_path='.*/out' holds 1 entries \(notes.txt\) that "
                                              r"hybridrl did not write there; refusing to replace it: choose a new "
                                              r"or empty directory, or trainer.overwrite_save_path=true to replace"):
        write(tiny, out, overwrite_option="trainer.overwrite_save_path=true")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    write(tiny, out, overwrite=True)
    assert (out / "model.safetensors").is_file() and not (out / "notes.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary or old directory left


def test_an_earlier_snapshot_at_the_same_path_is_replaced_but_not_once_someone_added_files(
        tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "snap"
    write(tiny, out)
    assert json.loads((out / SNAPSHOT_MARKER).read_text())["path"] == str(out.resolve())
    write(tiny, out)  # a re-run of the same SFT recipe: replaced atomically
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)  # a copy elsewhere is not "the snapshot written at this path"
    with pytest.raises(FileExistsError, match="moved"):
        write(tiny, moved)
    (out / "eval_results.json").write_text("{}")
    with pytest.raises(FileExistsError, match=r"holds \d+ entries"):
        write(tiny, out)
    assert (out / "eval_results.json").is_file()


@pytest.mark.parametrize("where", ["same", "inside", "containing"])
def test_a_target_that_is_inside_or_contains_the_protected_directory_is_refused(
        tiny: Path, tmp_path: Path, where: str) -> None:
    kept = tmp_path / "ckpt"
    kept.mkdir()
    (kept / "trainer_state.pt").write_text("x")
    out = {"same": kept, "inside": kept / "hf", "containing": tmp_path}[where]
    verb = {"same": "is", "inside": "is inside", "containing": "contains"}[where]
    with pytest.raises(FileExistsError, match=f"{verb} {kept}, which the save must leave as it is"):
        write(tiny, out, overwrite=True, protect=[kept])
    assert (kept / "trainer_state.pt").read_text() == "x"


def test_export_hf_into_its_own_checkpoint_is_refused_before_loading(tmp_path: Path) -> None:
    """Issue 11: ``export-hf CKPT CKPT`` deleted the checkpoint."""
    ckpt = tmp_path / "step_00000002"
    (ckpt / "megatron").mkdir(parents=True)
    (ckpt / "hf").mkdir()
    (ckpt / "hf" / "config.json").write_text("{}")
    for out in (ckpt, ckpt / "hf", tmp_path):
        with pytest.raises(FileExistsError, match=f"export-hf OUT='{out}' "):
            export_hf(ckpt, out, overwrite=True)
    assert sorted(p.name for p in ckpt.iterdir()) == ["hf", "megatron"]


def test_a_damaged_shard_is_named_when_read(tiny: Path, tmp_path: Path) -> None:
    d = tmp_path / "sharded"
    shutil.copytree(tiny, d)
    names = list(load_file(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    (d / "model-00001-of-00001.safetensors").write_bytes(b"garbage" * 10)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}))
    with SafetensorsReader(d) as reader, pytest.raises(
            ValueError, match=f"{d / 'model-00001-of-00001.safetensors'}: tensor '{names[0]}' is not readable"):
        reader.read(names[0])
