"""Write LoRA adapters as a ``peft`` adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

Key names are peft's for a causal LM: ``base_model.model.<hf module>.lora_A.weight`` ``[r, in]`` and
``…lora_B.weight`` ``[out, r]`` (no adapter name in the file: peft adds ``default`` when it loads), and
the config is peft's ``LoraConfig`` (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules`` with the
HF projection names, ``bias: none``, no rsLoRA/DoRA), so ``PeftModel.from_pretrained(base, folder)`` rebuilds
the trained model: W x + (lora_alpha / r) · B A x.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridrl.lora.config import LoRAConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_state_dict(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{hf module: (A, B)}`` → peft's saved keys (contiguous CPU tensors)."""
    out = {}
    for module, (a, b) in adapters.items():
        out[f"base_model.model.{module}.lora_A.weight"] = a.detach().cpu().contiguous()
        out[f"base_model.model.{module}.lora_B.weight"] = b.detach().cpu().contiguous()
    return out


def peft_config(cfg: LoRAConfig, *, base_model: str, modules: list[str] | None = None) -> dict[str, object]:
    """``modules``: the adapted HF module paths (their last names are the targets: an expert's checkpoint names, e.g.
    Mixtral's ``w1``, included); default the configured projections."""
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules}) if modules else sorted(cfg.projections)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}}


def write_peft_adapter(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], cfg: LoRAConfig, out_dir: Path, *,
                       base_model: str) -> None:
    """The adapter folder at ``out_dir`` (created; the caller checks it may be written)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(peft_state_dict(adapters), str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_config(cfg, base_model=base_model, modules=list(adapters))
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
