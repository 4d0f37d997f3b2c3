"""Writing a Hugging Face checkpoint: the bucketed weight stream as safetensors + config + tokenizer
(:func:`save_hf_checkpoint`), never over something it did not write (:func:`output_problem`).

Importing this module imports neither torch nor transformers; the writer imports what it needs.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridrl.hf.arch import CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE, SINGLE_FILE

if TYPE_CHECKING:
    import torch

    from hybridrl.interfaces import WeightBucket


# non-weight files of an HF checkpoint that travel with it
SIDE_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE, "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "tokenizer.model",
              # a vision-language model's processor: transformers 5's one file, and the hub's older layout
              "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
              "chat_template.json")
SHARD_BYTES = 4 << 30


def copy_side_files(source_dir: str | Path, out_dir: str | Path) -> None:
    """Copy the checkpoint's non-weight files (:data:`SIDE_FILES`, those present) into ``out_dir``."""
    for f in SIDE_FILES:
        if (Path(source_dir) / f).is_file():
            shutil.copy2(Path(source_dir) / f, Path(out_dir) / f)


SNAPSHOT_MARKER = ".hybridrl-snapshot.json"  # in each directory save_hf_checkpoint writes: its path and files


def output_problem(out_dir: str | Path, *, key: str, overwrite: bool = False,
                   overwrite_option: str | None = None, protect: Iterable[str | Path] = ()) -> str | None:
    """Why :func:`save_hf_checkpoint` must not write ``out_dir`` (None: it may). Reads only.

    Never a directory that is, lies inside or contains one of ``protect`` (e.g. the checkpoint exported
    from). Otherwise a missing or empty target is fine, and so is one that holds exactly the snapshot
    hybridrl wrote at this same path (replaced atomically); anything else only with ``overwrite``
    (``overwrite_option``: how the user says so, e.g. ``--overwrite``)."""
    given = Path(out_dir)
    out = given.resolve()
    for p in protect:
        kept = Path(p).resolve()
        if out == kept or kept in out.parents or out in kept.parents:
            where = "is" if out == kept else "is inside" if kept in out.parents else "contains"
            return (f"{key}={str(given)!r} {where} {kept}, which the save must leave as it is; "
                    "choose a directory outside it")
    if not os.path.lexists(given) or given.is_dir() and not any(given.iterdir()):
        return None
    if overwrite or _own_snapshot(given):
        return None
    entries = sorted(p.name for p in given.iterdir()) if given.is_dir() else []
    what = (f"holds {len(entries)} entries ({', '.join(entries[:3])}{', …' if len(entries) > 3 else ''})"
            if given.is_dir() else "is a file")
    how = f", or {overwrite_option} to replace it" if overwrite_option else ""
    return (f"{key}={str(given)!r} {what} that hybridrl did not write there; refusing to replace it: choose a "
            f"new or empty directory{how}")


def _own_snapshot(d: Path) -> bool:
    """``d`` holds exactly an HF snapshot that save_hf_checkpoint wrote at this path (its marker says so)."""
    try:
        marker = json.loads((d / SNAPSHOT_MARKER).read_text())
        return (marker["path"] == str(d.resolve())
                and {p.name for p in d.iterdir()} <= {*marker["files"], SNAPSHOT_MARKER})
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return False


def save_hf_checkpoint(stream: Iterable[WeightBucket], out_dir: str | Path, *, source_dir: str | Path,
                       key: str = "out_dir", overwrite: bool = False, overwrite_option: str | None = None,
                       protect: Iterable[str | Path] = (), config_updates: Mapping[str, Any] | None = None,
                       chat_template: bool = True) -> None:
    """Write an HF checkpoint (safetensors, shards of ≤ 4 GiB, + ``source_dir``'s side files) from the
    bucketed weight stream; ``config_updates``: keys of ``source_dir``'s config.json replaced in the copy (a
    reward model's ``architectures``, ``num_labels``); its ``quantization_config`` is dropped unless the weights
    written are FP8 (:func:`_update_config`). ``chat_template=False``: the tokenizer is saved without the source's
    chat template (a model trained on plain text, which a reader must not render as chat).

    Every rank must consume the stream (it is made of collectives); rank 0 writes. ``out_dir`` is checked
    first (:func:`output_problem`, decided by rank 0: every rank raises ``FileExistsError`` together, before
    streaming). The checkpoint is written into a temporary sibling directory, fsynced and renamed into
    place, so a crash mid-save never leaves a half-written directory at ``out_dir``; what was there is
    renamed aside and deleted only once the new one is in place.
    """
    import torch.distributed as dist

    out = Path(out_dir)
    distributed = dist.is_initialized()
    writer = dist.get_rank() == 0 if distributed else True
    problem = output_problem(out, key=key, overwrite=overwrite, overwrite_option=overwrite_option,
                             protect=protect) if writer else None
    if distributed:
        from hybridrl.distributed import host_group

        box = [problem]
        dist.broadcast_object_list(box, src=0, group=host_group.get())
        problem = box[0]
    if problem is not None:
        raise FileExistsError(problem)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for bucket in stream:
        if not writer:
            continue
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            if size and size + nbytes > SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = tensor.detach().to("cpu").contiguous().clone()
            size += nbytes
    if writer:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        _write(shards, tmp)
        copy_side_files(source_dir, tmp)
        _update_config(tmp / CONFIG_FILE, dict(config_updates or {}),
                       fp8=any(t.dtype.is_floating_point and t.element_size() == 1 for s in shards for t in s.values()))
        if not chat_template:
            _drop_chat_template(tmp)
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / SNAPSHOT_MARKER).write_text(json.dumps({"path": str(out.resolve()), "files": files}) + "\n")
        _fsync_tree(tmp)
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if os.path.lexists(out):
            os.rename(out, old)
        os.rename(tmp, out)
        _fsync_tree(out.parent, files=False)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        elif os.path.lexists(old):
            old.unlink()
    if distributed:
        dist.barrier()


def _update_config(path: Path, updates: dict[str, Any], *, fp8: bool) -> None:
    """Apply ``updates`` to the copied config.json; drop its ``quantization_config`` unless the written weights are
    FP8 (a model loaded from an FP8 checkpoint, :mod:`hybridrl.hf.fp8`, writes bf16/fp32: with it left in, engines
    and transformers would read those weights as e4m3 with block scales)."""
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    new = config | updates
    if not fp8:
        new.pop("quantization_config", None)
    if new != config:
        path.write_text(json.dumps(new, indent=2) + "\n")


def _drop_chat_template(d: Path) -> None:
    """The saved tokenizer without a chat template (transformers keeps it in chat_template.jinja or in
    tokenizer_config.json)."""
    (d / "chat_template.jinja").unlink(missing_ok=True)
    config = d / "tokenizer_config.json"
    if config.is_file():
        tokenizer = json.loads(config.read_text())
        if tokenizer.pop("chat_template", None) is not None:
            config.write_text(json.dumps(tokenizer, indent=2) + "\n")


def _fsync_tree(d: Path, *, files: bool = True) -> None:
    """fsync ``d``'s files (when ``files``; one level: an HF snapshot is flat) and then ``d`` itself."""
    if files:
        for p in d.iterdir():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(shards: list[dict[str, torch.Tensor]], d: Path) -> None:
    from safetensors.torch import save_file

    if len(shards) == 1:
        save_file(shards[0], str(d / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(d / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in shard}
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / INDEX_FILE).write_text(json.dumps(index, indent=2))
