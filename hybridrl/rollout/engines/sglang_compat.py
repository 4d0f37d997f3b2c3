"""Every adaptation hybridrl makes to SGLang 0.5.21's behaviour, in one place.

Each item names the upstream code it works around; ``tests/rollout/test_sglang_compat.py`` shows that
each is still needed (it fails once upstream changes the behaviour, so the item can be dropped).

1. **Weight version with a tensor update.** ``Engine.update_weights_from_tensor`` has no
   ``weight_version`` parameter, although the request it builds (``UpdateWeightsFromTensorReqInput``)
   has one and the scheduler then stamps every later sample with it. :func:`update_weights_from_tensor`
   builds that request itself and sends it the way ``Engine.update_weights_from_tensor`` does.
2. **Signal handlers taken from the trainer.** ``TokenizerManager.auto_create_handle_loop`` (first
   request) installs SIGTERM/SIGQUIT handlers on the trainer's event loop (``loop.add_signal_handler``):
   SIGTERM then only sets ``gracefully_exit``, which a task acts on while the loop runs — i.e. during
   the next engine call, never during training, so ``kill <trainer>`` does nothing for minutes; SIGQUIT
   (sent by a crashing engine child) runs ``kill_process_tree(os.getpid())``, SIGKILLing the trainer
   without an error. ``_set_envs_and_config`` (engine start) installs the same SIGQUIT behaviour
   (``launch_phase_sigquit_handler``). :func:`take_back_signals` forces that installation right after
   start, removes it, and hands the signals to hybridrl's handlers (``custom_sigquit_handler`` covers
   the launch phase).
3. **Global multiprocessing start method.** ``_set_envs_and_config`` calls
   ``mp.set_start_method("spawn", force=True)`` in the caller (the trainer), changing how its own
   DataLoader workers start. :func:`keep_start_method` restores the trainer's method after start.
4. **Shutdown kills every child of the trainer.** ``Engine.shutdown`` (also registered with ``atexit``)
   ends with ``kill_process_tree(os.getpid(), include_parent=False)``: it kills the trainer's other
   children too (wandb's service, DataLoader workers, a second engine). :func:`shutdown_engine` does the
   rest of ``Engine.shutdown`` and kills only the engine's own processes; the atexit hook is removed.
5. **No timeouts.** ``Engine``'s blocking methods (``generate``, ``begin_weight_update``,
   ``release_memory_occupation``, ...) are ``loop.run_until_complete(tokenizer_manager.<method>(request))``
   with no time limit; a hung scheduler hangs the trainer. The functions below return those coroutines
   and :func:`run` bounds them with ``asyncio.wait_for`` (aborting the engine's requests on timeout).
6. **Calls return before the scheduler is idle.** ``Engine.generate`` returns once the outputs are
   out, while the (overlap) scheduler may still be finishing its last batch; ``release_memory_occupation``
   then fails ``assert self.is_fully_idle()`` *inside the scheduler*, which kills it.
   :func:`wait_until_idle` sends a deferred ``flush_cache(timeout_s=...)`` first, which SGLang answers
   once the scheduler is idle.
7. **torchrun's environment.** The engine's processes inherit the trainer's environment; under
   torchrun that includes ``TORCHELASTIC_USE_AGENT_STORE=True``, which makes the scheduler's
   ``init_process_group(init_method="tcp://...")`` (``init_distributed_environment``) connect as a client
   to a store nobody serves at SGLang's own port: the engine start hangs. ``MASTER_ADDR/PORT``,
   ``RANK``, ``LOCAL_RANK`` ... describe the trainer's world, not the engine's, and SGLang reads some of
   them (``os.environ.setdefault("MASTER_PORT", ...)``, ``LOCAL_RANK``). :func:`without_torchrun_env`
   hides them while the engine starts its processes.
8. **CPU install gaps** (only with ``launch/install_sglang_cpu.sh``): PyPI's torchvision is a CUDA build
   whose ``_meta_registrations`` dies next to a CPU torch (``launch/sglang_cpu/patch_torchvision.py``);
   no CPU build of ``sgl_kernel`` exists, yet SGLang imports names from it at module level
   (``launch/sglang_cpu/sgl_kernel``: a stand-in whose kernels raise if called).

9. **IPC sockets left open with an infinite linger.** ``get_zmq_socket`` never sets ``LINGER`` (libzmq's
   default, -1: wait forever for undelivered messages), and ``Engine.shutdown`` closes only ``send_to_rpc``:
   the trainer-side ``TokenizerManager`` keeps its sockets (``send_to_scheduler``, ``recv_from_detokenizer``)
   and both ``zmq.Context`` objects (each with its I/O threads) alive after the engine's processes are gone. They
   are destroyed whenever a later garbage collection reaches them (``Context.__del__`` → ``term()``), in
   whatever the trainer is doing then, and ``term()`` waits on every socket's linger. :func:`shutdown_engine`
   destroys them itself, with linger 0, once the processes are dead. A start that fails inside ``Engine()``
   leaves no engine object to reach them through: :func:`contexts_made` records the contexts made during the
   start, and the failed start destroys them (left to a later collection, one hung a test run in
   ``Context.__del__`` twenty minutes after the failed start, inside an unrelated tokenizer call).

10. **MoE models compute wrong on CPU.** On a CPU without AMX, SGLang 0.5.21's unquantized MoE layer takes
    ``moe_forward_native`` (``UnquantizedFusedMoEMethod.forward_cpu``). On tiny Qwen3-MoE and Qwen2-MoE checkpoints
    its sampled tokens' log-probs were 0.4–0.8 off transformers' (top-1 and top-2, ``norm_topk_prob`` either way;
    dense Qwen3 of the same size: 5e-7), before any weight swap. The cause is not found; a rollout engine whose
    log-probs are that far off would train on a wrong behaviour policy, so :func:`cpu_moe_problem` refuses an MoE
    model with the ``sglang`` engine on CPU (validation and engine start); the ``hf`` and ``vllm`` engines serve them
    (vLLM with its own item 11). GPUs take SGLang's fused kernels and are not refused (untested here).
11. **Input log-probs ignore the temperature.** A request's ``input_token_logprobs`` / ``input_top_logprobs``
    (``logprob_start_len``) are log_softmax(logits) whatever its sampling ``temperature``: at T = 0.7 they equal the
    untempered ones exactly. A teacher served by SGLang (``score``) therefore scores at T = 1 only; validation refuses
    it beside a rollout temperature other than 1, as vLLM's (its item 12).
12. **No Qwen-VL processor on the CPU stand-in** (with item 8's ``sgl_kernel`` stand-in). SGLang's tokenizer manager
    registers its multimodal processors by importing every ``sglang.srt.multimodal.processors`` module and skipping
    any that fails (``import_processors``, a logged warning). ``qwen_vl.py`` imports ``models/qwen3_5.py``, which on
    CPU takes ``torch.ops.sgl_kernel.fused_sigmoid_mul_cpu`` (and three more CPU ops) at module level: ops only a CPU
    build of ``sgl_kernel`` registers. So the Qwen-VL processor is skipped and a Qwen2.5-VL engine fails to start
    with "No processor registered for architecture: ['Qwen2_5_VLForConditionalGeneration']".
    :func:`define_missing_cpu_ops` defines those four ops in the trainer (where the tokenizer manager runs) as
    schemas without a kernel: importing works, calling one raises. Qwen2.5-VL and Qwen3-VL call none of them.
13. **Vision embeddings outlive a weight swap.** The scheduler keeps each image's vision-tower output in a static
    cache keyed by the image's hash (``mm_schedule.embedding_cache``, ``SGLANG_VLM_CACHE_SIZE_MB``, default 100);
    ``Scheduler.flush_cache`` (the flush that comes with a weight update) resets the KV and prefix caches but not
    this one, so after a swap an image seen before would enter with the old tower's features.
    :func:`no_vision_cache` starts the engine with a cache of 0 MB (it then stores nothing): every request runs the
    vision tower on its images (the ``n`` samples of one prompt each run it).

Nothing here imports sglang at module import time.
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing as mp
import signal
from collections.abc import Callable, Coroutine, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

# item 7's helper and the process helpers are shared with the vllm engine
from hybridrl.rollout.engines.processes import (  # noqa: F401
    TORCHRUN_ENV,
    environ,
    kill_processes,
    new_children,
    without_torchrun_env,
)

if TYPE_CHECKING:
    import psutil

SignalHandler = Callable[[int, Any], Any]


def update_weights_from_tensor(engine: Any, payloads: list[bytes], *, load_format: str | None, flush_cache: bool,
                               weight_version: str | None) -> Coroutine[Any, Any, tuple[bool, str]]:
    """``Engine.update_weights_from_tensor`` plus the request's ``weight_version`` (item 1), as a coroutine.

    ``payloads``: one ``MultiprocessingSerializer`` payload per engine TP rank.
    """
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    request = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=load_format,
                                              flush_cache=flush_cache, weight_version=weight_version)
    return engine.tokenizer_manager.update_weights_from_tensor(request)


def set_weight_version(engine: Any, version: str) -> Coroutine[Any, Any, None]:
    """Stamp a weight version without loading anything (no ``Engine`` method exists; item 1)."""
    from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

    return engine.tokenizer_manager.update_weight_version(
        UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False))


def weight_update_session(engine: Any, which: str) -> Coroutine[Any, Any, tuple[bool, str]]:
    """``Engine.begin_weight_update``/``end_weight_update`` as coroutines, so a timeout can bound them (item 6)."""
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

    if which == "begin":
        return engine.tokenizer_manager.begin_weight_update(BeginWeightUpdateReqInput())
    return engine.tokenizer_manager.end_weight_update(EndWeightUpdateReqInput())


def memory_occupation(engine: Any, which: str, tags: list[str]) -> Coroutine[Any, Any, None]:
    """``Engine.release_memory_occupation``/``resume_memory_occupation`` as coroutines (item 6)."""
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput

    if which == "release":
        return engine.tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags))
    return engine.tokenizer_manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags))


def wait_until_idle(engine: Any, timeout_s: float | None) -> Coroutine[Any, Any, Any]:
    """A deferred ``flush_cache``: answers once the scheduler is idle (item 7)."""
    return engine.tokenizer_manager.flush_cache(timeout_s=timeout_s or 3600.0)


def abort_all(engine: Any) -> None:
    """Abort every request of the engine from any thread: ``TokenizerManager.abort_request`` sends on the
    tokenizer's zmq socket, which only the engine loop's thread may use, so it is scheduled on that loop (it runs
    while a call of the generating thread drives the loop, or at the next one)."""
    engine.loop.call_soon_threadsafe(lambda: engine.tokenizer_manager.abort_request(abort_all=True))


def run(engine: Any, coroutine: Coroutine[Any, Any, Any], timeout_s: float | None) -> Any:
    """Run an engine coroutine on the engine's loop within ``timeout_s``, as ``Engine``'s methods do without one."""
    try:
        return engine.loop.run_until_complete(asyncio.wait_for(coroutine, timeout_s))
    except TimeoutError:
        engine.tokenizer_manager.abort_request(abort_all=True)
        raise


def take_back_signals(engine: Any, handlers: dict[int, SignalHandler]) -> None:
    """Let SGLang install its loop signal handlers now, then replace them with ``handlers`` (item 2)."""

    async def create_then_remove() -> list[bool]:
        # both must run inside the engine's loop: SGLang installs them on a first request, and uvloop's
        # remove_signal_handler is a no-op (returns False) while the loop is not running
        engine.tokenizer_manager.auto_create_handle_loop()
        return [engine.loop.remove_signal_handler(s) for s in (signal.SIGTERM, signal.SIGQUIT)]

    removed = engine.loop.run_until_complete(create_then_remove())
    if not all(removed):
        raise RuntimeError(f"SGLang's loop signal handlers (SIGTERM, SIGQUIT) were not all removed: {removed}")
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


@contextmanager
def keep_start_method() -> Iterator[None]:
    """Undo SGLang's process-wide ``mp.set_start_method("spawn", force=True)`` after engine start (item 3)."""
    before = mp.get_start_method(allow_none=True)
    try:
        yield
    finally:
        if mp.get_start_method(allow_none=True) != before:
            mp.set_start_method(before, force=True)  # type: ignore[arg-type]


