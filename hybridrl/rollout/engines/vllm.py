"""Rollout engine ``vllm``: a vLLM engine (V1) whose weights are swapped in place.

The engine is vLLM's offline ``LLM`` started in the trainer process of the first rank of each rollout group, in
multiprocess mode: the model runs in vLLM's EngineCore process (and its workers, one per engine TP rank), token ids in
and out, no tokenizer. Importing this module does not import vllm; starting the engine does. Every adaptation to
vLLM's own behaviour is in :mod:`hybridrl.rollout.engines.vllm_compat` (items referred to below).

- **Log-probs.** The sampled token's log-prob under softmax(logits / T) (``logprobs_mode="processed_logprobs"``,
  item 3) — what the actor recomputes; greedy (T=0) reports the untempered log_softmax. Deviation from ``hf`` and
  ``sglang``: with top-k/top-p on, vLLM reports the log-prob within the truncated, renormalised distribution (the one
  sampled from), the others before truncation; with ``top_k=-1, top_p=1`` (every recipe) they agree.
- **Seeds.** ``generate(..., seeds=...)``: sample ``j`` of prompt ``i`` is one vLLM request with
  ``SamplingParams.seed`` = a hash of ``(seeds[i], j)`` alone (:func:`hybridrl.seeds.request_seed`).
  vLLM samples a seeded request from a generator of its own, so a sample does not depend on the other requests of
  the call: the per-sample seed contract holds, on CPU and GPU.
- **Weight swap.** ``update_weights`` sends each HF-named bucket to the engine's workers as safetensors bytes
  (``collective_rpc``: tensors do not survive its msgpack transport) inside one layerwise-reload session
  (:mod:`hybridrl.rollout.engines.vllm_worker`, item 1): the parameters' storage is kept, nothing is written to
  disk, the engine is not restarted. The prefix cache is reset after every swap (item 2). Names and shapes are checked
  against the checkpoint first (vLLM would skip an unknown name). On GPU the bytes go through host memory (no
  CUDA IPC yet).
- **Memory phases.** On GPU the engine starts with ``enable_sleep_mode`` and ``release_memory`` calls
  ``sleep(level=engine_kwargs.sleep_level)``: level 1 drops the KV cache and offloads the weights to host memory,
  level 2 drops both (the next weight swap writes them back). ``resume_memory`` wakes it. On CPU vLLM has no sleep
  mode (item 9): both calls are no-ops, and ``hybridrl validate`` says so.
- **Router replay (R3).** With ``engine_kwargs.return_routed_experts`` (set by the run when
  ``actor.router_replay.mode=R3``) the engine starts with vLLM's aux output and each finished sample carries the experts
  of every position it ran, its MoE layers in order (``Generation.routed_experts``). GPU only (item 13); written
  against vLLM 0.32's API and not yet run on a GPU here (``tests/gpu/test_router_replay_gpu.py``).
- **Images.** A vision-language checkpoint (Qwen2.5-VL, Qwen3-VL with its DeepStack features) generates with its
  prompts' images (``generate(images=...)``): vLLM runs the checkpoint's processor on the decoded images and its own
  vision tower. It expands each image's ``<|image_pad|>`` itself, so each run of placeholders is collapsed to one
  before the prompt goes in, and the prompt vLLM ran is checked to be the trainer's (items 14, 15). A swap covers the
  vision tower (the checkpoint's names: ``visual.*``; Qwen3-VL's ``model.visual.*``) and drops the encoder cache
  (vision embeddings of the old weights) with the prefix cache.
- **Processes.** The engine's processes never outlive the trainer: ``shutdown`` (idempotent), an ``atexit`` hook,
  SIGTERM/SIGINT, and a watcher process for a SIGKILLed trainer (item 5,
  :func:`hybridrl.rollout.engines.processes.start_reaper`) kill exactly the engine's processes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from hybridrl.interfaces import EngineMemory, Generation, SamplingParams, TokenScores, WeightBucket
from hybridrl.rollout.engines import processes
from hybridrl.rollout.engines import vllm_compat as compat
from hybridrl.rollout.engines.routed_rows import moe_layers, routed_rows
from hybridrl.rollout.engines.server_engine import CONFIG_KEY, DTYPES, ServerEngine, check_engine_config
from hybridrl.vlm.inputs import ImageInputs

__all__ = ["CONFIG_KEY", "DTYPES", "VLLMEngineError", "VLLMRolloutEngine"]
WORKER_EXTENSION = "hybridrl.rollout.engines.vllm_worker.WeightReceiver"
# engine args the engine sets itself; `engine_args` may not override them
_OWNED_ENGINE_ARGS = frozenset({"model", "tokenizer", "skip_tokenizer_init", "tensor_parallel_size", "logprobs_mode",
                                "worker_extension_cls", "enable_sleep_mode", "seed", "dtype", "enforce_eager",
                                "kv_cache_memory_bytes", "gpu_memory_utilization"})


class VLLMEngineError(RuntimeError):
    """The vLLM engine failed to start, died, or refused a request."""


class VLLMRolloutEngine(ServerEngine):
    label: ClassVar[str] = "vLLM"
    scores_tempered: ClassVar[bool] = False  # score() at temperature 1 only (vllm_compat item 12)
    supports_routed_experts: ClassVar[bool] = True  # with engine_kwargs.return_routed_experts, on GPU (item 13)
    supports_images: ClassVar[bool] = True  # a vision-language checkpoint's prompts' images (items 14, 15)
    error: ClassVar[type[RuntimeError]] = VLLMEngineError
    # abort(): the step loop aborts its unfinished requests, keeping their tokens

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Keys of ``actor_rollout_ref.rollout.engine_kwargs``; null = the right value for the device."""

        dtype: str | None = None  # auto | float32 | bfloat16 | float16; null: float32 on CPU, bfloat16 on GPU
        # KV cache size; null: 256 MiB on CPU, from actor_rollout_ref.rollout.gpu_memory_utilization on GPU
        kv_cache_memory_bytes: int | None = None
        max_num_seqs: int | None = None  # requests decoded together; null: vLLM's
        max_model_len: int | None = None  # null: the model's max_position_embeddings
        enforce_eager: bool | None = None  # no CUDA graphs; null: true on CPU, vLLM's default on GPU
        enable_prefix_caching: bool | None = None  # null: vLLM's (on): multi-turn contexts reuse their prefix's KV
        enable_sleep_mode: bool | None = None  # release/resume free device memory; null: on for GPU (CPU: none)
        sleep_level: int = 1  # 1: KV cache dropped, weights to host memory and back; 2: both dropped
        cpu_threads: int | None = None  # CPU: OpenMP threads of the engine's processes; null: 1
        seed: int = 0  # the engine's own randomness (requests without a per-sample seed)
        rpc_timeout_s: float | None = 600.0  # one weight-swap call to the engine's workers; null: no limit
        log_level: str = "error"  # vLLM's log level (debug | info | warning | error)
        # record each position's experts for R3 router replay (vLLM's aux output; GPU only, vllm_compat item 13); the
        # run sets it when actor_rollout_ref.actor.router_replay.mode=R3
        return_routed_experts: bool = False
        # verl's key for a vision-language model: no cache of processed images between requests (vLLM ≥ 0.10 names it
        # mm_processor_cache_gb=0). Not needed for correctness here: the cache holds processor outputs, which no weight
        # swap changes (the tower's outputs, which one does, are dropped at each swap: vllm_compat item 2)
        disable_mm_preprocessor_cache: bool = False
        engine_args: dict[str, Any] = field(default_factory=dict)  # any other vLLM EngineArgs, verbatim

        def __post_init__(self) -> None:
            check_engine_config(self, at_least_one=("kv_cache_memory_bytes", "max_num_seqs", "max_model_len",
                                                    "cpu_threads"), passthrough="engine_args", owned=_OWNED_ENGINE_ARGS)
            if self.sleep_level not in (1, 2):
                raise ValueError(f"sleep_level={self.sleep_level}; valid: 1 (weights kept in host memory) or 2 "
                                 "(weights dropped; the next weight swap writes them)")
            if self.rpc_timeout_s is not None and self.rpc_timeout_s <= 0:
                raise ValueError(f"rpc_timeout_s={self.rpc_timeout_s} must be > 0 or null")
            if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
                raise ValueError(f"log_level={self.log_level!r}; valid: debug, info, warning, error, critical")

    @classmethod
    def plan_notes(cls, config: Config, *, device_type: str, tp_size: int = 1) -> list[str]:
        """What ``hybridrl validate`` says about this engine on ``device_type``; raises ValueError on a config the
        device cannot run."""
        if device_type != "cpu":
            return []
        if config.return_routed_experts:
            raise ValueError(compat.ROUTED_EXPERTS_CPU)
        if config.enable_sleep_mode:
            raise ValueError("enable_sleep_mode=true needs a GPU (vLLM has no sleep mode on CPU); unset it")
        if tp_size > 1:
            raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size} with vllm needs GPUs "
                             "(vLLM's CPU engine runs one worker); use 1 on CPU")
        return ["rollout engine vllm on CPU: release/resume around the train phase are no-ops (vLLM has no sleep "
                f"mode on CPU); its KV cache ({CONFIG_KEY}.kv_cache_memory_bytes) stays allocated through training"]

    @classmethod
    def memory_budget(cls, config: Config, *, device_type: str, gpu_memory_utilization: float) -> EngineMemory | None:
        """On GPU vLLM takes ``gpu_memory_utilization`` of the device at start (weights, KV pool, workspace); its
        sleep mode frees both weights (level 1: to host memory) and KV for the train phase."""
        if device_type == "cpu":
            return None
        sleeping = config.enable_sleep_mode is not False
        return EngineMemory(fraction=gpu_memory_utilization, kv_pool_bytes=config.kv_cache_memory_bytes,
                            weights_released=sleeping, kv_released=sleeping)

    def __init__(self, config: Config, *, model_path: str, device: str | torch.device = "cpu", tp_size: int = 1,
                 gpu_memory_utilization: float = 0.5, **ctx: Any) -> None:
        self._calls = 0  # calls so far (request ids: hybridrl-<call>-<k>)
        self.llm: Any = None
        self.reaper: Any = None
        super().__init__(config, model_path=model_path, device=device, tp_size=tp_size,
                         gpu_memory_utilization=gpu_memory_utilization)
        self.cpu = self.device.type == "cpu"
        self.sleep_mode = not self.cpu if config.enable_sleep_mode is None else config.enable_sleep_mode
        self.moe_layers: list[int] | None = None  # the MoE layers among vLLM's routed-experts rows (R3)
        self.image_token = compat.image_token_id(self.model_path)  # <|image_pad|>; None: a text-only model
        if config.return_routed_experts:
            if self.cpu:
                raise VLLMEngineError(compat.ROUTED_EXPERTS_CPU)
            self.moe_layers = moe_layers(self.model_path, error=VLLMEngineError)
        if self.cpu:
            if config.enable_sleep_mode:
                raise VLLMEngineError(f"{CONFIG_KEY}.enable_sleep_mode=true needs a GPU: vLLM has no sleep mode on "
                                      "CPU (release/resume are no-ops there); unset it")
            if tp_size > 1:
                raise VLLMEngineError("actor_rollout_ref.rollout.tensor_model_parallel_size > 1 with vllm needs GPUs "
                                      "(vLLM's CPU engine runs one worker here); use 1 on CPU")
            problem = self.model_problem(self.model_path, device_type="cpu")
            if problem:
                raise VLLMEngineError(f"the vLLM CPU engine cannot serve {self.model_path} "
                                      f"(actor_rollout_ref.model.path): {problem}")
        self.engine_args = self._engine_args()
        self._start()

    @staticmethod
    def model_problem(model_path: str, *, device_type: str) -> str | None:
        """Why this engine can't serve the checkpoint on ``device_type`` (validation asks too), or None."""
        return compat.cpu_head_dim_problem(model_path) if device_type == "cpu" else None

    # ---- start / stop ----
    def _engine_args(self) -> dict[str, Any]:
        c, cpu = self.config, self.cpu
        args: dict[str, Any] = dict(
            model=self.model_path, skip_tokenizer_init=self.image_token is None, tensor_parallel_size=self.tp_size,
            dtype=c.dtype or ("float32" if cpu else "bfloat16"), logprobs_mode=compat.LOGPROBS_MODE,
            worker_extension_cls=WORKER_EXTENSION, seed=c.seed, enable_sleep_mode=self.sleep_mode,
            enforce_eager=cpu if c.enforce_eager is None else c.enforce_eager,
        )
        if cpu:
            args["kv_cache_memory_bytes"] = c.kv_cache_memory_bytes or compat.CPU_KV_CACHE_BYTES
            args |= compat.CPU_ENGINE_ARGS  # item 16: no split prefill of a seeded request
        elif c.kv_cache_memory_bytes is not None:
            args["kv_cache_memory_bytes"] = c.kv_cache_memory_bytes
        else:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        for name in ("max_num_seqs", "max_model_len", "enable_prefix_caching"):
            if getattr(c, name) is not None:
                args[name] = getattr(c, name)
        if c.return_routed_experts:
            args["enable_return_routed_experts"] = True
        if c.disable_mm_preprocessor_cache:
            args["mm_processor_cache_gb"] = 0
        return args | c.engine_args

    def _start(self) -> None:
        import psutil

        env = compat.engine_env(cpu=self.cpu, threads=self.config.cpu_threads or 1, log_level=self.config.log_level)
        if self.config.return_routed_experts:
            env |= compat.ROUTED_EXPERTS_ENV
        if not self.cpu:
            env["CUDA_VISIBLE_DEVICES"] = _visible_devices(self.device, self.tp_size)
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        t0 = time.perf_counter()
        try:
            with processes.without_torchrun_env(), processes.environ(env):
                from vllm import LLM

                self.llm = LLM(**self.engine_args)
        except BaseException as e:
            processes.kill_processes(processes.new_children(before))
            if isinstance(e, KeyboardInterrupt):
                raise
            raise VLLMEngineError(f"the vLLM engine failed to start: {type(e).__name__}: {e}. "
                                  f"Engine config: {self.describe()}") from e
        self.procs = processes.new_children(before)
        self.reaper = processes.start_reaper(self.procs)
        processes.shut_down_at_exit(self, self.shutdown)
        self.start_seconds = time.perf_counter() - t0

    def shutdown(self) -> None:
        """Stop the engine's processes (idempotent); other children of the trainer are left alone."""
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        processes.forget(self)
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - a dead engine cannot shut down cleanly; its processes are killed below
            pass
        processes.kill_processes(self.procs)
        processes.stop_reaper(self.reaper)
        self.procs, self.reaper = [], None

    # ---- generate ----
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *,
                 seeds: Sequence[int] | None = None,
                 max_new_tokens: Sequence[int] | None = None,
                 images: Sequence[ImageInputs | None] | None = None) -> list[Generation]:
        every, limits, stop = self._requests(prompts, params, seeds, max_new_tokens)
        expanded = [(i, j) for i, j in every if limits[i] > 0]
        self._check_alive()
        from vllm import SamplingParams as VLLMSamplingParams

        if params.return_routed_experts and self.moe_layers is None:
            raise VLLMEngineError("SamplingParams.return_routed_experts: the engine was started without "
                                  f"{CONFIG_KEY}.return_routed_experts (R3 sets it)")
        requests = [self._prompt(prompts[i], images[i] if images else None) for i, _ in expanded]
        sampling = [VLLMSamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
            max_tokens=limits[i], stop_token_ids=stop, logprobs=0, detokenize=False,
            seed=self.seed(seeds, i, j)) for i, j in expanded]
        outs = self._run(requests, sampling)
        for (i, _), out in zip(expanded, outs, strict=True):
            if images and images[i] is not None and out is not None:
                if problem := compat.check_expanded(out.prompt_token_ids, prompts[i]):  # item 15
                    raise VLLMEngineError(f"prompt {i}: {problem}")
        made = {key: self._generation(key[0], out, len(prompts[key[0]]) if params.return_routed_experts else None)
                for key, out in zip(expanded, outs, strict=True)}
        # a prompt capped at 0 new tokens gets empty samples (vLLM needs max_tokens ≥ 1)
        return [made.get((i, j)) or Generation(prompt_index=i, token_ids=[], logprobs=[], finish_reason="length",
                                               weight_version=self.version)
                for i in range(len(prompts)) for j in range(params.n)]

    def _prompt(self, ids: list[int], images: ImageInputs | None) -> Any:
        from vllm.inputs import TokensPrompt

        if images is None or not images.num_images:
            return TokensPrompt(prompt_token_ids=list(ids))
        if self.image_token is None:
            raise VLLMEngineError(f"a prompt came with images, but {self.model_path} (actor_rollout_ref.model.path) "
                                  "has no vision tower")
        return TokensPrompt(**compat.image_prompt(ids, images, self.image_token))  # item 15

    def score(self, sequences: Sequence[list[int]], *, starts: Sequence[int], topk: int = 0,
              temperature: float = 1.0) -> list[TokenScores]:
        """Teacher-forced scores of ``sequences[i][starts[i]:]`` (:class:`~hybridrl.interfaces.TokenScores`): one
        request per sequence with vLLM's ``prompt_logprobs`` (the ``topk`` most likely tokens at each position, and
        the sequence's own), one token generated and dropped."""
        if temperature != 1.0:
            raise VLLMEngineError(f"the vLLM engine scores prompts under the untempered softmax only "
                                  f"(temperature={temperature} asked; {compat.PROMPT_LOGPROBS_UNTEMPERED})")
        self._check_alive()
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(s)) for s in sequences]
        sampling = [VLLMSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=topk, detokenize=False)
                    for _ in sequences]
        outs = self._run(requests, sampling)
        return [_token_scores(out.prompt_logprobs, seq, start, topk)
                for out, seq, start in zip(outs, sequences, starts, strict=True)]

    def _run(self, requests: list[Any], sampling: list[Any]) -> list[Any]:
        """``LLM.generate``'s engine loop, stepped here so that :meth:`abort` can stop it between steps: each
        request's latest (cumulative) output, in request order; None for one cut short before its first token."""
        if not requests:
            return []
        if self._abort.is_set():
            return [None] * len(requests)
        self._calls += 1
        ids = [f"hybridrl-{self._calls}-{k}" for k in range(len(requests))]
        for rid, request, params in zip(ids, requests, sampling, strict=True):
            compat.add_cumulative_request(self.llm, rid, request, params)  # item 10
        engine, latest = self.llm.llm_engine, {}
        try:
            while engine.has_unfinished_requests():
                if self._abort.is_set():
                    break
                for out in engine.step():
                    latest[out.request_id] = out
        finally:  # aborted, or failed: nothing of this call stays queued in the engine
            if left := [i for i in ids if not getattr(latest.get(i), "finished", False)]:
                engine.abort_request(left)
        return [latest.get(i) for i in ids]

    def _generation(self, prompt_index: int, out: Any, routed_prompt_len: int | None = None) -> Generation:
        """``out`` as a Generation; with ``routed_prompt_len`` (R3) its routed experts too."""
        if out is None or not out.finished:  # abort(): what it had (cumulative outputs)
            sample = None if out is None else out.outputs[0]
            token_ids = [] if sample is None else [int(t) for t in sample.token_ids]
            steps = [] if sample is None else (sample.logprobs or [])[:len(token_ids)]
            return Generation(prompt_index=prompt_index, token_ids=token_ids[:len(steps)],
                              logprobs=[float(step[t].logprob) for step, t in zip(steps, token_ids, strict=False)],
                              finish_reason="abort", weight_version=self.version)
        [sample] = out.outputs
        if sample.finish_reason not in ("stop", "length"):
            raise VLLMEngineError(f"the vLLM engine did not finish a request: {sample.finish_reason!r}. "
                                  f"Engine config: {self.describe()}")
        token_ids = [int(t) for t in sample.token_ids]
        steps = sample.logprobs or []
        if len(steps) != len(token_ids):
            raise VLLMEngineError(f"vLLM returned {len(token_ids)} tokens but {len(steps)} log-probs")
        logprobs = [float(step[t].logprob) for step, t in zip(steps, token_ids, strict=True)]
        routed = None
        if routed_prompt_len is not None:
            routed = self._routed_experts(sample.routed_experts, routed_prompt_len + len(token_ids) - 1)
        return Generation(prompt_index=prompt_index, token_ids=token_ids, logprobs=logprobs,
                          finish_reason=sample.finish_reason, weight_version=self.version, routed_experts=routed)

    def _routed_experts(self, rows: Any, positions: int) -> torch.Tensor:
        """vLLM's ``[positions, layers, top-k]`` rows as ``Generation.routed_experts`` (int16, MoE layers only)."""
        if rows is None:
            raise VLLMEngineError("vLLM returned no routed experts for a finished sample (engine config: "
                                  f"{self.describe()})")
        assert self.moe_layers is not None
        return routed_rows(rows, positions, self.moe_layers, engine="vLLM", error=VLLMEngineError)

    # ---- weight swap: one layerwise-reload session of the workers ----
    def _begin_update(self) -> None:
        self._rpc("hybridrl_begin_weights")

    def _send_bucket(self, bucket: WeightBucket, *, last: bool, version: int) -> int:
        from safetensors.torch import save

        payload = save({n: t.detach().to("cpu").contiguous() for n, t in bucket})
        self._rpc("hybridrl_load_weights", payload)
        return len(payload)

    def _end_update(self) -> None:
        self._rpc("hybridrl_finish_weights")

    def _after_update(self, version: int) -> None:
        self.llm.reset_prefix_cache()  # item 2: cached KV of the old weights
        if self.image_token is not None:
            self.llm.llm_engine.reset_encoder_cache()  # item 2: and the old vision tower's embeddings
        self.llm.update_weight_version(str(version))

    def storage(self) -> dict[str, int]:
        """``{parameter name: data_ptr}`` of the served model's weights (engine TP rank 0)."""
        return self._rpc("hybridrl_storage")

    def _rpc(self, method: str, *args: Any) -> Any:
        try:
            return self.llm.collective_rpc(method, timeout=self.config.rpc_timeout_s, args=args)[0]
        except TimeoutError as e:
            raise VLLMEngineError(f"vLLM {method} took longer than {CONFIG_KEY}.rpc_timeout_s="
                                  f"{self.config.rpc_timeout_s} s; engine config: {self.describe()}") from e

    # ---- memory phases ----
    def release_memory(self) -> None:
        if not self.sleep_mode or self._released:
            return  # CPU: no sleep mode (item 9)
        self._check_alive()
        self.llm.sleep(level=self.config.sleep_level)
        self._released = {"weights", "kv_cache"}

    def _restore_tags(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def _check_alive(self) -> None:
        if self.llm is None:
            raise VLLMEngineError("the vLLM engine was shut down")
        dead = [p.pid for p in self.procs if not processes.alive(p)]
        if dead:
            raise VLLMEngineError(f"vLLM engine process(es) {dead} died (see their log above); "
                                  f"engine config: {self.describe()}")


def _token_scores(prompt_logprobs: list[Any], seq: list[int], start: int, topk: int) -> TokenScores:
    """A request's ``prompt_logprobs`` (one dict of token id → Logprob per prompt position, None at the first) as
    the scores of ``seq[start:]``: each token's own log-prob and the ``topk`` of rank 1..topk, most likely first."""
    positions = prompt_logprobs[start:len(seq)]
    logprobs = torch.tensor([float(d[t].logprob) for d, t in zip(positions, seq[start:], strict=True)])
    scores = TokenScores(logprobs=logprobs)
    if topk > 0:
        ranked = [sorted((v.rank, tid, v.logprob) for tid, v in d.items() if v.rank <= topk)[:topk]
                  for d in positions]
        scores.topk_ids = torch.tensor([[tid for _, tid, _ in r] for r in ranked], dtype=torch.long)
        scores.topk_logprobs = torch.tensor([[float(lp) for _, _, lp in r] for r in ranked])
    return scores


def _visible_devices(device: torch.device, tp_size: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for an engine on ``tp_size`` devices from ``device``, in the trainer's numbering."""
    first = device.index or 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return ",".join(ids[first:first + tp_size])

