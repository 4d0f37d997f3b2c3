"""What a LoRA checkpoint records about its base (``step_<k>/lora.json``), and the check that a resume or an
export uses the same base.

A LoRA checkpoint's ``megatron/`` holds only the adapters and their optimizer state (the frozen base is not
copied into every checkpoint); ``lora.json`` names the base model directory, its SHA-256 (over the bytes of
its safetensors files, in file-name order) and the LoRA settings. Loading it onto another base — a different
path whose weights differ, or the same path rewritten since — is an error naming both.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hybridrl.hf.tensors import tensor_files
from hybridrl.lora.config import LoRAConfig

LORA_RECORD = "lora.json"


def base_fingerprint(model_dir: str | Path) -> str:
    """SHA-256 of the base's safetensors files (cached per path, size and mtime: hashed once per run)."""
    files = sorted(set(tensor_files(model_dir).values()))
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _hash_files(key)


@functools.cache
def _hash_files(key: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for path, _, _ in key:
        h.update(Path(path).name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def write_record(step_dir: Path, *, cfg: LoRAConfig, base_model: str, dtype: str) -> None:
    record = {"base_model": str(Path(base_model).resolve()), "base_sha256": base_fingerprint(base_model),
              "dtype": dtype, "lora": asdict(cfg)}
    (step_dir / LORA_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def read_record(step_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's LoRA record; None for a full fine-tuning checkpoint."""
    path = step_dir / LORA_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def record_config(record: dict[str, Any]) -> LoRAConfig:
    lora = dict(record["lora"])
    return LoRAConfig(rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"],
                      projections=tuple(lora["projections"]))


def check_base(step_dir: Path, record: dict[str, Any] | None, *, lora: LoRAConfig | None, base_model: str,
               key: str = "actor_rollout_ref.model") -> None:
    """Raise ``ValueError`` unless ``step_dir`` (with ``record``) can load into a model with ``lora`` on
    ``base_model``: LoRA on both or neither, the same LoRA shape, and the same base weights."""
    if record is None and lora is None:
        return
    if record is None:
        raise ValueError(f"{key}.lora_rank={lora.rank if lora else 0}: {step_dir} is a full fine-tuning checkpoint "
                         f"(no {LORA_RECORD}); resume it with {key}.lora_rank=0, or start a new run")
    if lora is None:
        raise ValueError(f"{key}.lora_rank=0: {step_dir} is a LoRA checkpoint (adapters only); resume it with "
                         f"{key}.lora_rank={record['lora']['rank']}")
    saved = record_config(record)
    if (saved.rank, saved.projections) != (lora.rank, lora.projections):
        raise ValueError(f"{key}.lora_rank={lora.rank}, target_modules={list(lora.projections)}: {step_dir} holds "
                         f"adapters of rank {saved.rank} on {list(saved.projections)}; resume with those")
    now = base_fingerprint(base_model)
    if now != record["base_sha256"]:
        raise ValueError(f"{key}.path={base_model}: {step_dir} holds LoRA adapters trained on the base "
                         f"{record['base_model']} (SHA-256 {record['base_sha256'][:12]}…), but this base's weights "
                         f"hash to {now[:12]}…; adapters only fit the base they were trained on")
