"""The `hf` rollout engine on a vision-language checkpoint (Qwen2.5-VL and Qwen3-VL, issue 46): it samples with each
prompt's images, every token's log-prob is transformers' own full forward's (pixels and grids in; Qwen3-VL's DeepStack
features with them), the prefill-once and dropped-row paths give the same samples, and the weight swap reaches the
vision tower in place, under the checkpoint's names (Qwen2.5-VL: ``model.*``, ``visual.*``; Qwen3-VL:
``model.language_model.*``, ``model.visual.*``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoProcessor
from vlm_prompts import tool_context_gaps

from hybridrl.data.dots import draw_dots
from hybridrl.hf.arch import HFArch
from hybridrl.hf.vlm import checkpoint_vision
from hybridrl.interfaces import Generation, SamplingParams
from hybridrl.models.tiny import TinyModelSpec
from hybridrl.models.tiny_vlm import TinyVisionSpec, make_tiny_vlm
from hybridrl.registry import Registry
from hybridrl.rollout.engines.hf import HFRolloutEngine
from hybridrl.vlm.inputs import ImageInputs
from hybridrl.vlm.sglang_compat import transformers_rope_rules
from hybridrl.vlm.verify_vlm import hf_vlm_logits

torch.set_num_threads(1)
VISION = TinyVisionSpec(max_pixels=84 * 84)
Prompts = tuple[list[list[int]], list[ImageInputs | None]]


def tiny(path: Path, seed: int, family: str) -> Path:
    return make_tiny_vlm(path, text=TinyModelSpec(hidden=64, layers=2, heads=4, kv_heads=2, tie=False, seed=seed),
                         vision=VISION, family=family)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlms(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """Tiny VLMs A and B of one family (Qwen3-VL's patch is 16: its processor resizes the images of 56 and 84 pixels
    a side to 64 and 96, the same placeholder counts)."""
    tmp = tmp_path_factory.mktemp(f"hf_engine_images_{request.param}")
    return tiny(tmp / "a", seed=1, family=request.param), tiny(tmp / "b", seed=2, family=request.param)


@pytest.fixture(scope="module")
def prompts(vlms: tuple[Path, Path]) -> Prompts:
    """Two prompts with an image each, of different sizes (4 and 9 placeholders), and one of text alone."""
    with transformers_rope_rules():
        processor = AutoProcessor.from_pretrained(vlms[0])
    ids, images = [], []
    for size, text in ((56, "How many dots?"), (84, "Count them.")):
        image = draw_dots([(14, 14), (size - 14, size // 2)], size=size, radius=5)
        out = processor(text=[f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n"
                              "<|im_start|>assistant\n"], images=[image], return_tensors="pt")
        ids.append(out["input_ids"][0].tolist())
        images.append(ImageInputs(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                                  images=[image]))
    ids.append(processor.tokenizer("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    images.append(None)
    return ids, images


def engine(path: Path, **kw: object) -> HFRolloutEngine:
    return Registry("rollout_engines").build("hf", kw, key="actor_rollout_ref.rollout.engine_kwargs",
                                             model_path=str(path))


def full_forward_logprobs(path: Path, prompts: Prompts, g: Generation, temperature: float) -> torch.Tensor:
    """transformers' own model on prompt ‖ response, with the prompt's pixels and grids: each sampled token's
    log-prob."""
    ids, images = prompts
    prompt, image = ids[g.prompt_index], images[g.prompt_index]
    seq = torch.tensor([prompt + g.token_ids])
    logits = hf_vlm_logits(path, HFArch.from_hf(path), seq, None if image is None else image.pixel_values,
                           None if image is None else image.image_grid_thw)
    logp = torch.log_softmax(logits[0, len(prompt) - 1:-1].float() / temperature, -1)
    return logp.gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)


def test_sampling_with_images_gives_transformers_logprobs(vlms: tuple[Path, Path], prompts: Prompts) -> None:
    ids, images = prompts
    eng = engine(vlms[0])
    assert HFRolloutEngine.supports_images and eng.vision is not None
    out = eng.generate(ids, SamplingParams(temperature=0.8, max_new_tokens=6, n=2), seeds=[3, 4, 5], images=images)
    assert [g.prompt_index for g in out] == [0, 0, 1, 1, 2, 2]
    again = eng.generate(ids, SamplingParams(temperature=0.8, max_new_tokens=6, n=2), seeds=[3, 4, 5], images=images)
    assert [g.token_ids for g in again] == [g.token_ids for g in out]  # seeded
    worst = 0.0
    for g in out:
        assert g.token_ids
        want = full_forward_logprobs(vlms[0], prompts, g, 0.8)
        worst = max(worst, float((torch.tensor(g.logprobs) - want).abs().max()))
    assert worst <= 1e-5, worst
    # the images count: without them the same tokens get other log-probs
    blind = full_forward_logprobs(vlms[0], (ids, [None] * 3), out[0], 0.8)
    assert float((torch.tensor(out[0].logprobs) - blind).abs().max()) > 1e-3


def test_a_multi_turn_context_with_a_tool_image_gives_transformers_logprobs(vlms: tuple[Path, Path]) -> None:
    """A multi-turn episode's next turn: its context holds the prompt's image and, after the policy's call, the tool's
    image; the engine generates with both (log-probs = transformers' over the whole sequence), and the tool's image
    matters."""
    gap, other_image = tool_context_gaps(engine(vlms[0]), vlms[0])
    assert gap <= 1e-5 and other_image > 1e-3, (gap, other_image)


@pytest.mark.parametrize("option", ["prefill_once_per_prompt", "drop_finished"])
def test_prefill_once_and_dropped_rows_give_the_same_samples(vlms: tuple[Path, Path], prompts: Prompts,
                                                             option: str) -> None:
    ids, images = prompts
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, stop_token_ids=list(range(30, 60)))
    on = engine(vlms[0]).generate(ids, params, seeds=[7, 8, 9], images=images)
    off = engine(vlms[0], **{option: False}).generate(ids, params, seeds=[7, 8, 9], images=images)
    assert {len(g.token_ids) for g in on} != {8}  # rows finished early: the dropping ran
    assert [(g.prompt_index, g.token_ids, g.finish_reason) for g in on] == [
        (g.prompt_index, g.token_ids, g.finish_reason) for g in off]
    for a, b in zip(on, off, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_update_weights_swaps_language_model_and_vision_tower_in_place(vlms: tuple[Path, Path],
                                                                      prompts: Prompts) -> None:
    ids, images = prompts
    eng = engine(vlms[0])
    ptrs = {n: p.data_ptr() for n, p in eng.params.items()}
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    tower = checkpoint_vision(vlms[1]).vision_prefix  # type: ignore[union-attr]  # visual. or model.visual.
    weights = load_file(vlms[1] / "model.safetensors")  # the checkpoint's names: the language model's, tower, lm_head
    assert "lm_head.weight" in weights and any(n.startswith(tower) for n in weights)
    language = sorted(n for n in weights if not n.startswith(tower))
    eng.update_weights([[(n, weights[n]) for n in language[i:i + 5]] for i in range(0, len(language), 5)], version=3)
    fresh = engine(vlms[1]).generate(ids, params, images=images)
    half = eng.generate(ids, params, images=images)
    assert half[2].logprobs == fresh[2].logprobs  # text alone: the language model is the second one's
    assert half[0].logprobs != fresh[0].logprobs  # with an image: the first model's vision tower still
    eng.update_weights([[(n, w) for n, w in weights.items() if n.startswith(tower)]], version=4)
    after = eng.generate(ids, params, images=images)
    assert [(g.token_ids, g.logprobs) for g in after] == [(g.token_ids, g.logprobs) for g in fresh]
    assert all(g.weight_version == 4 for g in after)
    assert {n: p.data_ptr() for n, p in eng.params.items()} == ptrs  # same storage: swapped in place


def test_placeholders_that_do_not_match_the_image_are_an_error(vlms: tuple[Path, Path], prompts: Prompts) -> None:
    ids, images = prompts
    eng = engine(vlms[0])
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"hf engine: prompt 1's image placeholders do not match its images: image 0 "
                                         r"\(grid 1×6×6, merge 2\) needs 9 placeholder tokens in a row"):
        eng.generate(ids[1:2] + ids[:1], params, images=[images[1], images[1]])  # prompt 1: 4 placeholders
    with pytest.raises(ValueError, match=r"prompt 0's .*beyond the 0 image\(s\)"):
        eng.generate(ids[:1], params, images=[None])
    with pytest.raises(ValueError, match=r"hf engine: 1 image entries for 2 prompts"):
        eng.generate(ids[:2], params, images=images[:1])
