"""A random-weight Qwen2.5-VL or Qwen3-VL checkpoint made here (no model hub): the tiny text model (Qwen2; Qwen3 for
Qwen3-VL) with a tiny vision tower.

``make_tiny_vlm`` writes what ``Qwen2_5_VLForConditionalGeneration.from_pretrained`` and
``AutoProcessor.from_pretrained`` load: ``config.json``, ``model.safetensors``, ``generation_config.json``, the
char tokenizer (:mod:`hybridrl.models.char_tokenizer`) with Qwen2.5-VL's vision tokens added after its own,
a chat template that renders an image content part as ``<|vision_start|><|image_pad|><|vision_end|>`` (as
Qwen2.5-VL's does; no default system message, and string contents render as the char tokenizer's template
does), and ``processor_config.json`` (``Qwen2VLImageProcessor`` with small ``min_pixels``/``max_pixels``).

Defaults (:class:`hybridrl.models.tiny.TinyModelSpec` for the text model, :class:`TinyVisionSpec`): text hidden
128, 4 layers, 4 heads / 2 KV heads, head_dim 32, M-RoPE sections [4, 6, 6] (Qwen's 2:3:3 split of head_dim/2, as
[16, 24, 24] is for head_dim 128); vision depth 2, hidden 64, 2 heads, patch 14, merge 2, temporal patch 2, block 0
windowed (window 56 px = 2×2 merged tokens) and block 1 full attention, merger out = text hidden. An image of H×W
pixels (both multiples of 28 inside [min_pixels, max_pixels]) gives (H/14)·(W/14) patches and a quarter as many
``<|image_pad|>`` tokens: 28×28 → 1, 56×56 → 4, 112×112 → 16.
Weights are drawn as :func:`hybridrl.models.tiny.init_weights` draws them (the vision tower's too).

``family="qwen3_vl"``: Qwen3-VL's layout at the same text sizes — a Qwen3 language model (q/k norms, no bias),
interleaved M-RoPE over the same sections, a tower of patch 16 (32×32 → 1 token; ``min_pixels`` / ``max_pixels``
scale with the patch) with a learned 8 × 8 position table (bilinearly resampled to each image's grid), LayerNorm
blocks and one DeepStack merger per block but the last (each added after one of the first decoder layers), and
``Qwen3VLProcessor``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from hybridrl.models.char_tokenizer import EOS_TOKEN, IM_START, PAD_TOKEN, char_vocab
from hybridrl.models.tiny import INIT_STD, TinyModelSpec, _count_params, _parse_vocab, init_weights
from hybridrl.vlm.sglang_compat import transformers_rope_rules

MERGE = 2  # spatial_merge_size: 2×2 patches make one token, as in every Qwen2.5-VL
VISION_START, VISION_END, VISION_PAD = "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS: tuple[str, ...] = (VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD)  # Qwen2.5-VL's order

# the char tokenizer's ChatML, where a content may also be a list of parts: {"type": "image"} (or an "image" /
# "image_url" key) → the vision tokens the processor expands, {"type": "video"} likewise, {"type": "text"} → its text
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] in ('image', 'image_url') or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or 'video' in part %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_vlm_tokenizer(*, model_max_length: int) -> Qwen2Tokenizer:
    """The char tokenizer with :data:`VISION_TOKENS` after its special tokens and :data:`VLM_CHAT_TEMPLATE`."""
    vocab = char_vocab()
    for token in VISION_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None,  # type: ignore[arg-type]  # as the char one
                               eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                               additional_special_tokens=[IM_START, *VISION_TOKENS], model_max_length=model_max_length)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of the rotary half (head_dim/2) over time, height, width: 2:3:3 ([16, 24, 24] at 128)."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def qwen3_mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's split of the rotary half over time, height, width: 6:5:5 ([24, 20, 20] at head_dim 128)."""
    half = head_dim // 2
    h = half * 5 // 16
    return [half - 2 * h, h, h]


