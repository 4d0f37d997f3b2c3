"""Random tiny Qwen2.5-VL and Qwen3-VL checkpoints made with transformers' own classes, for the VLM tests (no hub)."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridrl.vlm.sglang_compat import transformers_rope_rules

IMAGE, VIDEO, START, END = 200, 201, 202, 203  # its placeholder and frame token ids


def make_tiny_qwen2_5_vl(out: Path, *, tie: bool, seed: int = 0) -> Path:
    """A random tiny Qwen2.5-VL (transformers' own classes; shapes no other test uses: 4 layers, 6 heads of 16 over
    2 KV heads, vocab 211, mrope_section 2/3/3) with discriminating norms and biases."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with transformers_rope_rules():  # hybridrl.vlm.sglang_compat: SGLang imported by another test of the process
        config = Qwen2_5_VLConfig(
            text_config=dict(vocab_size=211, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                             rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=None, eos_token_id=210,
                             pad_token_id=209, rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                                "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8,
                               spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=96, window_size=32,
                               fullatt_block_indexes=[1]),
            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
            tie_word_embeddings=tie)
    torch.manual_seed(seed)
    with transformers_rope_rules():
        model = Qwen2_5_VLForConditionalGeneration(config).eval()
    return _save_discriminating(model, out)


def make_tiny_qwen3_vl(out: Path, *, tie: bool, seed: int = 0) -> Path:
    """A random tiny Qwen3-VL: a Qwen3 language model (q/k norms, head_dim 32 ≠ hidden 96 / 4 heads, as Qwen3's
    models have it), interleaved M-RoPE over sections 6/5/5, a 3-block tower of patch 16 with DeepStack mergers after
    blocks 0 and 2 (added after decoder layers 0 and 1), vocab 211."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    with transformers_rope_rules():
        config = Qwen3VLConfig(
            text_config=dict(vocab_size=211, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                             rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=None, eos_token_id=210,
                             pad_token_id=209, rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                                "mrope_section": [6, 5, 5],
                                                                "mrope_interleaved": True}),
            vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16,
                               spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=96,
                               num_position_embeddings=36, deepstack_visual_indexes=[0, 2]),
            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
            tie_word_embeddings=tie)
    torch.manual_seed(seed)
    with transformers_rope_rules():
        model = Qwen3VLForConditionalGeneration(config).eval()
    return _save_discriminating(model, out)


def _save_discriminating(model: torch.nn.Module, out: Path) -> Path:
    with torch.no_grad():  # norms ≈ 1 ± 0.2 and biases ≈ ±0.1: a misplaced one shows in the logits
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.1 * torch.randn_like(p) if name.endswith("bias") else 1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(out)  # type: ignore[operator]
    return out
