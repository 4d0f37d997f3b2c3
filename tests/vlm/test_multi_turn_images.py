"""Multi-turn episodes of a vision-language policy whose tool results carry images (issue 46), on a tiny random
Qwen2.5-VL and its processor: ``image_zoom_in``'s crop renders as an image part of the tool message, its placeholders
expanded as the processor expands them (turn by turn = the processor over the whole conversation, pixels included);
the episode's images grow in sequence order; a turn in which the policy samples a placeholder id ends the episode
("vision_token"); an image that does not fit the budget is left out whole; and the actor's positions over a row with
tool images in its response equal transformers' ``get_rope_index`` over the whole sequence."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from PIL import Image

from hybridrl.batch import SampleMeta
from hybridrl.data.images import image_messages
from hybridrl.data.multimodal import encode_prompt
from hybridrl.hf.arch import HFArch
from hybridrl.hf.vlm import checkpoint_vision
from hybridrl.interfaces import Generation
from hybridrl.models.tiny import TinyModelSpec
from hybridrl.models.tiny_vlm import make_tiny_vlm
from hybridrl.rollout.episodes import EpisodeActors, OwnedTurn
from hybridrl.rollout.multi_turn import _Sample
from hybridrl.rollout.turns import TurnRenderer
from hybridrl.tools.image_zoom import ImageZoomIn
from hybridrl.tools.runner import ToolRunner, tokenizer_cut
from hybridrl.vlm.inputs import ImageInputs
from hybridrl.vlm.megatron_vlm import batch_positions, image_slots
from hybridrl.vlm.tool_images import ToolImages

PROMPT = [{"role": "user", "content": "<image>How many dots?"}]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoProcessor

    model = make_tiny_vlm(tmp_path_factory.mktemp("mt_vlm") / "model",
                          text=TinyModelSpec(hidden=64, layers=2, heads=2, kv_heads=2, seed=4))
    processor = AutoProcessor.from_pretrained(model)
    image = Image.new("RGB", (84, 56), "white")
    image.paste((0, 0, 0), (10, 10, 30, 30))
    return {"model": model, "processor": processor, "image": image, "vision": checkpoint_vision(model)}


def _actors(vlm: dict[str, Any], *, images: bool = True) -> EpisodeActors:
    tok, vision = vlm["processor"].tokenizer, vlm["vision"]
    renderer = TurnRenderer(tok)
    renderer.check()
    runner = ToolRunner({"image_zoom_in_tool": ImageZoomIn()}, timeout_s=10, max_tokens=64, cut=tokenizer_cut(tok),
                        images=images)
    return EpisodeActors(renderer, runner, format="hermes", environment=None, environment_timeout_s=10,
                         max_assistant_turns=4,
                         images=ToolImages(vlm["processor"], image_token_id=vision.image_token_id,
                                           merge_size=vision.spatial_merge_size) if images else None,
                         vision_ids=frozenset({vision.image_token_id, vision.video_token_id}))


def _meta(vlm: dict[str, Any]) -> tuple[SampleMeta, list[int]]:
    encoded = encode_prompt(vlm["processor"], PROMPT, [vlm["image"]], base_dir=None, where="test")
    inputs = ImageInputs(pixel_values=encoded.pixel_values, image_grid_thw=encoded.image_grid_thw,
                         images=encoded.images)
    return SampleMeta(ground_truth="1", messages=image_messages(PROMPT), images=inputs), encoded.input_ids


def _call(box: list[int]) -> str:
    return f"<tool_call>{json.dumps({'name': 'image_zoom_in_tool', 'arguments': {'bbox_2d': box}})}</tool_call>"


def _turn(vlm: dict[str, Any], sample: _Sample, meta: SampleMeta, ids: list[int], turns: int) -> OwnedTurn:
    g = Generation(prompt_index=0, token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", weight_version=0)
    context = len(sample.prompt) + len(sample.response)
    ids = sample.add_turn(g, 10_000)
    return OwnedTurn(sample=0, ids=ids, logprobs=g.logprobs, cut=False, turns=turns, meta=meta, seed=0,
                     context_tokens=context, params=None)  # type: ignore[arg-type]


def _sampled(tok: Any, text: str) -> list[int]:
    return [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]


def test_tool_images_render_and_expand_as_the_processor_does(vlm: dict[str, Any]) -> None:
    """Two zoom calls in two turns, then an answer: prompt + Σ (sampled + appended) = the processor's ids of the whole
    conversation, and the episode's images (prompt's, then each crop) = its pixels and grids."""
    tok, processor = vlm["processor"].tokenizer, vlm["processor"]
    actors, (meta, prompt_ids) = _actors(vlm), _meta(vlm)
    sample = _Sample(prompt_index=0, prompt=prompt_ids, images=meta.images)
    actors.open(0, meta)
    boxes = [[0, 0, 42, 28], [10, 10, 20, 20]]  # 42×28: a 2×1-token crop; 10×10: resized up to 28×28
    for k, box in enumerate(boxes):
        act = actors.act([_turn(vlm, sample, meta, _sampled(tok, _call(box)), k + 1)])[0]
        assert act.images is not None and act.images.num_images == 1 and not act.done
        sample.apply(act, budget=10_000)
    final = actors.act([_turn(vlm, sample, meta, _sampled(tok, "1"), 3)])[0]
    assert final.done and final.appended == []
    sample.apply(final, budget=10_000)

    crops = [ImageZoomIn()({"bbox_2d": b}, sample=_sample_of(vlm)).images[0] for b in boxes]
    conversation = [*image_messages(PROMPT)]
    for box in boxes:
        said = f"Zoomed in on the image to the region {box}."
        conversation += [{"role": "assistant", "content": _call(box)},
                         {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": said}]}]
    conversation.append({"role": "assistant", "content": "1"})
    text = processor.apply_chat_template(conversation, tokenize=False)
    whole = processor(text=[text], images=[vlm["image"], *crops], return_tensors="pt")
    ids = whole["input_ids"][0].tolist()
    got = sample.prompt + sample.response
    assert got == ids[:len(got)] and len(ids) - len(got) == 1  # the template's "\n" after the last <|im_end|>
    assert sample.images is not None and sample.images.num_images == 3
    assert torch.equal(sample.images.image_grid_thw, whole["image_grid_thw"])
    assert torch.equal(sample.images.pixel_values, whole["pixel_values"])
    assert [im.size for im in sample.images.images] == [(84, 56), (42, 28), (28, 28)]
    image = vlm["vision"].image_token_id
    assert sample.mask.count(1) == sum(len(_sampled(tok, t)) for t in [*map(_call, boxes), "1"])
    assert all(m == 0 for t, m in zip(sample.response, sample.mask, strict=True) if t == image)


def _sample_of(vlm: dict[str, Any]) -> Any:
    from hybridrl.interfaces import ToolSample

    return ToolSample(meta=SampleMeta(), create_kwargs={}, images=[vlm["image"]])


def test_a_sampled_placeholder_ends_the_episode(vlm: dict[str, Any]) -> None:
    tok, image = vlm["processor"].tokenizer, vlm["vision"].image_token_id
    actors, (meta, prompt_ids) = _actors(vlm), _meta(vlm)
    sample = _Sample(prompt_index=0, prompt=prompt_ids, images=meta.images)
    actors.open(0, meta)
    ids = [*tok(_call([0, 0, 28, 28]), add_special_tokens=False)["input_ids"], image, tok.eos_token_id]
    act = actors.act([_turn(vlm, sample, meta, ids, 1)])[0]
    assert act.done and act.finish == "vision_token" and act.appended == []
    sample.apply(act, budget=10_000)
    assert sample.done and sample.generation().finish_reason == "vision_token"


def test_an_image_past_the_budget_is_left_out_whole(vlm: dict[str, Any]) -> None:
    tok = vlm["processor"].tokenizer
    actors, (meta, prompt_ids) = _actors(vlm), _meta(vlm)
    actors.open(0, meta)
    sample = _Sample(prompt_index=0, prompt=prompt_ids, images=meta.images)
    act = actors.act([_turn(vlm, sample, meta, _sampled(tok, _call([0, 0, 84, 56])), 1)])[0]
    (start, n), = act.image_runs
    assert n == 6  # 84×56 → 6×4 patches → 3×2 tokens
    budget = len(sample.response) + start + n - 1  # one placeholder short
    sample.apply(act, budget=budget)
    assert sample.done and sample.finish == "length"
    assert sample.images is not None and sample.images.num_images == 1  # no crop: the prompt's image only
    assert len(sample.response) == budget - n + 1 and vlm["vision"].image_token_id not in sample.response


def test_a_text_policy_gets_an_error_observation_for_images(vlm: dict[str, Any]) -> None:
    from hybridrl.tools.calls import ToolCall

    runner = ToolRunner({"image_zoom_in_tool": ImageZoomIn()}, timeout_s=10, max_tokens=256,
                        cut=tokenizer_cut(vlm["processor"].tokenizer))
    meta, _ = _meta(vlm)
    obs, = runner.run([ToolCall(name="image_zoom_in_tool", arguments={"bbox_2d": [0, 0, 9, 9]})], metas=[meta])
    assert obs.error and "returned 1 image(s), which this policy cannot see (a text model)" in obs.text


def test_positions_with_tool_images_equal_transformers_over_the_whole_row(vlm: dict[str, Any]) -> None:
    """A row of prompt (one image), a sampled turn, a tool result with two images, a sampled turn holding a
    placeholder id (text: the policy sampled it), padding: the actor's positions = transformers' get_rope_index of
    the whole row, whose token types mark the prompt's and the tool's placeholders as images."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    arch = HFArch.from_hf(vlm["model"])
    v = arch.vision
    assert v is not None
    image, start = v.image_token_id, v.vision_start_token_id
    prompt = [5, 6, start, *[image] * 6, 7, 8]
    response = [9, 10, 11, start, *[image] * 4, 12, start, *[image] * 2, 13, 14, image, 15, 16]
    loss = [1, 1, 1, 0, *[0] * 4, 0, 0, *[0] * 2, 0, 1, 1, 1, 1]
    grids = torch.tensor([[1, 4, 6], [1, 4, 4], [1, 2, 4]])
    row = torch.tensor(prompt + response + [0, 0])
    n = len(prompt) + len(response)
    slots = image_slots(torch.tensor([len(prompt)]), torch.tensor([loss + [0, 0]]), len(row))
    ours = batch_positions(row[None], torch.tensor([n]), grids, arch, slots)[:, 0, :n]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm["model"]).eval()
    types = ((row[:n] == image) & slots[0, :n]).int()
    ref, _ = model.model.get_rope_index(row[None, :n], types[None], grids, None, None,
                                        torch.ones(1, n, dtype=torch.long))
    assert torch.equal(ours, ref[:, 0])
    # the sampled placeholder is text: one past the token before it, on all three axes
    at = len(prompt) + response.index(image, 12)
    assert (ours[:, at] == ours[:, at - 1] + 1).all()