@dataclass(slots=True, kw_only=True, frozen=True)
class TinyVisionSpec:
    depth: int = 2  # blocks; the last one full attention, the others windowed
    hidden: int = 64  # its MLP is 2 × hidden wide
    heads: int = 2
    patch_size: int = 14  # pixels a side; 2×2 patches merge into one token
    window_size: int = 56  # pixels a side of a windowed block's attention window
    min_pixels: int = 28 * 28  # the processor resizes an image to between these many pixels
    max_pixels: int = 112 * 112

    def __post_init__(self) -> None:
        for name in ("depth", "hidden", "heads", "patch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"vision {name}={getattr(self, name)} must be >= 1")
        if self.hidden % self.heads or (self.hidden // self.heads) % 4:
            raise ValueError(f"vision hidden={self.hidden} / heads={self.heads} must be a multiple of 4 (the vision "
                             "tower's 2-D rotary embedding)")
        if self.window_size % (self.patch_size * MERGE):
            raise ValueError(f"vision window_size={self.window_size} must be a multiple of patch_size × merge = "
                             f"{self.patch_size * MERGE}")
        if not (self.patch_size * MERGE) ** 2 <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"vision min_pixels={self.min_pixels}, max_pixels={self.max_pixels}: need "
                             f"{(self.patch_size * MERGE) ** 2} (one merged token) <= min_pixels <= max_pixels")


FAMILIES = ("qwen2_5_vl", "qwen3_vl")


def make_tiny_vlm(out_dir: str | os.PathLike[str], *, text: TinyModelSpec | None = None,
                  vision: TinyVisionSpec | None = None, family: str = "qwen2_5_vl") -> Path:
    """Write a random-weight Qwen2.5-VL (``family``; or Qwen3-VL) checkpoint and its processor to ``out_dir``; return
    its path (module docstring). ``text`` is the language model's spec (a Qwen2's, as for
    :func:`hybridrl.models.tiny.make_tiny_model`, whose ``arch`` the family overrides; its seed draws every weight);
    ``vision`` the tower's (Qwen3-VL: its patch_size, window_size and pixel bounds are scaled from 14 to 16)."""
    spec, vision = text or TinyModelSpec(), vision or TinyVisionSpec()
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: valid: {', '.join(FAMILIES)}")
    if spec.arch != "qwen2":
        raise ValueError(f"text.arch={spec.arch!r}: the tiny VLMs take a qwen2 spec (Qwen3-VL's becomes a qwen3)")
    tokenizer = make_vlm_tokenizer(model_max_length=spec.max_positions)
    if spec.vocab != "chars" and spec.vocab < len(tokenizer):
        raise ValueError(f"vocab={spec.vocab!r} must be 'chars' or an int >= the tokenizer's {len(tokenizer)} tokens")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (PAD_TOKEN, EOS_TOKEN, *VISION_TOKENS)}
    head_dim = spec.hidden // spec.heads
    text_config = dict(
        vocab_size=len(tokenizer) if spec.vocab == "chars" else spec.vocab, hidden_size=spec.hidden,
        intermediate_size=spec.intermediate or 3 * spec.hidden, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions, rms_norm_eps=1e-6, initializer_range=INIT_STD,
        tie_word_embeddings=spec.tie, bos_token_id=None, eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(head_dim)},
    )
    tokens = dict(image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
                  vision_end_token_id=ids[VISION_END], tie_word_embeddings=spec.tie)
    patch = vision.patch_size
    with transformers_rope_rules():  # the vision tower's axial RoPE, even after SGLang's import (sglang_compat)
        if family == "qwen3_vl":
            patch = vision.patch_size * 16 // 14
            config: Any = Qwen3VLConfig(
                text_config={**text_config, "head_dim": head_dim,
                             "rope_parameters": {**text_config["rope_parameters"], "mrope_interleaved": True,
                                                 "mrope_section": qwen3_mrope_section(head_dim)}},
                vision_config=dict(
                    depth=vision.depth, hidden_size=vision.hidden, intermediate_size=2 * vision.hidden,
                    num_heads=vision.heads, patch_size=patch, spatial_merge_size=MERGE, temporal_patch_size=2,
                    out_hidden_size=spec.hidden, num_position_embeddings=64,
                    deepstack_visual_indexes=list(range(min(vision.depth - 1, spec.layers))),
                    initializer_range=INIT_STD),
                dtype="float32", **tokens)
            model: Any = Qwen3VLForConditionalGeneration(config).to(torch.float32)
        else:
            config = Qwen2_5_VLConfig(
                text_config=text_config,
                vision_config=dict(
                    depth=vision.depth, hidden_size=vision.hidden, intermediate_size=2 * vision.hidden,
                    num_heads=vision.heads, patch_size=patch, spatial_merge_size=MERGE, temporal_patch_size=2,
                    window_size=vision.window_size, out_hidden_size=spec.hidden,
                    fullatt_block_indexes=[vision.depth - 1], tokens_per_second=2, initializer_range=INIT_STD,
                ),
                dtype="float32", **tokens)
            model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    init_weights(model, seed=spec.seed)
    # stop on <|im_end|> (chat) and <|endoftext|> (raw text); greedy unless the caller samples
    model.generation_config = GenerationConfig(eos_token_id=[ids[EOS_TOKEN], ids[PAD_TOKEN]],
                                               pad_token_id=ids[PAD_TOKEN], do_sample=False)
    scale = (patch / vision.patch_size) ** 2
    pixels: dict[str, Any] = dict(min_pixels=int(vision.min_pixels * scale), max_pixels=int(vision.max_pixels * scale),
                                  patch_size=patch, merge_size=MERGE, temporal_patch_size=2)
    if family == "qwen3_vl":
        processor: Any = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                                          video_processor=Qwen3VLVideoProcessor(**pixels),
                                          chat_template=VLM_CHAT_TEMPLATE)
    else:
        processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                                        video_processor=Qwen2VLVideoProcessor(**pixels),
                                        chat_template=VLM_CHAT_TEMPLATE)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)  # the tokenizer, the chat template, processor_config.json
    return out


def main(args: argparse.Namespace) -> int:
    """``hybridrl make-tiny-model OUT --arch qwen2_5_vl|qwen3_vl ...`` (arguments defined in :mod:`hybridrl.cli`;
    the vision tower takes :class:`TinyVisionSpec`'s defaults)."""
    if args.moe:
        raise SystemExit(f"--moe {args.moe[0]!r}: --arch {args.arch} is not an MoE family")
    out = make_tiny_vlm(args.out, family=args.arch, text=TinyModelSpec(
        hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
        intermediate=args.intermediate, vocab="chars" if args.vocab == "chars" else _parse_vocab(args.vocab),
        max_positions=args.max_positions, tie=args.tie, seed=args.seed))
    with transformers_rope_rules():
        config = AutoConfig.from_pretrained(out)
    text, vision = config.text_config, config.vision_config
    print(f"wrote {out}: {args.arch}, {_count_params(out / 'model.safetensors'):,} parameters; text hidden "
          f"{text.hidden_size}, {text.num_hidden_layers} layers, {text.num_attention_heads} heads / "
          f"{text.num_key_value_heads} kv, vocab {text.vocab_size}, mrope {text.rope_parameters['mrope_section']}; "
          f"vision depth {vision.depth}, hidden {vision.hidden_size}, patch {vision.patch_size}, merge "
          f"{vision.spatial_merge_size}; seed {args.seed}")
    for path in sorted(out.iterdir()):
        print(f"  {path.name}  {path.stat().st_size:,} bytes")
    return 0
