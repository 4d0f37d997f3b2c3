"""``hybridrl validate`` for the offline trainers' recipes: SFT (``launch/sft.py``), DPO (``launch/dpo.py``) and the
reward model (``launch/rm.py``) — compose with the trainer's own root, run its checks, print its layout and the
largest rank's memory.

Which trainer a recipe is for: ``--trainer``, else its name (``sft_*``, ``dpo_*``, ``rm_*``; anything else is an
RL recipe). Memory (:func:`hybridrl.config.memory.estimate`, the RL plan's model): the trained model's weights,
gradients and optimizer state, DPO's frozen reference (none under LoRA), and the activations of one micro-batch of
``2 × data.micro_batch_size_per_gpu`` sequences (pairs) or ``data.micro_batch_size_per_gpu`` (SFT) of the longest
length; a reward model computes no vocabulary logits. A model state over ``trainer.device_memory_gb`` (null: the
visible GPU's; 80 when planning with ``--model-config``; unchecked on a machine without a GPU) is refused, a peak over
it (activations are estimates) is a note.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.layout import RoleLayout
from hybridrl.config.memory import GB, MemoryEstimate, estimate
from hybridrl.hf.arch import HFArch
from hybridrl.lora.config import resolve_targets

TRAINERS = {"sft": "launch/sft.py", "dpo": "launch/dpo.py", "rm": "launch/rm.py"}  # besides "rl": launch/train.py
PLANNING_DEVICE_GB = 80.0  # trainer.device_memory_gb=null with no GPU visible


def trainer_of(overrides: Sequence[str], given: str | None = None) -> str:
    """The trainer a ``hybridrl validate`` command line is for: ``given`` (``--trainer``), else by the recipe's name."""
    if given is not None:
        return given
    recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")), "")
    return next((kind for kind in TRAINERS if recipe.startswith(f"{kind}_")), "rl")


def main(kind: str, overrides: Sequence[str], *, world_size: int | None = None,
         model_config: Path | None = None) -> int:
    try:
        cfg = _compose(kind, overrides)
        _validate(kind, cfg, world_size=world_size, model_config=model_config)
        lines = plan_lines(kind, cfg, world_size=world_size, model_config=model_config)
    except ConfigError as e:
        print(f"hybridrl validate: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if cfg.model.build_if_missing is not None and model_config is None and not Path(cfg.model.path).exists():
        print(f"model.path={cfg.model.path} does not exist yet: the run builds it first "
              f"(build_if_missing={cfg.model.build_if_missing}) and then checks it")
    if model_config is not None:
        print(f"planned with the architecture of {model_config}; local weights, tokenizer and data files were not "
              "checked")
    print("config OK")
    return 0


def _compose(kind: str, overrides: Sequence[str]) -> Any:
    if kind == "sft":
        from hybridrl.config.compose import compose_config

        return compose_config(overrides, config_name="sft")
    if kind == "dpo":
        from hybridrl.config.dpo_schema import compose_dpo

        return compose_dpo(overrides)
    from hybridrl.config.rm_schema import compose_rm

    return compose_rm(overrides)


def _validate(kind: str, cfg: Any, *, world_size: int | None, model_config: Path | None) -> None:
    if kind == "sft":
        from hybridrl.config.validate import validate_sft as check
    elif kind == "dpo":
        from hybridrl.config.dpo_schema import validate_dpo as check
    else:
        from hybridrl.config.rm_schema import validate_rm as check
    check(cfg, world_size=world_size, before_bootstrap=True, model_config=model_config)


def plan_lines(kind: str, cfg: Any, *, world_size: int | None, model_config: Path | None) -> list[str]:
    """The plan's lines; raises ConfigError when the model state cannot fit (module docstring)."""
    t = cfg.trainer
    world = world_size if world_size is not None else t.nnodes * t.n_gpus_per_node
    layout = RoleLayout.of(cfg.megatron, world)
    lines = [f"world_size: {world} ({TRAINERS[kind]})", f"trainer {layout}"]
    source = model_config if model_config is not None else Path(cfg.model.path) / "config.json"
    if not source.is_file():
        return lines  # built on the first run; its checks wait for it
    model = HFArch.from_hf(source)
    m = model
    lines.append(f"model   {m.family}: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads} "
                 f"(kv {m.num_query_groups}), vocab {m.vocab_size}"
                 + (", scored by a one-output head in place of the LM head" if kind == "rm" else ""))
    mem = memory(kind, cfg, layout, model)
    capacity = device_gb(t.device_memory_gb, planning=model_config is not None)
    if capacity is None:
        lines.append(f"memory  largest rank: {_parts(mem)} → {_size(mem.train)} (no GPU here: not checked)")
        return lines
    lines.append(f"memory  largest rank: {_parts(mem)} → {_size(mem.train)} of {capacity:g} GB "
                 "(trainer.device_memory_gb)")
    state = mem.params + mem.grads + mem.optimizer + mem.ref
    if state > capacity * GB:
        raise ConfigError([ConfigIssue(
            key="trainer.device_memory_gb", value=capacity,
            message=f"the largest rank's model state alone needs ~{state / GB:.1f} GB ({_parts(mem)}): it cannot fit; "
                    "raise megatron.tensor_model_parallel_size / pipeline_model_parallel_size, set "
                    "megatron.use_distributed_optimizer=true or megatron.dtype=bfloat16")])
    if mem.train > capacity * GB:
        lines.append(f"note: the peak (~{mem.train / GB:.1f} GB, activations estimated) is over the device: lower "
                     "data.micro_batch_size_per_gpu or turn on activation recompute "
                     "(megatron.override_transformer_config.recompute_granularity=full)")
    return lines


def memory(kind: str, cfg: Any, layout: RoleLayout, model: HFArch) -> MemoryEstimate:
    """The largest rank's memory (module docstring)."""
    meg, d, mo = cfg.megatron, cfg.data, cfg.model
    rows = d.micro_batch_size_per_gpu * (1 if kind == "sft" else 2)
    lora = max(mo.lora_rank, 0)
    try:
        projections = resolve_targets(mo.target_modules) if lora else ()
    except ValueError:
        projections = ()  # validation names the bad target
    return estimate(dataclasses.replace(model, tie_word_embeddings=True) if kind == "rm" else model,
                    tp=layout.tp, pp=layout.pp, dp=layout.dp, dtype=meg.dtype,
                    distributed_optimizer=meg.use_distributed_optimizer, optimizer=cfg.optim.optimizer,
                    ref=kind == "dpo" and not lora, micro_tokens=rows * (d.max_prompt_length + d.max_response_length),
                    recompute=meg.override_transformer_config.get("recompute_granularity") == "full", offload={},
                    rollout_tp=1, engine_tokens=0, ep=layout.ep, etp=layout.etp, split=layout.split(model.num_layers),
                    engine_weight_bytes=0.0, lora_rank=lora, lora_projections=projections, lm_head=kind != "rm")


def device_gb(setting: float | None, *, planning: bool) -> float | None:
    """``trainer.device_memory_gb``; null: the visible GPU's, 80 when planning, None on a machine without a GPU
    (nothing to check against)."""
    if setting is not None:
        return setting
    if planning:
        return PLANNING_DEVICE_GB
    import torch

    return torch.cuda.get_device_properties(0).total_memory / GB if torch.cuda.is_available() else None


def _size(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 2**20:.1f} MiB"


def _parts(mem: MemoryEstimate) -> str:
    parts = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer, "reference": mem.ref,
             "activations": mem.activations}
    return ", ".join(f"{k} {_size(v)}" for k, v in parts.items() if v)
