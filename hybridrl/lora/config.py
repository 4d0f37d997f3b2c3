"""LoRA settings (verl's keys under a model section) and their static checks; no backend imported here.

Keys (``actor_rollout_ref.model.*`` in RL, ``model.*`` in SFT; verl's names): ``lora_rank`` (0 = off),
``lora_alpha`` (scale = alpha / rank, peft's default, not rsLoRA), ``target_modules`` (a list of peft-style
names or ``all-linear``), ``lora_dropout``. Target names are the HF projections (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``), or Megatron's fused linears, each
meaning the projections it holds (``linear_qkv`` = q/k/v, ``linear_proj`` = o, ``linear_fc1`` = gate/up,
``linear_fc2`` = down). Adapters are kept per HF projection even inside Megatron's fused linears, so they
are exactly peft's (see :mod:`hybridrl.megatron.lora`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# HF projection -> the Megatron linear that holds it (in that linear's output order for fused ones)
HF_PROJECTIONS: dict[str, str] = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
    "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
}
MEGATRON_LINEARS: dict[str, tuple[str, ...]] = {
    linear: tuple(p for p, m in HF_PROJECTIONS.items() if m == linear)
    for linear in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
}
ALL_LINEAR = "all-linear"
VALID_TARGETS = (ALL_LINEAR, *HF_PROJECTIONS, *MEGATRON_LINEARS)


@dataclass(kw_only=True, slots=True, frozen=True)
class LoRAConfig:
    """An enabled LoRA: rank ``r`` ≥ 1, ``alpha``, ``dropout`` on the adapter input, the HF projections adapted."""

    rank: int
    alpha: float
    dropout: float = 0.0
    projections: tuple[str, ...] = tuple(HF_PROJECTIONS)  # HF names, in HF_PROJECTIONS order

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_model(cls, model: Any, *, key: str = "model") -> LoRAConfig | None:
        """The LoRA of a model config section (``lora_rank`` …), None when ``lora_rank`` is 0; raises
        ``ValueError`` with every problem, each naming its key."""
        if problems := lora_problems(model, key=key):
            raise ValueError("; ".join(f"{k}={v!r}: {m}" for k, v, m in problems))
        if model.lora_rank == 0:
            return None
        return cls(rank=model.lora_rank, alpha=float(model.lora_alpha), dropout=float(model.lora_dropout),
                   projections=resolve_targets(model.target_modules))


def resolve_targets(target_modules: str | Sequence[str]) -> tuple[str, ...]:
    """HF projection names (in HF_PROJECTIONS order) that ``target_modules`` selects; unknown names raise."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    chosen: set[str] = set()
    for name in names:
        if name == ALL_LINEAR:
            chosen.update(HF_PROJECTIONS)
        elif name in HF_PROJECTIONS:
            chosen.add(name)
        elif name in MEGATRON_LINEARS:
            chosen.update(MEGATRON_LINEARS[name])
        else:
            raise ValueError(f"unknown target module {name!r}; valid: {', '.join(VALID_TARGETS)}")
    return tuple(p for p in HF_PROJECTIONS if p in chosen)


def lora_problems(model: Any, *, key: str) -> list[tuple[str, object, str]]:
    """``(key, value, message)`` for each bad LoRA setting of the model section ``model`` at ``key``."""
    out: list[tuple[str, object, str]] = []
    rank, alpha, dropout = model.lora_rank, model.lora_alpha, model.lora_dropout
    if not isinstance(rank, int) or rank < 0:
        out.append((f"{key}.lora_rank", rank, "must be an integer ≥ 0 (0 = LoRA off)"))
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        out.append((f"{key}.lora_alpha", alpha, "must be a number > 0 (the adapter scale is lora_alpha / lora_rank)"))
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        out.append((f"{key}.lora_dropout", dropout, "must be in [0, 1)"))
    targets = model.target_modules
    if isinstance(targets, str) or (isinstance(targets, Sequence) and all(isinstance(t, str) for t in targets)):
        names = [targets] if isinstance(targets, str) else list(targets)
        bad = [t for t in names if t not in VALID_TARGETS]
        if bad:
            out.append((f"{key}.target_modules", targets if isinstance(targets, str) else names,
                        f"unknown module(s) {bad}; valid: {', '.join(VALID_TARGETS)}"))
        elif not names:
            out.append((f"{key}.target_modules", names,
                        f"must name at least one module; valid: {', '.join(VALID_TARGETS)}"))
    else:
        out.append((f"{key}.target_modules", targets, f"must be a list of module names or {ALL_LINEAR!r}"))
    return out
