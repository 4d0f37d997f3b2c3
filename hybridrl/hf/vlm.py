"""Reading a vision-language checkpoint's config.json: its language model as the causal LM it is, plus what the
vision side needs (Qwen2.5-VL, Qwen3-VL; issue 46).

Qwen2.5-VL's language model is Qwen2 (q/k/v biases, SwiGLU, RMSNorm) with multimodal RoPE: each position has three
ids (time, height, width) and the rotary dimensions are split ``mrope_section`` = (t, h, w) ways, each part rotated by
its own id (Wang et al. 2024, "Qwen2-VL", §2.1). Text tokens get the same id three times, so on text alone it is plain
RoPE. Its weights are stored as a Qwen2 checkpoint's (``model.layers.*``, ``model.embed_tokens``, ``model.norm``,
``lm_head``) beside the vision tower's (``visual.*``), so the causal-LM converter reads the language model unchanged.

config.json comes in two layouts: transformers ≥ 5 nests the language model's fields under ``text_config`` (its
``rope_parameters`` holding ``mrope_section``); the published checkpoints (transformers 4) keep them at the top level,
with ``rope_scaling = {"type": "mrope", "mrope_section": [...]}``. Both are read.

Qwen3-VL (Bai et al. 2025, "Qwen3-VL Technical Report") differs in three ways the policy must follow: its language
model is Qwen3 (per-head q/k RMSNorm, no q/k/v bias); its M-RoPE is *interleaved* (``mrope_interleaved``: rotary
frequency channel j takes its id from height if j ≡ 1 (mod 3) and j < 3·section_h, from width if j ≡ 2 and
j < 3·section_w, else from time — Qwen2.5-VL gives each axis a contiguous block of channels); and DeepStack: the
vision blocks listed in ``vision_config.deepstack_visual_indexes`` each feed a merger whose output is *added* to the
hidden states at the image placeholders after decoder layers 0, 1, … (one layer per listed block). Its checkpoint
names are transformers 5's (``model.language_model.*``, ``model.visual.*``, ``lm_head``), where Qwen2.5-VL's
published checkpoints use ``model.*`` and ``visual.*``: :attr:`VisionSpec.text_prefix` / ``vision_prefix``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLM_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
LANGUAGE_FAMILY = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}  # the causal LM each one's language model is
# where each family's checkpoint keeps (the language model's ``model.`` tensors, the vision tower's)
PREFIXES = {"qwen2_5_vl": ("model.", "visual."), "qwen3_vl": ("model.language_model.", "model.visual.")}


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionSpec:
    """The vision side of a VLM checkpoint, as the Megatron model and the positions need it."""

    config: Mapping[str, Any]  # the vision tower's own config (``vision_config``)
    image_token_id: int  # the placeholder each image's merged patches replace (``<|image_pad|>``)
    video_token_id: int | None
    vision_start_token_id: int
    spatial_merge_size: int  # patches merged per side into one language-model token
    tokens_per_second: float  # time ids per second of video (images: one frame, time id 0)
    family: str = "qwen2_5_vl"  # the checkpoint's model_type (:data:`VLM_FAMILIES`)
    mrope_interleaved: bool = False  # Qwen3-VL: M-RoPE's axes interleaved over the frequency channels
    deepstack_layers: int = 0  # Qwen3-VL: decoder layers 0..n-1 each add one DeepStack merger's image features

    @property
    def text_prefix(self) -> str:
        """The checkpoint's prefix of the language model's tensors (``model.layers.0.…`` → ``model.``)."""
        return PREFIXES[self.family][0]

    @property
    def vision_prefix(self) -> str:
        """The checkpoint's prefix of the vision tower's tensors."""
        return PREFIXES[self.family][1]


def checkpoint_vision(model_dir: str | os.PathLike[str]) -> VisionSpec | None:
    """The vision side of the checkpoint at ``model_dir`` (a :data:`VLM_FAMILIES` config.json), or None for a causal
    LM — what an engine asks before it loads one. A config with a ``vision_config`` of another family is an error
    naming it (it would load as a causal LM and ignore its images)."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    if config.get("model_type") not in VLM_FAMILIES:
        if "vision_config" in config:
            raise ValueError(f"{path} has a vision_config, but model_type={config.get('model_type')!r} is not a "
                             f"vision-language family hybridrl knows; valid: {', '.join(VLM_FAMILIES)}")
        return None
    return language_config(config, str(path))[2]


