"""Write an HF checkpoint (safetensors + config + tokenizer) from the bucketed weight stream.

Every rank must consume the stream (it is made of collectives); rank 0 writes. The checkpoint is
written into a temporary sibling directory and renamed into place, so a crash mid-save never leaves
a half-written directory at ``out_dir`` (and an existing one is replaced only once the new one is whole).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from hybridrl.interfaces import WeightBucket

# non-weight files of an HF checkpoint that travel with it
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "tokenizer.model")
SHARD_BYTES = 4 << 30


def save_hf_checkpoint(stream: Iterable[WeightBucket], out_dir: str | Path, *, source_dir: str | Path) -> None:
    out = Path(out_dir)
    writer = dist.get_rank() == 0 if dist.is_initialized() else True
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
        for f in SIDE_FILES:
            if (Path(source_dir) / f).is_file():
                shutil.copy2(Path(source_dir) / f, tmp / f)
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        if old.exists():
            shutil.rmtree(old)
    if dist.is_initialized():
        dist.barrier()


def _write(shards: list[dict[str, torch.Tensor]], d: Path) -> None:
    if len(shards) == 1:
        save_file(shards[0], str(d / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(d / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in shard}
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
