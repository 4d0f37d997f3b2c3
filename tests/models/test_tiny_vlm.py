"""The tiny Qwen2.5-VL made here: the processor expands image pads to the grid's token count, the model runs forward
and generate on them, and the checkpoint, processor and CLI round-trip through ``from_pretrained``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

from hybridrl.cli import main as cli_main
from hybridrl.models.char_tokenizer import make_char_tokenizer
from hybridrl.models.tiny import TinyModelSpec
from hybridrl.models.tiny_vlm import IMAGE_PAD, VISION_END, VISION_START, make_tiny_vlm, mrope_section
from hybridrl.vlm.sglang_compat import transformers_rope_rules


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / "model")



@pytest.fixture(autouse=True)
def _transformers_rope_rules() -> Iterator[None]:
    """transformers' own RoPE rules for its Qwen2.5-VL, whatever another test of the process imported (SGLang patches
    them: :mod:`hybridrl.vlm.sglang_compat`)."""
    with transformers_rope_rules():
        yield

def image(width: int, height: int, seed: int = 0) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def chat(n_images: int, text: str = "How many dots?") -> list[dict]:
    parts = [*({"type": "image"} for _ in range(n_images)), {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def encode(processor: Qwen2_5_VLProcessor, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    text = processor.apply_chat_template(chat(len(images)), add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], images=images, return_tensors="pt"))


def test_config_has_the_text_model_the_vision_tower_and_the_vision_tokens(checkpoint: Path) -> None:
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint)
    processor = AutoProcessor.from_pretrained(checkpoint)
    config, tok = model.config, processor.tokenizer
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == \
        (128, 4, 4, 2)
    assert text.rope_parameters["mrope_section"] == [4, 6, 6] == mrope_section(32)
    assert mrope_section(128) == [16, 24, 24]  # Qwen2.5-VL-7B's
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.patch_size, vision.spatial_merge_size,
            vision.temporal_patch_size, vision.out_hidden_size) == (2, 64, 2, 14, 2, 2, 128)
    assert list(vision.fullatt_block_indexes) == [1] and vision.window_size == 56
    assert config.image_token_id == tok.convert_tokens_to_ids(IMAGE_PAD) == processor.image_token_id
    assert config.vision_start_token_id == tok.convert_tokens_to_ids(VISION_START)
    assert config.vision_end_token_id == tok.convert_tokens_to_ids(VISION_END)
    assert text.vocab_size == len(tok) and "lm_head.weight" not in load_file(checkpoint / "model.safetensors")


@pytest.mark.parametrize(("size", "tokens"), [((28, 28), 1), ((56, 56), 4), ((112, 112), 16), ((112, 56), 8),
                                              ((40, 40), 1), ((300, 300), 9)])
def test_processor_expands_each_image_to_its_grid_tokens(checkpoint: Path, size: tuple[int, int],
                                                         tokens: int) -> None:
    processor = AutoProcessor.from_pretrained(checkpoint)
    out = encode(processor, [image(*size)])
    (t, h, w), = out["image_grid_thw"].tolist()
    ids = out["input_ids"][0].tolist()
    assert ids.count(processor.image_token_id) == t * h * w // 4 == tokens
    assert out["pixel_values"].shape == (t * h * w, 3 * 2 * 14 * 14)
    text = processor.tokenizer.decode(ids)
    assert text == ("<|im_start|>user\n<|vision_start|>" + IMAGE_PAD * tokens
                    + "<|vision_end|>How many dots?<|im_end|>\n<|im_start|>assistant\n")


def test_text_only_chat_renders_as_the_char_tokenizers(checkpoint: Path) -> None:
    processor = AutoProcessor.from_pretrained(checkpoint)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+34="}]
    assert processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        make_char_tokenizer(model_max_length=64).apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=False)


def test_forward_and_generate_with_two_images(checkpoint: Path) -> None:
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint).eval()
    processor = AutoProcessor.from_pretrained(checkpoint)
    inputs = encode(processor, [image(56, 56), image(112, 56, seed=1)])
    assert inputs["input_ids"][0].tolist().count(processor.image_token_id) == 4 + 8
    with torch.no_grad():
        logits = model(**inputs).logits
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert logits.shape == (1, inputs["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    assert out.shape[1] > inputs["input_ids"].shape[1] and torch.equal(out[:, :inputs["input_ids"].shape[1]],
                                                                       inputs["input_ids"])
    # the image changes the logits: the vision tower's output reaches the language model
    with torch.no_grad():
        other = model(**{**inputs, "pixel_values": inputs["pixel_values"] + 1.0}).logits
    assert not torch.allclose(logits[0, -1], other[0, -1])


def test_save_load_round_trip_is_exact(checkpoint: Path, tmp_path: Path) -> None:
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint).eval()
    processor = AutoProcessor.from_pretrained(checkpoint)
    model.save_pretrained(tmp_path / "again")
    processor.save_pretrained(tmp_path / "again")
    first, again = load_file(checkpoint / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "again").eval()
    inputs = encode(processor, [image(56, 56)])
    inputs_again = encode(AutoProcessor.from_pretrained(tmp_path / "again"), [image(56, 56)])
    assert inputs.keys() == inputs_again.keys() and all(torch.equal(inputs[k], inputs_again[k]) for k in inputs)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reloaded(**inputs_again).logits)


def test_same_seed_same_weights(checkpoint: Path, tmp_path: Path) -> None:
    again = load_file(make_tiny_vlm(tmp_path / "same") / "model.safetensors")
    other = load_file(make_tiny_vlm(tmp_path / "other", text=TinyModelSpec(seed=1)) / "model.safetensors")
    first = load_file(checkpoint / "model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["visual.patch_embed.proj.weight"], other["visual.patch_embed.proj.weight"])


def test_cli_writes_a_vlm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    argv = ["make-tiny-model", str(out), "--arch", "qwen2_5_vl", "--hidden", "64", "--layers", "2", "--heads", "2",
            "--kv-heads", "1", "--no-tie", "--seed", "3"]
    assert cli_main(argv) == 0
    assert "qwen2_5_vl" in capsys.readouterr().out
    config = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).config
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == \
        (64, 2, 2, 1)
    assert config.vision_config.out_hidden_size == 64 and text.rope_parameters["mrope_section"] == [4, 6, 6]
    assert "lm_head.weight" in load_file(out / "model.safetensors")
    with pytest.raises(SystemExit, match="not an MoE family"):
        cli_main(["make-tiny-model", str(tmp_path / "moe"), "--arch", "qwen2_5_vl", "--moe", "num_experts=4"])


def test_the_tiny_qwen3_vl_from_the_cli_and_the_bootstrap(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``--arch qwen3_vl``: Qwen3-VL's layout at the tiny sizes (a Qwen3 language model, interleaved M-RoPE over
    Qwen3-VL's 6:5:5 split, patch 16, a DeepStack merger per block but the last), whose processor expands a 64 × 64
    image to 4 tokens and which generates on it; ``model.build_if_missing: tiny_qwen3_vl`` builds the same model."""
    from transformers import Qwen3VLForConditionalGeneration

    from hybridrl.bootstrap import TINY_VLM_MODEL, ensure_model

    out = tmp_path / "cli"
    assert cli_main(["make-tiny-model", str(out), "--arch", "qwen3_vl", "--seed", "3"]) == 0
    assert "qwen3_vl" in capsys.readouterr().out
    model = Qwen3VLForConditionalGeneration.from_pretrained(out).eval()
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.head_dim, text.rope_parameters["mrope_section"], text.rope_parameters["mrope_interleaved"]) == \
        (32, [6, 5, 5], True)
    assert (vision.patch_size, list(vision.deepstack_visual_indexes)) == (16, [0])
    processor = AutoProcessor.from_pretrained(out)
    inputs = encode(processor, [image(64, 64)])
    assert inputs["input_ids"][0].tolist().count(processor.image_token_id) == 4
    assert inputs["pixel_values"].shape == (16, 3 * 2 * 16 * 16)
    assert model.generate(**inputs, max_new_tokens=3, do_sample=False).shape[1] == inputs["input_ids"].shape[1] + 3
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path / "cache"))
    built = tmp_path / "cache" / "tiny" / "random-qwen3-vl"
    ensure_model("tiny_qwen3_vl", str(built))
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl"
    assert config["text_config"]["hidden_size"] == TINY_VLM_MODEL.get("hidden", 128)
