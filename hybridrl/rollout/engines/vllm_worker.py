"""The ``vllm`` engine's extension of vLLM's worker (``worker_extension_cls``): an in-place weight swap over several
calls, one bucket per call.

It runs inside vLLM's worker (the engine process): the trainer calls these methods through ``LLM.collective_rpc``.
A swap is one *session*: :meth:`hybridrl_begin_weights`, :meth:`hybridrl_load_weights` per bucket,
:meth:`hybridrl_finish_weights`. Why not ``model.load_weights`` per bucket, or vLLM's ``reload_weights``:

- vLLM's CPU backend repacks linear weights at load time, so after start a plain ``model.load_weights`` fails
  (``'Parameter' object has no attribute 'weight_loader'``). vLLM's layerwise reload puts the checkpoint-format
  parameters back, collects each layer's tensors and repacks a layer once all its tensors came, copying the result
  into the kernel's existing storage (in place). :func:`vllm.model_executor.model_loader.reload.reload_weights`
  runs that over *one* iterator; a fused layer (q/k/v, gate/up) whose tensors are split over two buckets would be
  processed half-loaded if each bucket were its own reload. The session spans the buckets instead.
- ``collective_rpc`` arguments travel as msgpack in multiprocess mode, where a tensor arrives as nested lists: a
  bucket is sent as safetensors bytes (``hybridrl_load_weights(payload)``).

Everything vLLM-version-specific about this sits in :mod:`hybridrl.rollout.engines.vllm_compat`.
"""

from __future__ import annotations

from typing import Any


class WeightReceiver:
    """Mixed into vLLM's worker class: ``self`` is the worker (``self.model_runner``, ``self.vllm_config``)."""

    def hybridrl_begin_weights(self) -> None:
        from hybridrl.rollout.engines import vllm_compat as compat

        compat.begin_layerwise_reload(self)
        self._hybridrl_loaded: set[str] = set()

    def hybridrl_load_weights(self, payload: bytes) -> int:
        """Load one bucket (safetensors bytes of HF-named tensors); returns how many tensors it held."""
        from safetensors.torch import load

        from hybridrl.rollout.engines import vllm_compat as compat

        tensors = load(payload)
        compat.load_into_session(self, tensors.items())
        self._hybridrl_loaded.update(tensors)
        return len(tensors)

    def hybridrl_finish_weights(self) -> int:
        """End the session (the layers' kernel repacking); returns how many tensors the session loaded."""
        from hybridrl.rollout.engines import vllm_compat as compat

        compat.finish_layerwise_reload(self)
        return len(getattr(self, "_hybridrl_loaded", ()))

    def hybridrl_storage(self) -> dict[str, int]:
        """``{parameter name: data_ptr}`` of the served model: what an in-place swap must keep."""
        model: Any = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {name: int(p.data_ptr()) for name, p in model.named_parameters()}