def shutdown_engine(engine: Any, procs: list[psutil.Process]) -> None:
    """``Engine.shutdown`` without killing the caller's unrelated children (item 4)."""
    atexit.unregister(engine.shutdown)
    tm = engine.tokenizer_manager
    contexts = ipc_contexts(engine)
    try:
        if tm is not None and getattr(tm, "_subprocess_watchdog", None) is not None:
            tm._subprocess_watchdog.stop()  # before the kill: a dying child is not a crash now
        if getattr(engine, "send_to_rpc", None) is not None:
            engine.send_to_rpc.close(linger=0)
            engine.send_to_rpc = None
        daemons = getattr(engine, "_weight_cache_daemon_procs", None)
        if daemons:
            engine._terminate_weight_cache_daemons(daemons)
            engine._weight_cache_daemon_procs = []
    finally:
        kill_processes(procs)
        if tm is not None:
            mm = getattr(tm, "mm_processor", None)
            if mm is not None:
                mm.shutdown()
            transport = getattr(tm, "cuda_vmm_feature_transport", None)
            if transport is not None:
                transport.shutdown()
        for context in contexts:  # item 9: the peers are dead, nothing left to deliver
            context.destroy(linger=0)


@contextmanager
def contexts_made() -> Iterator[list[Any]]:
    """The ``zmq.Context`` objects (sync and asyncio) made inside the block, in a list filled when it ends (item 9)."""
    import weakref

    from zmq.sugar.context import Context

    made: list[weakref.ref[Any]] = []
    found: list[Any] = []
    original = Context.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(weakref.ref(self))

    Context.__init__ = recording_init  # type: ignore[method-assign]
    try:
        yield found
    finally:
        Context.__init__ = original  # type: ignore[method-assign]
        found += [c for c in (r() for r in made) if c is not None]