def language_config(cfg: Mapping[str, Any], source: str) -> tuple[dict[str, Any], tuple[int, ...], VisionSpec]:
    """``(the language model's config as its causal-LM family's, mrope_section, the vision spec)`` of a VLM
    config.json; ``KeyError``/``ValueError`` name ``source`` and the key."""
    family = cfg["model_type"]
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
    text["model_type"] = LANGUAGE_FAMILY[family]
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    key = "rope_parameters" if "rope_parameters" in text else "rope_scaling"
    rope = dict(text.get(key) or {})
    section = rope.pop("mrope_section", None)
    if not (isinstance(section, list) and len(section) == 3 and all(isinstance(s, int) and s > 0 for s in section)):
        raise KeyError(f"{source}: {key}.mrope_section must be three positive ints (time, height, width), got "
                       f"{section!r}")
    rope.pop("type", None)
    interleaved = bool(rope.pop("mrope_interleaved", family == "qwen3_vl"))
    rope["rope_type"] = "default"
    text[key] = rope
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if 2 * sum(section) != head_dim:
        raise ValueError(f"{source}: {key}.mrope_section={section} must sum to head_dim / 2 = {head_dim // 2}")
    vision = cfg.get("vision_config")
    if not isinstance(vision, Mapping):
        raise KeyError(f"{source}: missing key 'vision_config' (a {family} checkpoint has a vision tower)")

    def token(name: str) -> int:
        value = cfg.get(name, text.get(name))
        if not isinstance(value, int):
            raise KeyError(f"{source}: missing key {name!r} (the image placeholder's id)")
        return value

    spec = VisionSpec(config=dict(vision), image_token_id=token("image_token_id"),
                      video_token_id=cfg.get("video_token_id"), vision_start_token_id=token("vision_start_token_id"),
                      spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
                      tokens_per_second=float(vision.get("tokens_per_second", 2)), family=family,
                      mrope_interleaved=interleaved, deepstack_layers=len(vision.get("deepstack_visual_indexes") or ()))
    return text, tuple(section), spec


def vision_parameters(config: Mapping[str, Any], family: str = "qwen2_5_vl") -> int:
    """The vision tower's parameter count from its ``vision_config``.

    Qwen2.5-VL: the patch embedding (a bias-free 3-D convolution), ``depth`` blocks (two RMSNorms, q/k/v and output
    projections with biases, a SwiGLU MLP with biases) and the merger (an RMSNorm, then two linears from
    ``hidden · merge²`` to ``out_hidden_size``). Qwen3-VL: the convolution has a bias, a learned position table
    (``num_position_embeddings`` rows), blocks with LayerNorms (weight and bias) and a two-linear GELU MLP, the merger
    with a LayerNorm, and one more merger per DeepStack index (its LayerNorm over the merged width)."""
    h, ffn, out = int(config["hidden_size"]), int(config["intermediate_size"]), int(config["out_hidden_size"])
    patch = int(config.get("in_channels", 3)) * int(config.get("temporal_patch_size", 2)) \
        * int(config.get("patch_size", 14)) ** 2 * h
    merged = h * int(config.get("spatial_merge_size", 2)) ** 2
    attention = (h * 3 * h + 3 * h) + (h * h + h)
    linears = (merged * merged + merged) + (merged * out + out)
    if family == "qwen3_vl":
        block = 4 * h + attention + (h * ffn + ffn) + (ffn * h + h)
        n_deep = len(config.get("deepstack_visual_indexes") or ())
        return (patch + h + int(config.get("num_position_embeddings", 2304)) * h + int(config["depth"]) * block
                + (2 * h + linears) + n_deep * (2 * merged + linears))
    block = 2 * h + attention + 2 * (h * ffn + ffn) + (ffn * h + h)
    return patch + int(config["depth"]) * block + h + linears
