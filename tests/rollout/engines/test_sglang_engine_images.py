"""The ``sglang`` rollout engine on Qwen2.5-VL and Qwen3-VL checkpoints (issue 46): prompts with images, on SGLang's
CPU build.

For each family one engine on tiny VLM A (:func:`hybridrl.models.tiny_vlm.make_tiny_vlm`, untied LM head) serves the
file's tests; transformers' own model is the reference for the sampled tokens' log-probs (Qwen3-VL's DeepStack
features included), before and after a swap to VLM B (another seed: language model and vision tower) under the
checkpoint's names. Items 12 and 13 of :mod:`hybridrl.rollout.engines.sglang_compat` are shown still needed here.
Time: ~70 s in pytest (Qwen3-VL's engine ~14 s of it), ~80 s with pytest's start on the shared 2-core machine — over
60 s because the first engine start takes 20–35 s (SGLang's scheduler process imports SGLang and loads the model; the
second ~10 s), its first generate ~15 s, and item 12's test imports SGLang's Qwen-VL processor in a fresh process
(10–27 s): only a process that never defined the ops shows the failure.
"""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from sglang_probes import SERVER_ARGS, parameter_storage
from vlm_prompts import Reference, encode_all, flipped, max_gap, tiny_vlm_pair, tool_context_gaps

from hybridrl.hf.vlm import checkpoint_vision
from hybridrl.interfaces import SamplingParams
from hybridrl.registry import Registry
from hybridrl.vlm.inputs import ImageInputs

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed: run `bash launch/install_sglang_cpu.sh` (CI's test command does)",
                allow_module_level=True)