def destroy_contexts(contexts: list[Any]) -> None:
    """Close every socket of ``contexts`` with linger 0 and terminate them (their peers are dead; item 9)."""
    for context in contexts:
        if not context.closed:
            context.destroy(linger=0)


def ipc_contexts(engine: Any) -> list[Any]:
    """The ``zmq.Context`` objects of the engine's trainer-side sockets (item 9), each once."""
    tm = engine.tokenizer_manager
    sockets = [getattr(engine, "send_to_rpc", None)]
    if tm is not None:
        sockets += [getattr(tm, "send_to_scheduler", None), getattr(tm, "recv_from_detokenizer", None)]
    contexts = {id(s.context): s.context for s in sockets if s is not None and s.context is not None}
    return list(contexts.values())


def cpu_moe_problem(model_path: str) -> str | None:
    """Why the CPU engine can't serve the checkpoint at ``model_path`` (item 10: an MoE model), or None."""
    from hybridrl.hf.arch import HFArch

    moe = HFArch.from_hf(model_path).moe
    if moe is None:
        return None
    return (f"an MoE model ({moe.num_experts} experts): SGLang 0.5.21's CPU MoE path gives log-probs 0.4–0.8 off "
            "the model's (hybridrl.rollout.engines.sglang_compat item 10); use actor_rollout_ref.rollout.name=hf or "
            "vllm on CPU")


