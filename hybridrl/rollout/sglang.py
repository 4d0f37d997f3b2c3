"""Rollout engine ``sglang``: a colocated SGLang engine whose weights are swapped in place.

The engine is started in the trainer process of the first rank of each rollout group (SGLang's
offline ``Engine``: a scheduler process per engine TP rank plus a detokenizer process; token ids in
and out, no tokenizer). Importing this module does not import sglang; starting the engine does.

- **Log-probs.** SGLang reports the sampled token's log-prob under softmax(logits / T), before
  top-k/top-p truncation (``log(probs)`` in ``Sampler.forward``), which is what the actor recomputes
  with log_softmax(logits / T); greedy (T=0) reports the untempered log_softmax — the same
  conventions as the ``hf`` engine. ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` would switch SGLang to
  untempered log-probs at every T, so the engine refuses to start with it set.
- **Seeds.** ``SamplingParams.seed`` becomes a distinct SGLang ``sampling_seed`` per sample. SGLang
  honours per-request seeds only with ``enable_deterministic_inference`` (batch-invariant kernels,
  CUDA/XPU only); otherwise samples come from the scheduler's generator, seeded once at start with
  ``random_seed``. On CPU, sampling is therefore not reproducible call by call.
- **Weight swap.** ``update_weights`` streams the HF-named buckets with ``update_weights_from_tensor``
  inside ``begin_weight_update()/end_weight_update()``, one ``FlattenedTensorBucket`` per bucket
  (``load_format="flattened_bucket"``: one tensor and its metadata, shared memory on CPU, CUDA IPC on
  GPU). SGLang's ``load_weights`` copies into the existing parameters; the prefix cache is flushed
  with the last bucket, which also sets the weight version every later sample reports. Names and
  shapes are checked against the checkpoint first (SGLang skips unknown names silently). Fixed cost
  on CPU: ~0.45 s per swap waiting for an idle scheduler (a cache flush, i.e. ``gc.collect()``).
- **Memory phases.** ``release_memory`` releases the KV cache (and the weights, with
  ``release_weights``) through ``release_memory_occupation``; ``resume_memory`` restores weights
  before the KV cache. On by default with ``enable_memory_saver`` (GPU), where it frees memory for the
  train phase; ``free_cache_engine=true`` runs it without (on CPU it frees nothing and costs a cache
  flush, ~0.5 s: SGLang's CPU ``empty_cache`` is a ``gc.collect()``).
- **Processes.** The engine's processes never outlive the trainer: ``shutdown`` (idempotent), an
  ``atexit`` hook and SIGTERM/SIGINT handlers kill exactly the engine's processes; a crashed engine
  process raises :class:`SGLangEngineError` in the trainer instead of SGLang's SIGKILL of the whole
  process tree. Every adaptation to SGLang's own behaviour lives in :mod:`hybridrl.rollout.sglang_compat`.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import torch

from hybridrl.interfaces import Generation, SamplingParams, WeightBucket
from hybridrl.rollout import sglang_compat as compat

CONFIG_KEY = "actor_rollout_ref.rollout.engine_kwargs"
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("flattened_bucket", "tensors")
CPU_MAX_TOTAL_TOKENS = 16384
# server args the engine sets itself; `server_args` may not override them
_OWNED_SERVER_ARGS = frozenset({"model_path", "device", "tp_size", "skip_tokenizer_init", "base_gpu_id",
                                "custom_sigquit_handler", "custom_weight_loader", "weight_version"})
_STORAGE_REPORTER = "hybridrl.rollout.sglang.report_parameter_storage"


class SGLangEngineError(RuntimeError):
    """The SGLang engine failed to start, crashed, timed out or refused a request."""


class SGLangRolloutEngine:
    supports_tensor_parallel: ClassVar[bool] = True

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Keys of ``actor_rollout_ref.rollout.engine_kwargs``; null = the right value for the device."""

        dtype: str | None = None  # auto | float32 | bfloat16 | float16; null: float32 on CPU, bfloat16 on GPU
        mem_fraction_static: float | None = None  # share of device memory for weights + KV cache; null: SGLang's
        max_total_tokens: int | None = None  # KV cache size in tokens; null: 16384 on CPU, from memory on GPU
        max_running_requests: int | None = None  # null: SGLang's
        attention_backend: str | None = None  # null: torch_native on CPU, SGLang's choice on GPU
        sampling_backend: str | None = None  # null: pytorch on CPU, SGLang's choice on GPU
        disable_cuda_graph: bool | None = None  # null: true on CPU, SGLang's default on GPU
        enable_memory_saver: bool = False  # GPU: release/resume really free memory (torch_memory_saver)
        free_cache_engine: bool | None = None  # release the KV cache for the train phase; null: = enable_memory_saver
        release_weights: bool = False  # release_memory also frees the weights (needs enable_memory_saver)
        cpu_threads: int | None = None  # CPU: OpenMP threads of the engine's scheduler; null: 1
        update_weights_load_format: str = "flattened_bucket"  # flattened_bucket | tensors
        enable_deterministic_inference: bool = False  # GPU only: honours per-sample seeds; slower
        random_seed: int | None = None  # seeds the engine's sampler once at start; null: SGLang's
        request_timeout_s: float | None = 1800.0  # one generate / weight-update call; null: no limit
        start_timeout_s: float = 600.0  # engine start, model load included
        log_level: str = "error"  # SGLang's log level (debug | info | warning | error)
        server_args: dict[str, Any] = field(default_factory=dict)  # any other SGLang ServerArgs, verbatim

        def __post_init__(self) -> None:
            if self.dtype is not None and self.dtype not in DTYPES:
                raise ValueError(f"dtype={self.dtype!r}; valid: {', '.join(DTYPES)} or null")
            if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
                raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1] or null")
            for name in ("max_total_tokens", "max_running_requests", "cpu_threads"):
                value = getattr(self, name)
                if value is not None and value < 1:
                    raise ValueError(f"{name}={value} must be ≥ 1 or null")
            if self.update_weights_load_format not in LOAD_FORMATS:
                raise ValueError(f"update_weights_load_format={self.update_weights_load_format!r}; "
                                 f"valid: {', '.join(LOAD_FORMATS)}")
            if self.release_weights and not self.enable_memory_saver:
                raise ValueError("release_weights=true needs enable_memory_saver=true")
            if self.request_timeout_s is not None and self.request_timeout_s <= 0:
                raise ValueError(f"request_timeout_s={self.request_timeout_s} must be > 0 or null")
            if self.start_timeout_s <= 0:
                raise ValueError(f"start_timeout_s={self.start_timeout_s} must be > 0")
            typed = {f.name for f in fields(self)} - {"server_args"}
            clash = sorted((set(self.server_args) & typed) | (set(self.server_args) & _OWNED_SERVER_ARGS))
            if clash:
                raise ValueError(f"server_args may not set {clash}: use the engine's own keys or let the "
                                 "trainer set them")

    def __init__(self, config: Config, *, model_path: str, device: str | torch.device = "cpu", tp_size: int = 1,
                 **ctx: Any) -> None:
        self.config = config
        self.device = torch.device(device)
        self.model_path = str(model_path)
        self.tp_size = tp_size
        self.version = 0
        self.engine: Any = None
        self.procs: list[Any] = []  # psutil.Process of the engine's own processes
        self._released: set[str] = set()
        self.failure: str | None = None  # set when an engine process died
        self.last_update: dict[str, float] = {}  # seconds, megabytes, buckets of the last weight swap
        self.stop_ids = _eos_token_ids(self.model_path)
        self.shapes = _checkpoint_shapes(self.model_path)  # HF name -> shape: what an update may send
        self.server_args = self._server_args()
        self._start()

    # ---- start / stop ----
    def _server_args(self) -> dict[str, Any]:
        c, cpu = self.config, self.device.type == "cpu"
        if cpu and c.enable_memory_saver:
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
            enable_memory_saver=c.enable_memory_saver, custom_sigquit_handler=_on_sigquit,
            custom_weight_loader=[_STORAGE_REPORTER],
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
        for name in ("mem_fraction_static", "max_running_requests", "random_seed"):
            if getattr(c, name) is not None:
                args[name] = getattr(c, name)
        if c.enable_deterministic_inference:
            args["enable_deterministic_inference"] = True
        return args | c.server_args

    def _describe(self) -> str:
        shown = {k: v for k, v in asdict(self.config).items() if v not in (None, {}, False)}
        return f"{CONFIG_KEY}={shown} (model_path={self.model_path!r}, device={self.device}, tp_size={self.tp_size})"

    def _start(self) -> None:
        if self.device.type == "cpu":
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read when sglang is imported, here and in its children
        import psutil

        before = {p.pid for p in psutil.Process().children(recursive=True)}
        t0 = time.perf_counter()
        _STARTING.add(id(self))
        try:
            with compat.keep_start_method(), compat.without_torchrun_env(), self._thread_env(), \
                    _deadline(self.config.start_timeout_s, what="start"):
                from sglang.srt.entrypoints.engine import Engine

                self.engine = Engine(**self.server_args)
        except BaseException as e:
            compat.kill_processes(compat.new_children(before))
            if isinstance(e, KeyboardInterrupt):
                raise
            raise SGLangEngineError(f"the SGLang engine failed to start: {type(e).__name__}: {e}. "
                                    f"Engine config: {self._describe()}") from e
        finally:
            _STARTING.discard(id(self))
        self.procs = compat.new_children(before)
        _LIVE[id(self)] = self
        _install_signal_handlers()
        compat.take_back_signals(self.engine, {signal.SIGTERM: _on_terminate, signal.SIGQUIT: _on_sigquit})
        self.start_seconds = time.perf_counter() - t0

    @contextmanager
    def _thread_env(self) -> Iterator[None]:
        """The engine's processes read OMP_NUM_THREADS when they start. On a CPU shared with the trainer,
        OpenMP's default (all cores) makes the scheduler's threads spin against the other processes:
        50x slower generation was measured on 2 cores."""
        if self.device.type != "cpu":
            yield
            return
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(self.config.cpu_threads or 1)
        try:
            yield
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved

    def shutdown(self) -> None:
        """Stop the engine's processes (idempotent); other children of the trainer are left alone."""
        if self.engine is None:
            return
        engine, self.engine = self.engine, None
        _LIVE.pop(id(self), None)
        compat.shutdown_engine(engine, self.procs)
        self.procs = []

    # ---- generate ----
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[Generation]:
        expanded = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        if not expanded:
            return []
        self._check_alive()
        stop = sorted(set(self.stop_ids) | set(params.stop_token_ids))
        base = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                    max_new_tokens=params.max_new_tokens, stop_token_ids=stop)
        sampling = [base | ({"sampling_seed": _sample_seed(params.seed, i, j)} if params.seed is not None else {})
                    for i, j in expanded]
        input_ids = [list(prompts[i]) for i, _ in expanded]
        outs = self._call(self.engine.async_generate(input_ids=input_ids, sampling_params=sampling,
                                                     return_logprob=True), what="generate")
        outs = outs if isinstance(outs, list) else [outs]
        return [self._generation(i, out) for (i, _), out in zip(expanded, outs, strict=True)]

    def _generation(self, prompt_index: int, out: dict[str, Any]) -> Generation:
        meta = out["meta_info"]
        finish = meta["finish_reason"] or {}
        if finish.get("type") not in ("stop", "length"):
            raise SGLangEngineError(f"the SGLang engine did not finish a request: {finish}. "
                                    f"Engine config: {self._describe()}")
        token_ids = list(out["output_ids"])
        logprobs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
        if len(logprobs) != len(token_ids):
            raise SGLangEngineError(f"SGLang returned {len(token_ids)} tokens but {len(logprobs)} log-probs")
        spans = meta.get("weight_versions") or [{"version": meta["weight_version"]}]
        return Generation(prompt_index=prompt_index, token_ids=token_ids, logprobs=logprobs,
                          finish_reason=finish["type"], weight_version=min(int(s["version"]) for s in spans))

    # ---- weight swap ----
    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        """Copy the streamed HF-named tensors into the engine's parameters, in place; no restart, no disk."""
        self._check_alive()
        t0, sent, count = time.perf_counter(), 0, 0
        if "weights" in self._released:
            self._resume(["weights"])  # load into resident storage
        self._wait_until_idle()
        self._ok(self._call(compat.weight_update_session(self.engine, "begin"), what="begin_weight_update"))
        try:
            for bucket, last in _with_last(b for b in buckets if b):
                self._check_names(bucket)
                request = compat.update_weights_from_tensor(
                    self.engine, self._payloads(bucket), load_format=self._load_format(), flush_cache=last,
                    weight_version=str(version) if last else None)  # the flush and the version come last
                self._ok(self._call(request, what="update_weights_from_tensor"))
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                count += 1
            if count == 0:  # nothing streamed: still stamp the version
                self._call(compat.set_weight_version(self.engine, str(version)), what="update_weight_version")
        finally:
            if self.failure is None:  # a dead engine has no session to end
                self._ok(self._call(compat.weight_update_session(self.engine, "end"), what="end_weight_update"))
        self.version = version
        self.last_update = {"seconds": time.perf_counter() - t0, "megabytes": sent / 2**20, "buckets": count}

    def _check_names(self, bucket: WeightBucket) -> None:
        """SGLang skips unknown names silently and dies on a wrong shape: check both here, like the hf engine."""
        for name, tensor in bucket:
            shape = self.shapes.get(name)
            if shape is None:
                raise KeyError(f"sglang engine: weight {name!r} is not in the rollout model's checkpoint "
                               f"({self.model_path}); known names look like {next(iter(self.shapes))!r}")
            if tuple(tensor.shape) != shape:
                raise ValueError(f"sglang engine: weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the rollout model expects {shape}")

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

    def parameter_storage(self) -> dict[str, int]:
        """``{name: data_ptr}`` of the engine's parameters, read inside its (TP rank 0) scheduler process.

        Runs :func:`report_parameter_storage` as a custom SGLang weight loader that loads nothing; two
        reports around a swap show whether the swap reused the parameter storage.
        """
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "storage.json"
            self._ok(self._call(compat.weight_update_session(self.engine, "begin"), what="begin_weight_update"))
            try:
                request = compat.update_weights_from_tensor(
                    self.engine, self._payloads_for_probe(str(path)), load_format=_STORAGE_REPORTER,
                    flush_cache=False, weight_version=None)
                self._ok(self._call(request, what="update_weights_from_tensor (storage report)"))
            finally:
                if self.failure is None:
                    self._ok(self._call(compat.weight_update_session(self.engine, "end"), what="end_weight_update"))
            return {k: int(v) for k, v in json.loads(path.read_text()).items()}

    def _payloads_for_probe(self, path: str) -> list[bytes]:
        from sglang.srt.utils import MultiprocessingSerializer

        return [MultiprocessingSerializer.serialize([(path, torch.zeros(1))])] * self.tp_size

    # ---- memory phases ----
    def release_memory(self) -> None:
        c = self.config
        if not (c.enable_memory_saver if c.free_cache_engine is None else c.free_cache_engine):
            return  # without the memory saver there is nothing to free (SGLang would only flush its cache)
        tags = ["kv_cache", "weights"] if c.release_weights else ["kv_cache"]
        tags = [t for t in tags if t not in self._released]
        if tags:  # SGLang releases the KV cache first, then the weights
            self._check_alive()
            self._wait_until_idle()
            self._call(compat.memory_occupation(self.engine, "release", tags), what="release_memory_occupation")
            self._released.update(tags)

    def resume_memory(self) -> None:
        self._resume([t for t in ("weights", "kv_cache") if t in self._released])

    def _resume(self, tags: list[str]) -> None:
        if tags:  # SGLang resumes the weights first, then the KV cache
            self._check_alive()
            self._call(compat.memory_occupation(self.engine, "resume", tags), what="resume_memory_occupation")
            self._released.difference_update(tags)

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
                                    f"engine config: {self._describe()}") from e

    def _wait_until_idle(self) -> None:
        result = self._call(compat.wait_until_idle(self.engine, self.config.request_timeout_s), what="flush_cache")
        self._ok((result.success, result.message))

    def _ok(self, result: tuple[bool, str]) -> None:
        """SGLang refuses a request by returning ``(False, message)``, not by raising: raise it."""
        success, message = result
        if not success:
            raise SGLangEngineError(f"the SGLang engine refused the request: {message}. "
                                    f"Engine config: {self._describe()}")

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise SGLangEngineError(self.failure)
        if self.engine is None:
            raise SGLangEngineError("the SGLang engine was shut down")
        dead = [p for p in self.procs if not _alive(p)]
        if dead:
            raise SGLangEngineError(f"SGLang engine process(es) {[p.pid for p in dead]} died (see their log above); "
                                    f"engine config: {self._describe()}")


