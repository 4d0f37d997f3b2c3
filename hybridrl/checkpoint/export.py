"""``hybridrl export-hf CKPT OUT``: a training checkpoint's actor → an HF checkpoint (safetensors + config +
tokenizer) that transformers loads and ``verify-model`` accepts.

The Megatron shards are loaded into one process at TP=1, PP=1 (``dist_checkpointing`` reshards from
whatever layout saved them) and written through the same bucketed HF stream as weight sync (a vision-language
model's tower with it: from the checkpoint, or a LoRA run's frozen one from its base model).
Memory: the whole model in fp32 on this machine's CPU.

OUT must be new or empty, or hold an earlier export to the same path (replaced atomically); anything
else needs ``--overwrite``, and OUT may never be, lie inside or contain CKPT.

A LoRA checkpoint (``lora.json``: adapters only, :mod:`hybridrl.lora.checkpoint`) is loaded onto the base model
it names, after checking the base's SHA-256; ``--merged`` (default) writes W + (alpha/r)·B·A through the same
stream as the engine's weight sync (bitwise the engine's weights), ``--adapter`` a peft adapter folder
(:mod:`hybridrl.lora.peft`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.core import dist_checkpointing

from hybridrl.hf.arch import HFArch
from hybridrl.hf.write import output_problem, save_hf_checkpoint
from hybridrl.lora.checkpoint import LORA_RECORD, check_base, read_record, record_config
from hybridrl.lora.peft import write_peft_adapter
from hybridrl.megatron.lora import apply_lora, is_lora_name
from hybridrl.megatron.model import TORCH_DTYPES, build_model_chunks
from hybridrl.megatron.parallel import ParallelConfig, destroy_parallel, init_parallel
from hybridrl.megatron.weights import export_hf_weights, load_hf_weights
from hybridrl.vlm.megatron_vlm import attach_vision_tower

KEY = "export-hf OUT"


def export_hf(ckpt: Path, out: Path, *, overwrite: bool = False, adapter: bool = False) -> None:
    if not (ckpt / "megatron").is_dir() or not (ckpt / "hf" / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt} is not a hybridrl checkpoint (expected megatron/ and hf/config.json; "
                                f"checkpoints live in <trainer.output_dir>/checkpoints/step_<k>)")
    record = read_record(ckpt)
    if adapter and record is None:
        raise ValueError(f"--adapter: {ckpt} is a full fine-tuning checkpoint (no {LORA_RECORD}); use --merged")
    if (problem := output_problem(out, key=KEY, overwrite=overwrite, overwrite_option="--overwrite",
                                  protect=[ckpt])) is not None:
        raise FileExistsError(problem)  # before loading anything
    if record is not None:
        check_base(ckpt, record, lora=record_config(record), base_model=record["base_model"], key="the base model")
    parallel = ParallelConfig()
    init_parallel(parallel)
    try:
        arch = HFArch.from_hf(ckpt / "hf")
        dtype = saved_dtype(ckpt / "megatron") if record is None else record["dtype"]
        (model,) = build_model_chunks(arch, parallel, dtype=dtype)  # TP=1, PP=1: one chunk
        lora = None
        if arch.vision is not None:  # a VLM's tower: in the checkpoint, or (LoRA: frozen) the base model's
            attach_vision_tower([model], arch, None if record is None else record["base_model"],
                                dtype=TORCH_DTYPES[dtype], trainable=False)
        if record is not None:  # the base from its directory, the adapters from the checkpoint
            load_hf_weights([model], arch, record["base_model"])
            lora = apply_lora([model], arch, record_config(record))
        state = {k: v for k, v in model.sharded_state_dict().items() if lora is None or is_lora_name(k)}
        loaded = dist_checkpointing.load({"model": state}, str(ckpt / "megatron"))
        model.load_state_dict(loaded["model"], strict=lora is None)
        if lora is not None and adapter:
            write_peft_adapter(lora.gather(), lora.cfg, out, base_model=record["base_model"])  # type: ignore[index]
            return
        save_hf_checkpoint(export_hf_weights([model], arch, bucket_bytes=512 << 20,
                                             merge=None if lora is None else lora.merger()),
                           out, source_dir=ckpt / "hf", key=KEY, overwrite=overwrite, overwrite_option="--overwrite",
                           protect=[ckpt])
    finally:
        destroy_parallel()


def saved_dtype(megatron_dir: Path) -> str:
    """The ``megatron.dtype`` whose parameters the checkpoint holds (its embedding's dtype)."""
    saved = dist_checkpointing.load_tensors_metadata(str(megatron_dir))["embedding.word_embeddings.weight"].dtype
    return next(name for name, dtype in TORCH_DTYPES.items() if dtype == saved)


def main(args: argparse.Namespace) -> int:
    try:
        export_hf(Path(args.ckpt), Path(args.out), overwrite=args.overwrite, adapter=args.adapter)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"hybridrl export-hf: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0