ROUTED_EXPERTS_CPU = ("return_routed_experts (R3 router replay) needs a GPU with sglang: R3 replays an MoE model, and "
                      "SGLang 0.5.21's CPU MoE path gives log-probs 0.4–0.8 off the model's (hybridrl.rollout.engines."
                      "sglang_compat item 10); use actor_rollout_ref.rollout.name=hf on CPU")


# ---- items 12 and 13: a vision-language checkpoint ----
CPU_OPS_IMPORTED = ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
                    "fused_qkvzba_split_reshape_cat_contiguous_cpu")  # taken at import by models/qwen3_5.py (item 12)
_cpu_op_library: Any = None  # torch.library.Library holding item 12's definitions (kept alive: they die with it)


def define_missing_cpu_ops() -> list[str]:
    """Define the ``torch.ops.sgl_kernel`` CPU ops SGLang's Qwen-VL processor import needs and no kernel provides
    (item 12), as schemas without a kernel; returns the ops defined now."""
    global _cpu_op_library
    import torch

    missing = [op for op in CPU_OPS_IMPORTED if not hasattr(torch.ops.sgl_kernel, op)]
    if missing:
        _cpu_op_library = _cpu_op_library or torch.library.Library("sgl_kernel", "FRAGMENT")
        for op in missing:
            _cpu_op_library.define(f"{op}(Tensor x) -> ()")
    return missing


def no_vision_cache() -> AbstractContextManager[None]:
    """Inside: engine processes started here keep no vision embeddings between requests (item 13)."""
    return environ({"SGLANG_VLM_CACHE_SIZE_MB": "0"})