def report_parameter_storage(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """A custom SGLang weight loader that loads nothing: writes ``{name: data_ptr}`` to the path it is sent.

    Runs inside the scheduler process (see :meth:`SGLangRolloutEngine.parameter_storage`).
    """
    (path, _), *_ = named_tensors
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        Path(path).write_text(json.dumps({n: p.data_ptr() for n, p in model.named_parameters()}))


# ---- process-wide cleanup: the engines' processes never outlive the trainer ----
_LIVE: dict[int, SGLangRolloutEngine] = {}
_STARTING: set[int] = set()
_PREVIOUS: dict[int, Any] = {}
_SIGQUIT_GRACE_S = 10.0


def _install_signal_handlers() -> None:
    """SIGTERM/SIGINT: kill the engines' processes, then do what the trainer did before; atexit: the same."""
    if _PREVIOUS or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        _PREVIOUS[signum] = signal.getsignal(signum)
        signal.signal(signum, _on_terminate)
    atexit.register(_shutdown_all)


def _shutdown_all() -> None:
    for engine in list(_LIVE.values()):
        engine.shutdown()


def _on_terminate(signum: int, frame: Any) -> None:
    _shutdown_all()
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:  # die by the signal, as without an engine
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _on_sigquit(signum: int, frame: Any) -> None:
    """An SGLang child sends SIGQUIT to the trainer when it fails: fail loudly instead of SGLang's SIGKILL.

    The child sends it *before* it exits (with code 0, which SGLang's own watchdog then takes for a
    clean exit), so wait a little for an engine process to be gone before deciding. Inside an engine
    call the handler runs as a callback of the engine's event loop, which would swallow an exception:
    there it cancels the call, which then raises the error.
    """
    if _STARTING:
        raise SGLangEngineError("an SGLang engine process failed during start (see its log above)")
    engines = list(_LIVE.values())
    deadline = time.monotonic() + _SIGQUIT_GRACE_S
    dead: list[tuple[SGLangRolloutEngine, Any]] = []
    while engines and not dead and time.monotonic() < deadline:
        dead = [(e, p) for e in engines for p in e.procs if not _alive(p)]
        if not dead:
            time.sleep(0.1)
    if not dead:
        return  # no engine process died: a stray SIGQUIT (e.g. from a child being shut down) is ignored
    message = (f"SGLang engine process(es) {[p.pid for _, p in dead]} died (see their log above); "
               f"engine config: {dead[0][0]._describe()}")
    running = [e.engine.loop for e in engines if e.engine is not None and e.engine.loop.is_running()]
    for engine in engines:
        engine.failure = message
    _shutdown_all()
    if not running:
        raise SGLangEngineError(message)
    for loop in running:
        for task in asyncio.all_tasks(loop):
            task.cancel()


def _alive(proc: Any) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _deadline:  # noqa: N801 - used as a context manager
    """Raise ``TimeoutError`` in the main thread after ``seconds`` (SIGALRM; no limit off the main thread)."""

    def __init__(self, seconds: float | None, *, what: str) -> None:
        self.seconds, self.what = seconds, what
        self.armed = seconds is not None and threading.current_thread() is threading.main_thread()

    def __enter__(self) -> None:
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, float(self.seconds))  # type: ignore[arg-type]

    def _fire(self, signum: int, frame: Any) -> None:
        raise TimeoutError(f"SGLang {self.what} took longer than {self.seconds} s")

    def __exit__(self, *exc: object) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)