from hybridrl.rollout.engines import sglang_compat as compat  # noqa: E402
from hybridrl.rollout.engines.sglang import CONFIG_KEY, SGLangEngineError, SGLangRolloutEngine  # noqa: E402

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
SPEC = dict(hidden=64, layers=2, heads=4, kv_heads=2, max_positions=256, tie=False)
# (h, w) of each prompt's images: 6; 2 + 4 placeholders; text (Qwen3-VL, patch 16: resized to 64 × 96, … — the same)
IMAGE_SIZES = [[(56, 84)], [(28, 56), (56, 56)], []]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlms(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    return tiny_vlm_pair(tmp_path_factory.mktemp(f"sglang_{request.param}"), request.param, **SPEC)


@pytest.fixture(scope="module")
def prompts(vlms: tuple[Path, Path]) -> tuple[list[list[int]], list[ImageInputs | None]]:
    return encode_all(vlms[0], IMAGE_SIZES)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(vlms: tuple[Path, Path]) -> Iterator[SGLangRolloutEngine]:
    eng = Registry("rollout_engines").build("sglang", {"server_args": SERVER_ARGS}, key=CONFIG_KEY,
                                            model_path=str(vlms[0]), device=torch.device("cpu"))
    yield eng
    eng.shutdown()


def test_samples_with_images_have_the_log_probs_of_transformers(engine: SGLangRolloutEngine, vlms: tuple[Path, Path],
                                                                prompts: Any) -> None:
    """One image, two images of other sizes, none: each sample's log-probs are transformers' on the trainer's
    expanded prompt with its images; the images matter (other pixels move them far more than the tolerance)."""
    ids, images = prompts
    assert SGLangRolloutEngine.supports_images
    assert SGLangRolloutEngine.model_problem(str(vlms[0]), device_type="cpu") is None
    gens = engine.generate(ids, SamplingParams(temperature=0.7, max_new_tokens=8, n=2), seeds=[1, 2, 3], images=images)
    assert [g.prompt_index for g in gens] == [0, 0, 1, 1, 2, 2] and all(g.token_ids for g in gens)
    ref = Reference(vlms[0])
    assert max_gap(gens, ids, images, ref, 0.7) <= 1e-4
    assert max_gap(gens[:4], ids, flipped(images), ref, 0.7) > 1e-2


def test_a_multi_turn_context_with_a_tool_image_has_the_log_probs_of_transformers(engine: SGLangRolloutEngine,
                                                                                     vlms: tuple[Path, Path]) -> None:
    """A multi-turn episode's next turn: its context holds the prompt's image and, after the policy's call, the tool's
    image; the engine generates with both (log-probs = transformers'), and the tool's image matters."""
    gap, other_image = tool_context_gaps(engine, vlms[0])
    assert gap <= 1e-4 and other_image > 1e-3, (gap, other_image)


def test_swap_to_another_vlm_gives_its_log_probs(engine: SGLangRolloutEngine, vlms: tuple[Path, Path],
                                                 prompts: Any) -> None:
    """VLM B's tensors under their checkpoint names (Qwen2.5-VL: ``model.*``, ``lm_head.weight``, ``visual.*``;
    Qwen3-VL: ``model.language_model.*``, ``lm_head.weight``, ``model.visual.*``), in buckets that split the language
    model and the vision tower: the same prompts and images (seen under A before) then score as
    B in transformers — the vision tower was loaded and no embedding of A's tower was reused (item 13) — and every
    parameter kept its storage."""
    ids, images = prompts
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine.generate(ids, greedy, images=images)  # prefix blocks (and, without item 13, embeddings) under A
    storage = parameter_storage(engine)
    assert any(n.startswith("visual.") for n in storage)
    b = sorted(load_file(vlms[1] / "model.safetensors").items())
    tower = checkpoint_vision(vlms[1]).vision_prefix  # type: ignore[union-attr]
    assert "lm_head.weight" in dict(b) and any(n.startswith(tower) for n, _ in b)
    third = len(b) // 3 + 1
    engine.update_weights(iter([b[:third], b[third:2 * third], b[2 * third:]]), version=3)
    gens = engine.generate(ids, greedy, images=images)
    assert parameter_storage(engine) == storage and all(g.weight_version == 3 for g in gens)  # in place
    assert max_gap(gens, ids, images, Reference(vlms[1]), 1.0) <= 1e-4
    engine.update_weights(iter([sorted(load_file(vlms[0] / "model.safetensors").items())]), version=4)  # A again


def test_prompts_and_images_that_do_not_match_are_refused(engine: SGLangRolloutEngine, prompts: Any) -> None:
    ids, images = prompts
    with pytest.raises(SGLangEngineError, match=r"prompt 0 has image placeholder runs of \[6\] .* make \[2, 4\]"):
        engine.generate([ids[0]], SamplingParams(max_new_tokens=2), images=[images[1]])  # 6 tokens too: SGLang takes it
    with pytest.raises(SGLangEngineError, match="2 image entries for 1 prompts"):
        engine.generate([ids[0]], SamplingParams(max_new_tokens=2), images=images[:2])


def test_item12_qwen_vl_processor_import_needs_the_cpu_ops() -> None:
    """sglang_compat item 12: in a process where they are not defined, SGLang's Qwen-VL processor module (through
    ``models/qwen3_5.py``) does not import on CPU."""
    code = ("import os; os.environ['SGLANG_USE_CPU_ENGINE'] = '1'\n"
            "import sglang.srt.multimodal.processors.qwen_vl")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert any(f"has no attribute '{op}'" in run.stderr for op in compat.CPU_OPS_IMPORTED), run.stderr[-2000:]


def test_item13_a_flush_keeps_the_vision_embedding_cache() -> None:
    """sglang_compat item 13: ``Scheduler.flush_cache`` does not touch the vision-embedding cache, which is on by
    default; a cache of 0 MB (what the engine starts with) stores nothing."""
    from sglang.srt.environ import envs
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult, MultiModalStaticCache

    assert "embedding_cache" not in inspect.getsource(Scheduler.flush_cache)
    assert envs.SGLANG_VLM_CACHE_SIZE_MB.default > 0
    assert not MultiModalStaticCache(0).set(1, EmbeddingResult(embedding=torch.ones(2, 2)))
