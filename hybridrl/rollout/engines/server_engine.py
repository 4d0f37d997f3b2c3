"""What the SGLang and vLLM engines share: an inference server started beside the trainer, fed token ids.

Both read the checkpoint's stop ids and tensor shapes at start (an update may send only those names and shapes),
check their config the same way, expand a call into one request per sample with the same seeds and stop ids, stream
a weight update in one session bucket by bucket, abort and resume the same way, and give back/restore memory by tags
(``weights`` before ``kv_cache`` on resume). What differs — the transport, the session calls, the memory calls —
is a hook each engine implements (:class:`ServerEngine`'s ``_begin_update`` … ``_restore``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, fields
from typing import Any, ClassVar

import torch

from hybridrl.hf.arch import eos_token_ids
from hybridrl.hf.tensors import checkpoint_shapes
from hybridrl.interfaces import SamplingParams, WeightBucket, check_limits
from hybridrl.rollout.engines.weight_names import check_bucket
from hybridrl.seeds import request_seed

CONFIG_KEY = "actor_rollout_ref.rollout.engine_kwargs"
DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_engine_config(config: Any, *, at_least_one: Sequence[str], passthrough: str,
                        owned: Collection[str]) -> None:
    """The checks every server engine's ``Config`` makes: a known dtype, counts ≥ 1, and a verbatim pass-through
    dict (``server_args`` / ``engine_args``) that sets neither a typed key nor one the trainer sets itself."""
    if config.dtype is not None and config.dtype not in DTYPES:
        raise ValueError(f"dtype={config.dtype!r}; valid: {', '.join(DTYPES)} or null")
    for name in at_least_one:
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be ≥ 1 or null")
    given = set(getattr(config, passthrough))
    typed = {f.name for f in fields(config)} - {passthrough}
    clash = sorted((given & typed) | (given & set(owned)))
    if clash:
        raise ValueError(f"{passthrough} may not set {clash}: use the engine's own keys or let the trainer set them")


class ServerEngine:
    """The common part of a server engine; a subclass names itself and its error, and implements the hooks."""

    label: ClassVar[str]  # "SGLang", "vLLM": in messages
    error: ClassVar[type[RuntimeError]]
    supports_tensor_parallel: ClassVar[bool] = True
    supports_abort: ClassVar[bool] = True
    # _send_bucket is told which bucket is the last (one bucket of look-ahead: two are alive at a time)
    marks_last_bucket: ClassVar[bool] = False

    def __init__(self, config: Any, *, model_path: str, device: str | torch.device, tp_size: int,
                 gpu_memory_utilization: float) -> None:
        self.config = config
        self.device = torch.device(device)
        self.model_path = str(model_path)
        self.tp_size = tp_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.version = 0
        self._abort = threading.Event()  # abort() until resume(): requests come back cut short
        self.procs: list[Any] = []  # psutil.Process of the engine's own processes
        self._released: set[str] = set()
        self.last_update: dict[str, float] = {}  # seconds, megabytes, buckets of the last weight swap
        self.stop_ids, self.shapes = self._read_checkpoint()

    def describe(self) -> str:
        shown = {k: v for k, v in asdict(self.config).items() if v not in (None, {}, False)}
        return f"{CONFIG_KEY}={shown} (model_path={self.model_path!r}, device={self.device}, tp_size={self.tp_size})"

    def _read_checkpoint(self) -> tuple[list[int], dict[str, tuple[int, ...]]]:
        """The rollout model's stop ids and its tensor shapes (HF name -> shape: what an update may send)."""
        return self._read("model", eos_token_ids), self._read("weights", checkpoint_shapes)

    def _read(self, what: str, read: Any) -> Any:
        try:
            return read(self.model_path)
        except (OSError, ValueError) as e:
            raise self.error(f"the {self.label} engine cannot read the {what} at {self.model_path!r} "
                             f"(actor_rollout_ref.model.path): {e}. Engine config key: {CONFIG_KEY}") from e

    # ---- generate ----
    def _requests(self, prompts: Sequence[list[int]], params: SamplingParams, seeds: Sequence[int] | None,
                  max_new_tokens: Sequence[int] | None) -> tuple[list[tuple[int, int]], list[int], list[int]]:
        """``(prompt, sample)`` pairs of a call, each prompt's token limit, and the stop ids."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{self.label} engine: {len(seeds)} seeds for {len(prompts)} prompts; pass one seed "
                             "per prompt (or none)")
        limits = check_limits(max_new_tokens, prompts, params)
        expanded = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        return expanded, limits, sorted(set(self.stop_ids) | set(params.stop_token_ids))

    @staticmethod
    def seed(seeds: Sequence[int] | None, i: int, j: int) -> int | None:
        """Sample ``j`` of prompt ``i``'s seed: a hash of ``(seeds[i], j)`` alone, wherever the prompt sits."""
        return None if seeds is None else request_seed(seeds[i], j)

    def abort(self) -> None:
        """From another thread: the running ``generate`` returns soon, each unfinished sample with its tokens so far
        (``finish_reason="abort"``), and so does any until :meth:`resume`."""
        self._abort.set()
        self._abort_running()

    def resume(self) -> None:
        self._abort.clear()

    def _abort_running(self) -> None:
        """Stop what the engine runs now (the engine's own loop may notice ``_abort`` by itself)."""

    # ---- weight swap ----
    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        """Copy the streamed HF-named tensors into the engine's parameters, in place; no restart, no disk."""
        self._check_alive()
        t0, sent, count = time.perf_counter(), 0, 0
        if "weights" in self._released:
            self._restore(["weights"])  # load into resident storage
        self._begin_update()
        try:
            stream = (b for b in buckets if b)
            for bucket, last in with_last(stream) if self.marks_last_bucket else ((b, False) for b in stream):
                check_bucket(bucket, self.shapes, engine=self.label.lower(), model_path=self.model_path)
                sent += self._send_bucket(bucket, last=last, version=version)
                count += 1
            self._sent_all(count, version)
        finally:
            self._end_update()
        self._after_update(version)
        self.version = version
        self.last_update = {"seconds": time.perf_counter() - t0, "megabytes": sent / 2**20, "buckets": count}

    def _begin_update(self) -> None:
        raise NotImplementedError

    def _send_bucket(self, bucket: WeightBucket, *, last: bool, version: int) -> int:
        """Send one bucket; the bytes sent."""
        raise NotImplementedError

    def _sent_all(self, count: int, version: int) -> None:
        """Every bucket was sent (``count`` of them), the session still open."""

    def _end_update(self) -> None:
        """Close the session (also after a failed bucket)."""
        raise NotImplementedError

    def _after_update(self, version: int) -> None:
        """The session closed after a complete update."""

    # ---- memory phases ----
    def resume_memory(self) -> None:
        self._restore([t for t in ("weights", "kv_cache") if t in self._released])

    def _restore(self, tags: list[str]) -> None:
        if tags:  # weights first, then the KV cache
            self._check_alive()
            self._restore_tags(tags)
            self._released.difference_update(tags)

    def _restore_tags(self, tags: list[str]) -> None:
        raise NotImplementedError

    def _check_alive(self) -> None:
        raise NotImplementedError


def with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
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