def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """``(item, is_last)`` with one item of look-ahead (the stream is consumed lazily)."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for following in it:
        yield current, False
        current = following
    yield current, True


def _sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    return (seed * 1_000_003 + prompt_index * 1_009 + sample_index) % (2**63 - 1)


def _checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of the HF checkpoint, from safetensors headers only (no weights are read)."""
    from safetensors import safe_open

    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for file in files:
            with safe_open(str(root / file), framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    except Exception as e:  # safetensors raises its own error types
        raise SGLangEngineError(f"the SGLang engine cannot read the weights at {model_path!r} "
                                f"(actor_rollout_ref.model.path): {e}. Engine config key: {CONFIG_KEY}") from e
    if "model.embed_tokens.weight" in shapes:  # tied embeddings: the stream may also name the output layer
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
    return shapes


def _eos_token_ids(model_path: str) -> list[int]:
    """The stop ids the ``hf`` engine uses: generation_config's EOS list, else config.json's."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        try:
            eos = AutoConfig.from_pretrained(model_path).eos_token_id
        except (OSError, ValueError) as e:
            raise SGLangEngineError(f"the SGLang engine cannot read the model at {model_path!r} "
                                    f"(actor_rollout_ref.model.path): {e}. Engine config key: {CONFIG_KEY}") from e
    return [eos] if isinstance(eos, int) else list(eos or [])
