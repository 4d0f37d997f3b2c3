"""Rollout engine ``sglang``: a colocated SGLang engine whose weights are swapped in place.

The engine is started in the trainer process of the first rank of each rollout group (SGLang's
offline ``Engine``: a scheduler process per engine TP rank plus a detokenizer process; token ids in
and out, no tokenizer). Importing this module does not import sglang; starting the engine does.

- **Log-probs.** SGLang reports the sampled token's log-prob under softmax(logits / T), before
  top-k/top-p truncation (``log(probs)`` in ``Sampler.forward``), which is what the actor recomputes
  with log_softmax(logits / T); greedy (T=0) reports the untempered log_softmax — the same
  conventions as the ``hf`` engine. ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` would switch SGLang to
  untempered log-probs at every T, so the engine refuses to start with it set.
- **Seeds.** ``generate(..., seeds=...)``: sample ``j`` of prompt ``i`` is one SGLang request with
  ``sampling_seed`` = a hash of ``(seeds[i], j)`` alone (not of ``i``, so a prompt samples the same
  wherever it sits in a call). SGLang honours per-request seeds only with
  ``enable_deterministic_inference`` (batch-invariant kernels, CUDA/XPU only); otherwise samples come
  from the scheduler's generator, seeded once at start with ``random_seed``. On CPU, sampling is
  therefore not reproducible call by call, and the per-sample seed contract is not honoured.
- **Weight swap.** ``update_weights`` streams the HF-named buckets with ``update_weights_from_tensor``
  inside ``begin_weight_update()/end_weight_update()``, one ``FlattenedTensorBucket`` per bucket
  (``load_format="flattened_bucket"``: one tensor and its metadata, shared memory on CPU, CUDA IPC on
  GPU). SGLang's ``load_weights`` copies into the existing parameters; the prefix cache is flushed
  with the last bucket, which also sets the weight version every later sample reports. Names and
  shapes are checked against the checkpoint first (SGLang skips unknown names silently). Fixed cost
  on CPU: ~0.45 s per swap waiting for an idle scheduler (a cache flush, i.e. ``gc.collect()``).
- **Images.** A vision-language checkpoint (Qwen2.5-VL, Qwen3-VL with its DeepStack features) generates with its
  prompts' images (``generate(images=)``): each request carries the trainer's own processor output
  (``image_data=[{"format": "processor_output", "pixel_values", "image_grid_thw"}]``, all of a prompt's images in one
  item) beside its ids, whose ``<|image_pad|>`` runs are already expanded. SGLang keeps those ids as they are and runs
  no processor of its own, so the engine sees the pixels and placeholders the actor trains on. A swap covers the
  vision tower (the checkpoint's names: ``visual.*``; Qwen3-VL's ``model.visual.*``);
  SGLang's vision-embedding cache is off, as it outlives a swap (sglang_compat item 13). On CPU the engine also
  defines the kernel ops whose absence hides SGLang's Qwen-VL processor (item 12).
- **Router replay (R3).** With ``engine_kwargs.return_routed_experts`` (set by the run when
  ``actor.router_replay.mode=R3``) the server records each position's experts (``enable_return_routed_experts``) and a
  finished sample carries them (``meta_info["routed_experts"]``: base64 of int32 ``[prompt + output − 1, decoder
  layers, top-k]``), its MoE layers in order (``Generation.routed_experts``; :mod:`~.routed_rows`). GPU only: an MoE
  model is refused on CPU (sglang_compat item 10). Not yet run on a GPU here (``tests/gpu/test_router_replay_gpu.py``).
- **Memory phases.** ``release_memory`` releases the KV cache (and the weights, with
  ``release_weights``) through ``release_memory_occupation``; ``resume_memory`` restores weights
  before the KV cache. On by default on GPU (``enable_memory_saver``: null = on there), where it frees memory for the
  train phase; ``free_cache_engine=true`` runs it without (on CPU it frees nothing and costs a cache
  flush, ~0.5 s: SGLang's CPU ``empty_cache`` is a ``gc.collect()``).
- **Processes.** The engine's processes never outlive the trainer: ``shutdown`` (idempotent), an
  ``atexit`` hook and SIGTERM/SIGINT handlers kill exactly the engine's processes; a crashed engine
  process raises :class:`SGLangEngineError` in the trainer instead of SGLang's SIGKILL of the whole
  process tree (:mod:`hybridrl.rollout.engines.sglang_process`). Every adaptation to SGLang's own behaviour
  lives in :mod:`hybridrl.rollout.engines.sglang_compat`.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, ClassVar

import torch

from hybridrl.hf.arch import HFArch
from hybridrl.hf.vlm import checkpoint_vision
from hybridrl.interfaces import EngineMemory, Generation, SamplingParams, TokenScores, WeightBucket
from hybridrl.rollout.engines import sglang_compat as compat
from hybridrl.rollout.engines import sglang_process as process
from hybridrl.rollout.engines.routed_rows import moe_layers, routed_rows
from hybridrl.rollout.engines.server_engine import CONFIG_KEY, DTYPES, ServerEngine, check_engine_config
from hybridrl.rollout.engines.sglang_process import SGLangEngineError
from hybridrl.vlm.inputs import ImageInputs

__all__ = ["CONFIG_KEY", "DTYPES", "SGLangEngineError", "SGLangRolloutEngine"]
LOAD_FORMATS = ("flattened_bucket", "tensors")
CPU_MAX_TOTAL_TOKENS = 16384
# server args the engine sets itself; `server_args` may not override them
_OWNED_SERVER_ARGS = frozenset({"model_path", "device", "tp_size", "skip_tokenizer_init", "base_gpu_id",
                                "custom_sigquit_handler", "weight_version",
                                "mem_fraction_static"})  # actor_rollout_ref.rollout.gpu_memory_utilization


class SGLangRolloutEngine(ServerEngine):
    label: ClassVar[str] = "SGLang"
    error: ClassVar[type[RuntimeError]] = SGLangEngineError
    marks_last_bucket: ClassVar[bool] = True  # the cache flush and the new version come with the last bucket
    scores_tempered: ClassVar[bool] = False  # score() at temperature 1 only (sglang_compat item 11)
    supports_images: ClassVar[bool] = True  # a vision-language checkpoint's prompts' images (items 12, 13)
    supports_routed_experts: ClassVar[bool] = True  # with engine_kwargs.return_routed_experts, on GPU (item 10)
    # abort(): SGLang's abort of every request, partial outputs kept

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Keys of ``actor_rollout_ref.rollout.engine_kwargs``; null = the right value for the device."""

        dtype: str | None = None  # auto | float32 | bfloat16 | float16; null: float32 on CPU, bfloat16 on GPU
        max_total_tokens: int | None = None  # KV cache size in tokens; null: 16384 on CPU, from memory on GPU
        max_running_requests: int | None = None  # null: SGLang's
        attention_backend: str | None = None  # null: torch_native on CPU, SGLang's choice on GPU
        sampling_backend: str | None = None  # null: pytorch on CPU, SGLang's choice on GPU
        disable_cuda_graph: bool | None = None  # null: true on CPU, SGLang's default on GPU
        # release/resume really free device memory (torch_memory_saver); null: on for GPU (colocated with the
        # trainer, as verl runs SGLang), off on CPU (where there is nothing to free)
        enable_memory_saver: bool | None = None
        free_cache_engine: bool | None = None  # release the KV cache for the train phase; null: = enable_memory_saver
        release_weights: bool = False  # release_memory also frees the weights (needs enable_memory_saver)
        cpu_threads: int | None = None  # CPU: OpenMP threads of the engine's scheduler; null: 1
        update_weights_load_format: str = "flattened_bucket"  # flattened_bucket | tensors
        enable_deterministic_inference: bool = False  # GPU only: honours per-sample seeds; slower
        random_seed: int | None = None  # seeds the engine's sampler once at start; null: SGLang's
        request_timeout_s: float | None = 1800.0  # one generate / weight-update call; null: no limit
        start_timeout_s: float = 600.0  # engine start, model load included
        log_level: str = "error"  # SGLang's log level (debug | info | warning | error)
        # record each position's experts for R3 router replay (GPU only: item 10); the run sets it when
        # actor_rollout_ref.actor.router_replay.mode=R3
        return_routed_experts: bool = False
        server_args: dict[str, Any] = field(default_factory=dict)  # any other SGLang ServerArgs, verbatim

        def __post_init__(self) -> None:
            check_engine_config(self, at_least_one=("max_total_tokens", "max_running_requests", "cpu_threads"),
                                passthrough="server_args", owned=_OWNED_SERVER_ARGS)
            if self.update_weights_load_format not in LOAD_FORMATS:
                raise ValueError(f"update_weights_load_format={self.update_weights_load_format!r}; "
                                 f"valid: {', '.join(LOAD_FORMATS)}")
            if self.release_weights and self.enable_memory_saver is False:
                raise ValueError("release_weights=true needs enable_memory_saver (true, or null on GPU)")
            if self.request_timeout_s is not None and self.request_timeout_s <= 0:
                raise ValueError(f"request_timeout_s={self.request_timeout_s} must be > 0 or null")
            if self.start_timeout_s <= 0:
                raise ValueError(f"start_timeout_s={self.start_timeout_s} must be > 0")

    @classmethod
    def plan_notes(cls, config: Config, *, device_type: str, tp_size: int = 1) -> list[str]:
        """Raises ValueError on a config the device cannot run (validation asks before any model exists)."""
        if device_type == "cpu" and config.return_routed_experts:
            raise ValueError(compat.ROUTED_EXPERTS_CPU)
        return []

    @classmethod
    def memory_budget(cls, config: Config, *, device_type: str, gpu_memory_utilization: float) -> EngineMemory | None:
        """On GPU SGLang takes ``gpu_memory_utilization`` of the device at start (its ``mem_fraction_static``:
        weights + KV pool); with the memory saver, release frees the KV pool (and the weights with
        ``release_weights``)."""
        if device_type == "cpu":
            return None
        saver = config.enable_memory_saver is not False
        kv = saver if config.free_cache_engine is None else (config.free_cache_engine and saver)
        return EngineMemory(fraction=gpu_memory_utilization, weights_released=config.release_weights,
                            kv_released=kv)

    def __init__(self, config: Config, *, model_path: str, device: str | torch.device = "cpu", tp_size: int = 1,
                 gpu_memory_utilization: float = 0.5, **ctx: Any) -> None:
        self.engine: Any = None
        self.failure: str | None = None  # set when an engine process died
        super().__init__(config, model_path=model_path, device=device, tp_size=tp_size,
                         gpu_memory_utilization=gpu_memory_utilization)
        cpu = self.device.type == "cpu"
        self.memory_saver = not cpu if config.enable_memory_saver is None else config.enable_memory_saver
        problem = self.model_problem(self.model_path, device_type=self.device.type)
        if problem:
            raise SGLangEngineError(f"the SGLang engine cannot serve {self.model_path} (actor_rollout_ref.model.path) "
                                    f"on {self.device.type}: {problem}")
        self.vision = checkpoint_vision(self.model_path)  # None: a causal LM
        self.moe_layers: list[int] | None = None  # R3: the MoE layers among SGLang's routed-experts rows
        self.routed_top_k = 0  # R3: the experts per token in each row (HF num_experts_per_tok)
        if config.return_routed_experts:
            self.moe_layers = moe_layers(self.model_path, error=SGLangEngineError)
            self.routed_top_k = HFArch.from_hf(self.model_path).moe.top_k  # type: ignore[union-attr]
        self.server_args = self._server_args()
        self._start()

    @staticmethod
    def model_problem(model_path: str, *, device_type: str) -> str | None:
        """Why this engine can't serve the checkpoint on ``device_type`` (validation asks too), or None."""
        return compat.cpu_moe_problem(model_path) if device_type == "cpu" else None

    # ---- start / stop ----
    def _server_args(self) -> dict[str, Any]:
        c, cpu = self.config, self.device.type == "cpu"
        if cpu and (c.enable_memory_saver or c.release_weights):
            raise SGLangEngineError(f"{CONFIG_KEY}.enable_memory_saver=true needs a CUDA device "
                                    "(torch_memory_saver); on CPU release/resume are no-ops anyway: set false")
        if not cpu and c.cpu_threads is not None:
            raise SGLangEngineError(f"{CONFIG_KEY}.cpu_threads is for the CPU engine; unset it on {self.device}")
        if cpu and c.enable_deterministic_inference:
            raise SGLangEngineError(f"{CONFIG_KEY}.enable_deterministic_inference=true needs a CUDA/XPU device "
                                    "(SGLang's batch-invariant kernels); set false on CPU")
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            raise SGLangEngineError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would report untempered "
                                    "log-probs, which the actor does not compute; unset it")
        args: dict[str, Any] = dict(
            model_path=self.model_path, tp_size=self.tp_size, skip_tokenizer_init=True,
            dtype=c.dtype or ("float32" if cpu else "bfloat16"), log_level=c.log_level, weight_version="0",
            enable_memory_saver=self.memory_saver, custom_sigquit_handler=process.on_sigquit,
        )
        if c.release_weights:
            args["enable_weights_cpu_backup"] = True  # a resume restores the weights' content
        if cpu:
            args.update(device="cpu", attention_backend=c.attention_backend or "torch_native",
                        sampling_backend=c.sampling_backend or "pytorch",
                        disable_cuda_graph=True if c.disable_cuda_graph is None else c.disable_cuda_graph,
                        max_total_tokens=c.max_total_tokens or CPU_MAX_TOTAL_TOKENS)
        else:
            args.update(device=self.device.type, base_gpu_id=self.device.index or 0)
            for name in ("attention_backend", "sampling_backend", "disable_cuda_graph", "max_total_tokens"):
                if getattr(c, name) is not None:
                    args[name] = getattr(c, name)
        if not cpu:  # verl's rollout.gpu_memory_utilization is SGLang's mem_fraction_static
            args["mem_fraction_static"] = self.gpu_memory_utilization
        for name in ("max_running_requests", "random_seed"):
            if getattr(c, name) is not None:
                args[name] = getattr(c, name)
        if c.enable_deterministic_inference:
            args["enable_deterministic_inference"] = True
        if c.return_routed_experts:
            args["enable_return_routed_experts"] = True
        return args | c.server_args

    def _start(self) -> None:
        cpu = self.device.type == "cpu"
        if cpu:
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read when sglang is imported, here and in its children
        import psutil

        before = {p.pid for p in psutil.Process().children(recursive=True)}
        t0 = time.perf_counter()
        threads = process.thread_env(self.config.cpu_threads or 1) if cpu else nullcontext()
        if self.vision is not None and cpu:
            compat.define_missing_cpu_ops()  # item 12: else SGLang finds no Qwen-VL processor
        vision = compat.no_vision_cache() if self.vision is not None else nullcontext()  # item 13
        contexts: list[Any] = []
        with process.starting(self):  # until the failed start's processes are killed too
            try:
                with compat.contexts_made() as contexts, compat.keep_start_method(), compat.without_torchrun_env(), \
                        threads, vision, process.deadline(self.config.start_timeout_s, what="start"):
                    from sglang.srt.entrypoints.engine import Engine

                    self.engine = Engine(**self.server_args)
            except BaseException as e:
                compat.kill_processes(compat.new_children(before))
                compat.destroy_contexts(contexts)  # no engine object to shut down: its sockets would hang a GC
                if isinstance(e, KeyboardInterrupt):
                    raise
                raise SGLangEngineError(f"the SGLang engine failed to start: {type(e).__name__}: {e}. "
                                        f"Engine config: {self.describe()}") from e
        self.procs = compat.new_children(before)
        process.supervise(self)
        self.start_seconds = time.perf_counter() - t0

    def shutdown(self) -> None:
        """Stop the engine's processes (idempotent); other children of the trainer are left alone."""
        if self.engine is None:
            return
        engine, self.engine = self.engine, None
        process.release(self)
        compat.shutdown_engine(engine, self.procs)
        self.procs = []

    # ---- generate ----
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *,
                 seeds: Sequence[int] | None = None,
                 max_new_tokens: Sequence[int] | None = None,
                 images: Sequence[ImageInputs | None] | None = None) -> list[Generation]:
        expanded, limits, stop = self._requests(prompts, params, seeds, max_new_tokens)
        if params.return_routed_experts and self.moe_layers is None:
            raise SGLangEngineError("SamplingParams.return_routed_experts: the engine was started without "
                                    f"{CONFIG_KEY}.return_routed_experts (R3 sets it)")
        image_data = self._image_data(prompts, images)
        if not expanded:
            return []
        self._check_alive()
        if self._abort.is_set():  # interrupted before it started: nothing sampled
            return [Generation(prompt_index=i, token_ids=[], logprobs=[], finish_reason="abort",
                               weight_version=self.version) for i, _ in expanded]
        base = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                    max_new_tokens=params.max_new_tokens, stop_token_ids=stop)
        sampling = [base | {"max_new_tokens": limits[i]}
                    | ({} if seeds is None else {"sampling_seed": self.seed(seeds, i, j)}) for i, j in expanded]
        input_ids = [list(prompts[i]) for i, _ in expanded]
        with_images = {} if image_data is None else {"image_data": [image_data[i] for i, _ in expanded]}
        outs = self._call(self.engine.async_generate(input_ids=input_ids, sampling_params=sampling,
                                                     return_logprob=True, **with_images,
                                                     return_routed_experts=params.return_routed_experts),
                          what="generate")
        outs = outs if isinstance(outs, list) else [outs]
        return [self._generation(i, out, len(prompts[i]) if params.return_routed_experts else None)
                for (i, _), out in zip(expanded, outs, strict=True)]

    def _image_data(self, prompts: Sequence[list[int]],
                    images: Sequence[ImageInputs | None] | None) -> list[list[dict[str, Any]] | None] | None:
        """Each prompt's ``image_data`` (None: no images): its processor output as one item, once its placeholder
        runs are checked against the images' grids (SGLang places the features at the placeholders as they are, and
        does not check them)."""
        if images is None or not any(x is not None and x.num_images for x in images):
            return None
        if len(images) != len(prompts):
            raise SGLangEngineError(f"{len(images)} image entries for {len(prompts)} prompts (one per prompt, None "
                                    "for a prompt without images)")
        if self.vision is None:
            raise SGLangEngineError(f"a prompt came with images, but {self.model_path} "
                                    "(actor_rollout_ref.model.path) has no vision tower")
        out: list[list[dict[str, Any]] | None] = []
        for i, (ids, x) in enumerate(zip(prompts, images, strict=True)):
            if x is None or not x.num_images:
                out.append(None)
                continue
            want = (x.image_grid_thw.prod(-1) // self.vision.spatial_merge_size ** 2).tolist()
            if (have := _runs(ids, self.vision.image_token_id)) != want:
                raise SGLangEngineError(f"prompt {i} has image placeholder runs of {have} tokens (token "
                                        f"{self.vision.image_token_id}), its images' grids "
                                        f"{x.image_grid_thw.tolist()} make {want}")
            out.append([{"format": "processor_output", "pixel_values": x.pixel_values,
                         "image_grid_thw": x.image_grid_thw}])
        return out

    def score(self, sequences: Sequence[list[int]], *, starts: Sequence[int], topk: int = 0,
              temperature: float = 1.0) -> list[TokenScores]:
        """Teacher-forced scores of ``sequences[i][starts[i]:]`` (:class:`~hybridrl.interfaces.TokenScores`): one
        request per sequence returning its input log-probs from ``starts[i]`` (and the ``topk`` most likely tokens
        there), under the untempered softmax (sglang_compat item 11: ``temperature`` must be 1); one token generated
        and dropped."""
        if temperature != 1.0:
            raise SGLangEngineError(f"the SGLang engine scores input tokens under the untempered softmax only "
                                    f"(temperature={temperature} asked; sglang_compat item 11)")
        self._check_alive()
        sampling = [{"temperature": 1.0, "max_new_tokens": 1} for _ in sequences]
        outs = self._call(self.engine.async_generate(
            input_ids=[list(s) for s in sequences], sampling_params=sampling, return_logprob=True,
            logprob_start_len=[int(s) - 1 for s in starts], top_logprobs_num=topk), what="score")
        outs = outs if isinstance(outs, list) else [outs]
        return [_token_scores(out["meta_info"], seq, start, topk)
                for out, seq, start in zip(outs, sequences, starts, strict=True)]

    def _generation(self, prompt_index: int, out: dict[str, Any], routed_prompt_len: int | None = None) -> Generation:
        """``out`` as a Generation; with ``routed_prompt_len`` (R3) a finished one's routed experts too."""
        meta = out["meta_info"]
        finish = meta["finish_reason"] or {}
        if finish.get("type") == "abort" and self._abort.is_set():  # abort(): the tokens so far, continued later
            finish = {"type": "abort"}
        elif finish.get("type") not in ("stop", "length"):
            raise SGLangEngineError(f"the SGLang engine did not finish a request: {finish}. "
                                    f"Engine config: {self.describe()}")
        token_ids = list(out["output_ids"])
        logprobs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
        if len(logprobs) != len(token_ids):
            raise SGLangEngineError(f"SGLang returned {len(token_ids)} tokens but {len(logprobs)} log-probs")
        spans = meta.get("weight_versions") or [{"version": meta["weight_version"]}]
        routed = None
        if routed_prompt_len is not None and finish["type"] != "abort":
            routed = self._routed_experts(meta.get("routed_experts"), routed_prompt_len + len(token_ids) - 1)
        return Generation(prompt_index=prompt_index, token_ids=token_ids, logprobs=logprobs,
                          finish_reason=finish["type"], weight_version=min(int(s["version"]) for s in spans),
                          routed_experts=routed)

    def _routed_experts(self, encoded: str | None, positions: int) -> torch.Tensor:
        """SGLang's ``meta_info["routed_experts"]`` (base64 of an int32 ``[positions, layers, top-k]`` tensor's bytes,
        ``DetokenizerManager._b64_encode_per_request``) as ``Generation.routed_experts``."""
        if encoded is None:
            raise SGLangEngineError("SGLang returned no routed experts for a finished sample (engine config: "
                                    f"{self.describe()})")
        assert self.moe_layers is not None
        data, k = base64.b64decode(encoded), self.routed_top_k
        if positions < 1 or not data or len(data) % (4 * positions * k):  # int32: 4 bytes a value
            raise SGLangEngineError(f"SGLang's routed experts hold {len(data) / 4:g} values; expected [{positions} "
                                    f"positions (prompt + output − 1), layers, top-{k}]")
        flat = torch.frombuffer(bytearray(data), dtype=torch.int32)
        return routed_rows(flat.view(positions, -1, k), positions, self.moe_layers, engine="SGLang",
                           error=SGLangEngineError)

    def _abort_running(self) -> None:
        if self.engine is not None:
            compat.abort_all(self.engine)

    # ---- weight swap: one begin/end_weight_update session ----
    def _begin_update(self) -> None:
        self._wait_until_idle()
        self._ok(self._call(compat.weight_update_session(self.engine, "begin"), what="begin_weight_update"))

    def _send_bucket(self, bucket: WeightBucket, *, last: bool, version: int) -> int:
        request = compat.update_weights_from_tensor(
            self.engine, self._payloads(bucket), load_format=self._load_format(), flush_cache=last,
            weight_version=str(version) if last else None)  # the flush and the version come last
        self._ok(self._call(request, what="update_weights_from_tensor"))
        return sum(t.numel() * t.element_size() for _, t in bucket)

    def _sent_all(self, count: int, version: int) -> None:
        if count == 0:  # nothing streamed: still stamp the version
            self._call(compat.set_weight_version(self.engine, str(version)), what="update_weight_version")

    def _end_update(self) -> None:
        if self.failure is None:  # a dead engine has no session to end
            self._ok(self._call(compat.weight_update_session(self.engine, "end"), what="end_weight_update"))

    def _load_format(self) -> str | None:
        return "flattened_bucket" if self.config.update_weights_load_format == "flattened_bucket" else None

    def _payloads(self, bucket: WeightBucket) -> list[bytes]:
        from sglang.srt.utils import MultiprocessingSerializer

        if any(t.is_cuda for _, t in bucket):  # CUDA IPC handles name the device by UUID, as SGLang's own sync does
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            monkey_patch_torch_reductions()
        if self.config.update_weights_load_format == "flattened_bucket":
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

            flat = FlattenedTensorBucket(named_tensors=[(n, t.detach()) for n, t in bucket])
            data: Any = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        else:
            data = [(n, t.detach()) for n, t in bucket]
        payload = MultiprocessingSerializer.serialize(data)
        return [payload] * self.tp_size  # every engine TP rank loads the full tensors and keeps its shard

    # ---- memory phases ----
    def release_memory(self) -> None:
        c = self.config
        if not (self.memory_saver if c.free_cache_engine is None else c.free_cache_engine):
            return  # without the memory saver there is nothing to free (SGLang would only flush its cache)
        tags = ["kv_cache", "weights"] if c.release_weights else ["kv_cache"]
        tags = [t for t in tags if t not in self._released]
        if tags:  # SGLang releases the KV cache first, then the weights
            self._check_alive()
            self._wait_until_idle()
            self._call(compat.memory_occupation(self.engine, "release", tags), what="release_memory_occupation")
            self._released.update(tags)

    def _restore_tags(self, tags: list[str]) -> None:
        self._call(compat.memory_occupation(self.engine, "resume", tags), what="resume_memory_occupation")

    # ---- calls into the engine ----
    def _call(self, coroutine: Any, *, what: str) -> Any:
        """Run one engine coroutine on its loop, bounded by ``request_timeout_s``."""
        timeout = self.config.request_timeout_s
        try:
            return compat.run(self.engine, coroutine, timeout)
        except asyncio.CancelledError as e:  # by _on_sigquit: an engine process died during the call
            raise SGLangEngineError(self.failure or f"SGLang {what} was cancelled") from e
        except TimeoutError as e:
            raise SGLangEngineError(f"SGLang {what} took longer than {CONFIG_KEY}.request_timeout_s={timeout} s; "
                                    f"engine config: {self.describe()}") from e

    def _wait_until_idle(self) -> None:
        result = self._call(compat.wait_until_idle(self.engine, self.config.request_timeout_s), what="flush_cache")
        self._ok((result.success, result.message))

    def _ok(self, result: tuple[bool, str]) -> None:
        """SGLang refuses a request by returning ``(False, message)``, not by raising: raise it."""
        success, message = result
        if not success:
            raise SGLangEngineError(f"the SGLang engine refused the request: {message}. "
                                    f"Engine config: {self.describe()}")

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise SGLangEngineError(self.failure)
        if self.engine is None:
            raise SGLangEngineError("the SGLang engine was shut down")
        dead = [p for p in self.procs if not process.alive(p)]
        if dead:
            raise SGLangEngineError(f"SGLang engine process(es) {[p.pid for p in dead]} died (see their log above); "
                                    f"engine config: {self.describe()}")



def _runs(ids: Sequence[int], token: int) -> list[int]:
    """The lengths of the runs of ``token`` in ``ids``, in order."""
    return [len(list(run)) for t, run in groupby(ids) if t == token]


def _token_scores(meta: dict[str, Any], seq: list[int], start: int, topk: int) -> TokenScores:
    """A request's input log-probs from position ``start − 1`` (SGLang reports None for the first: no token before
    it scores it) as the scores of ``seq[start:]``."""
    n = len(seq) - start
    steps = meta["input_token_logprobs"][-n:] if n else []
    if len(steps) != n or any(t != tok for (_, t, _), tok in zip(steps, seq[start:], strict=True)):
        raise SGLangEngineError(f"SGLang scored {len(steps)} input tokens, {n} were asked for from position {start}")
    scores = TokenScores(logprobs=torch.tensor([float(lp) for lp, _, _ in steps]))
    if topk > 0:
        tops = meta["input_top_logprobs"][-n:]
        scores.topk_ids = torch.tensor([[int(t) for _, t, _ in top[:topk]] for top in tops], dtype=torch.long)
        scores.topk_logprobs = torch.tensor([[float(lp) for lp, _, _ in top[:topk]] for top in tops])
    return scores
