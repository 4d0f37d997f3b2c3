"""The coefficient β of the KL-in-reward penalty, fixed or adaptive.

    token_reward_{i,t} = score_{i,t} - β_k · KL_est(π_old ‖ π_ref)_{i,t}                (step k)

    fixed:     β_k = kl_coef
    adaptive:  β_{k+1} = β_k · (1 + clip(KL_k / target_kl - 1, -0.2, 0.2) · n_k / horizon)

with ``KL_k`` the step's measured KL (the mean over sequences of each response's token-mean
estimate, ``algorithm.kl_penalty``) and ``n_k`` the step's number of samples. Source: Ziegler et
al. 2019, "Fine-Tuning Language Models from Human Preferences" (section 2.2, the proportional
controller, e_t clipped to ±0.2); config keys and the update are verl's ``algorithm.kl_ctrl``
(``AdaptiveKLController``, after OpenAI's lm-human-preferences and trl).

Deviations and choices:
- Step k's penalty uses β_k, then β is updated from step k's KL (as verl): the new β applies from
  the next step on.
- The KL and the sample count are over the whole step (all data-parallel ranks), so every rank holds
  the same β; verl measures them on its single driver, which amounts to the same.
- A step whose measured KL is not finite leaves β unchanged (the loop skips that step's update).
- The state (β) is saved with the checkpoint and restored on resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KL_CTRL_TYPES: tuple[str, ...] = ("fixed", "adaptive")


@dataclass(kw_only=True, slots=True)
class KLControlConfig:
    """β of the KL-in-reward penalty (``algorithm.use_kl_in_reward``), as verl's ``algorithm.kl_ctrl``;
    the controller below."""

    type: str = "fixed"  # KL_CTRL_TYPES: fixed (β = kl_coef throughout) or adaptive (Ziegler et al. 2019's)
    kl_coef: float = 0.001  # β (adaptive: its initial value)
    target_kl: float = 0.1  # adaptive: the KL per token that β steers towards
    horizon: int = 10000  # adaptive: samples over which β may change by a factor of up to e^±0.2
PROPORTIONAL_ERROR_CLIP = 0.2  # Ziegler et al.'s clip of e_t


class KLController:
    """β for ``algorithm.use_kl_in_reward``: ``value`` is the current β; ``update`` after each step."""

    def __init__(self, cfg: KLControlConfig) -> None:
        self.cfg = cfg
        self.value = cfg.kl_coef

    def update(self, current_kl: float, n_samples: int) -> None:
        """Move β towards ``target_kl`` given the step's measured KL over ``n_samples`` (no-op when fixed)."""
        if self.cfg.type != "adaptive" or not math.isfinite(current_kl):  # a non-finite step is skipped anyway
            return
        error = min(max(current_kl / self.cfg.target_kl - 1, -PROPORTIONAL_ERROR_CLIP), PROPORTIONAL_ERROR_CLIP)
        self.value *= 1 + error * n_samples / self.cfg.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def config_problems(cfg: KLControlConfig, *, key: str = "algorithm.kl_ctrl") -> list[tuple[str, object, str]]:
    """``(key, value, message)`` for every problem of ``algorithm.kl_ctrl.*``."""
    out: list[tuple[str, object, str]] = []
    if cfg.type not in KL_CTRL_TYPES:
        out.append((f"{key}.type", cfg.type, f"valid: {', '.join(KL_CTRL_TYPES)}"))
    if not (cfg.kl_coef >= 0 and math.isfinite(cfg.kl_coef)):
        out.append((f"{key}.kl_coef", cfg.kl_coef, "must be a finite float ≥ 0"))
    if cfg.type == "adaptive" and cfg.kl_coef == 0:
        out.append((f"{key}.kl_coef", cfg.kl_coef, "must be > 0 with kl_ctrl.type=adaptive (β is multiplied, a β of "
                                                  "0 never moves)"))
    if cfg.type == "adaptive":
        if not (cfg.target_kl > 0 and math.isfinite(cfg.target_kl)):
            out.append((f"{key}.target_kl", cfg.target_kl, "must be a finite float > 0 (kl_ctrl.type=adaptive)"))
        if cfg.horizon < 1:
            out.append((f"{key}.horizon", cfg.horizon, "must be ≥ 1 (kl_ctrl.type=adaptive)"))
    return out
