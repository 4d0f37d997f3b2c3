"""Test-only helpers of the engines' image tests (issue 46): prompts with images as the trainer makes them, and
transformers' own Qwen2.5-VL / Qwen3-VL as the reference for the sampled tokens' log-probs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from hybridrl.vlm.inputs import ImageInputs
from hybridrl.vlm.sglang_compat import transformers_rope_rules


def tiny_vlm_pair(tmp: Path, family: str = "qwen2_5_vl", **spec: Any) -> tuple[Path, Path]:
    """Tiny VLMs A and B of ``family`` (:func:`hybridrl.models.tiny_vlm.make_tiny_vlm`; seeds 1 and 2: other
    language model and vision tower) of the text ``spec`` (:class:`hybridrl.models.tiny.TinyModelSpec`)."""
    from hybridrl.models.tiny import TinyModelSpec
    from hybridrl.models.tiny_vlm import make_tiny_vlm

    return (make_tiny_vlm(tmp / "a", text=TinyModelSpec(seed=1, **spec), family=family),
            make_tiny_vlm(tmp / "b", text=TinyModelSpec(seed=2, **spec), family=family))


def image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def encode(processor: Any, text: str, images: list[Image.Image]) -> tuple[list[int], ImageInputs | None]:
    """The trainer's prompt (:func:`hybridrl.data.multimodal.encode_prompt`'s way): ids with the expanded
    placeholders, and the images as the sample carries them."""
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                             tokenize=False)
    out = processor(text=[rendered], images=images or None, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    if not images:
        return ids, None
    return ids, ImageInputs(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"], images=images)


def encode_all(model_dir: Path, sizes: list[list[tuple[int, int]]]) -> tuple[list[list[int]], list[ImageInputs | None]]:
    """Prompt ``k`` asks "what is k?" about images of ``sizes[k]`` ((h, w) each; none: a text prompt)."""
    from transformers import AutoProcessor

    with transformers_rope_rules():
        processor = AutoProcessor.from_pretrained(model_dir)
    encoded = [encode(processor, f"what is {k}?", [image(h, w, 10 * k + n) for n, (h, w) in enumerate(hw)])
               for k, hw in enumerate(sizes)]
    return [ids for ids, _ in encoded], [im for _, im in encoded]


def tool_context(model_dir: Path) -> tuple[list[int], ImageInputs]:
    """A multi-turn episode's next-turn context (issue 46): a user message with an image, the policy's tool call, the
    tool's message with a second image (its zoomed crop), the next generation prompt — the processor's ids of the
    conversation (what the rollout's turn-by-turn ids equal: tests/vlm/test_multi_turn_images.py) with both images,
    in order."""
    from transformers import AutoProcessor

    with transformers_rope_rules():
        processor = AutoProcessor.from_pretrained(model_dir)
    first, crop = image(56, 84, 7), image(28, 56, 8)
    call = '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 56, 28]}}</tool_call>'
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is left?"}]},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "Zoomed in."}]}]
    rendered = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    out = processor(text=[rendered], images=[first, crop], return_tensors="pt")
    return out["input_ids"][0].tolist(), ImageInputs(pixel_values=out["pixel_values"],
                                                     image_grid_thw=out["image_grid_thw"], images=[first, crop])


def tool_flipped(inputs: ImageInputs) -> ImageInputs:
    """``inputs`` with its last image's patches in reverse order: the tool's image changed, the prompt's kept."""
    last = int(inputs.image_grid_thw[-1].prod())
    pixels = torch.cat([inputs.pixel_values[:-last], inputs.pixel_values[-last:].flip(0)])
    return ImageInputs(pixel_values=pixels, image_grid_thw=inputs.image_grid_thw, images=inputs.images)


def tool_context_gaps(engine: Any, model_dir: Path) -> tuple[float, float]:
    """``engine``'s next turn of :func:`tool_context` (a few tokens at temperature 0.7): the largest |engine −
    transformers| log-prob, and the largest gap to transformers given another tool image (:func:`tool_flipped`)."""
    from hybridrl.interfaces import SamplingParams

    ids, images = tool_context(model_dir)
    gens = engine.generate([ids], SamplingParams(temperature=0.7, max_new_tokens=8, n=1), seeds=[5], images=[images])
    assert gens[0].token_ids
    ref = Reference(model_dir)
    return max_gap(gens, [ids], [images], ref, 0.7), max_gap(gens, [ids], [tool_flipped(images)], ref, 0.7)


class Reference:
    """transformers' Qwen2.5-VL or Qwen3-VL (fp32): log_softmax(logits / T) of a sample's tokens after its prompt and
    images."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForImageTextToText

        with transformers_rope_rules():  # hybridrl.vlm.sglang_compat
            self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
        self.image_token = self.model.config.image_token_id

    def logprobs(self, prompt: list[int], images: ImageInputs | None, tokens: list[int],
                 temperature: float) -> list[float]:
        """A sampled ``<|image_pad|>`` is text, as engines decode it: only the prompt's placeholders take the image
        features, image positions and (Qwen3-VL) DeepStack features (transformers' own ``forward`` would take every
        one as a placeholder), so this runs the language model as that ``forward`` does, on those placeholders."""
        ids = torch.tensor([prompt + tokens])
        types = torch.zeros_like(ids, dtype=torch.int)
        types[0, :len(prompt)] = (ids[0, :len(prompt)] == self.image_token).int()
        with torch.no_grad():
            if images is None:
                logits = self.model(input_ids=ids, mm_token_type_ids=types).logits
            else:
                inner, mask = self.model.model, types.bool()
                emb = inner.get_input_embeddings()(ids)
                seen = inner.get_image_features(images.pixel_values, images.image_grid_thw)
                emb[mask] = torch.cat(seen.pooler_output).to(emb.dtype)
                positions, _ = inner.get_rope_index(ids, types, image_grid_thw=images.image_grid_thw)
                deepstack = {}
                if getattr(seen, "deepstack_features", None):  # Qwen3-VL: added after the first decoder layers
                    deepstack = {"visual_pos_masks": mask,
                                 "deepstack_visual_embeds": [torch.cat(f) for f in seen.deepstack_features]}
                hidden = inner.language_model(inputs_embeds=emb, position_ids=positions, **deepstack)[0]
                logits = self.model.lm_head(hidden)
        scaled = logits[0, len(prompt) - 1:-1] / (temperature or 1.0)
        return scaled.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def max_gap(gens: list[Any], prompts: list[list[int]], images: list[ImageInputs | None], ref: Reference,
            temperature: float) -> float:
    """The largest |engine − reference| sampled-token log-prob over ``gens``."""
    return max(max(abs(a - b) for a, b in zip(g.logprobs, ref.logprobs(
        prompts[g.prompt_index], images[g.prompt_index], g.token_ids, temperature), strict=True)) for g in gens)


def flipped(images: list[ImageInputs | None]) -> list[ImageInputs | None]:
    """The same grids with each prompt's patches in reverse order: other pixels at the same placeholders."""
    return [None if im is None else ImageInputs(pixel_values=im.pixel_values.flip(0), image_grid_thw=im.image_grid_thw,
                                                images=im.images) for im in images]
