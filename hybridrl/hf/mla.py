"""DeepSeek-V3's multi-latent attention as its ``config.json`` describes it (:class:`MLA`), for
:class:`hybridrl.hf.arch.HFArch`; what Megatron's ``MLASelfAttention`` computes otherwise is refused naming the key.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridrl.hf.values import positive_int


@dataclass(slots=True, kw_only=True, frozen=True)
class MLA:
    """DeepSeek-V3's multi-latent attention, in HF's terms (Megatron's ``MLATransformerConfig`` in brackets).

    q = q_b(norm(q_a(x))) — or q_proj(x) when ``q_lora_rank`` is None — per head ``[nope; rope]`` of
    ``qk_nope_head_dim`` (``qk_head_dim``) and ``qk_rope_head_dim`` (``qk_pos_emb_head_dim``); kv_a_proj_with_mqa(x) =
    ``[latent (kv_lora_rank); k_rope]``, k_rope shared by every head, and kv_b(norm(latent)) per head ``[k_nope; v]``
    (``v_head_dim``). RoPE on the rope parts in DeepSeek's interleaved pairs (``rope_interleave``: Megatron's MLA
    always de-interleaves first), softmax scale 1/sqrt(nope + rope). With YaRN (``rope_scaling`` type yarn, as the
    real checkpoints have it) Megatron's ``YarnRotaryEmbedding`` (``rope_type="yarn"``: factor, original context,
    beta_fast/slow, mscale, mscale_all_dim) and its softmax scale × mscale(factor, mscale_all_dim)² are transformers'
    (checked exact: tests/megatron/test_deepseek_v3.py)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # YaRN (``rope_scaling`` type yarn: DeepSeek-V3's, Kimi's): factor, original_max_position_embeddings, beta_fast,
    # beta_slow, mscale, mscale_all_dim; None: plain RoPE
    yarn: tuple[float, int, float, float, float, float] | None = None

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def read_mla(cfg: Mapping[str, Any], source: str, heads: int, kv_heads: int, need: Any) -> MLA:
    """DeepSeek-V3's attention keys; what Megatron's ``MLASelfAttention`` computes otherwise is refused, naming the
    key: ``rope_interleave`` false (Megatron always de-interleaves the rope dims), a RoPE other than the default or
    YaRN, grouped KV heads, and an ``rms_norm_eps`` other than
    1e-6 (transformers' latent norms keep their own 1e-6, Megatron's take the model's epsilon)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise NotImplementedError(f"{source}: {key}.rope_type={rope_type!r} is not supported for deepseek_v3; valid: "
                                  "'default', 'yarn'")
    yarn = None
    if rope_type == "yarn":
        yarn = (float(params["factor"]), int(params["original_max_position_embeddings"]),
                float(params.get("beta_fast", 32)), float(params.get("beta_slow", 1)), float(params.get("mscale", 1)),
                float(params.get("mscale_all_dim", 0)))
    if cfg.get("rope_interleave", True) is not True:
        raise NotImplementedError(f"{source}: rope_interleave={cfg['rope_interleave']!r} is not supported; valid: true "
                                  "(Megatron's MLA rotates the rope dims as interleaved pairs)")
    if kv_heads != heads:
        raise NotImplementedError(f"{source}: num_key_value_heads={kv_heads} is not supported for deepseek_v3; valid: "
                                  f"num_attention_heads={heads} (MLA's kv_b_proj makes every head's key and value)")
    eps = cfg.get("rms_norm_eps")
    if eps != 1e-6:
        raise NotImplementedError(f"{source}: rms_norm_eps={eps!r} is not supported for deepseek_v3; valid: 1e-06 "
                                  "(transformers' q_a/kv_a layernorms use 1e-6 whatever it says, Megatron's the "
                                  "model's epsilon)")
    q_lora = cfg.get("q_lora_rank")
    return MLA(q_lora_rank=None if q_lora is None else positive_int(q_lora, f"{source}: q_lora_rank"),
               kv_lora_rank=positive_int(need("kv_lora_rank"), f"{source}: kv_lora_rank"),
               qk_nope_head_dim=positive_int(need("qk_nope_head_dim"), f"{source}: qk_nope_head_dim"),
               qk_rope_head_dim=positive_int(need("qk_rope_head_dim"), f"{source}: qk_rope_head_dim"),
               v_head_dim=positive_int(need("v_head_dim"), f"{source}: v_head_dim"), yarn=yarn)
