"""Test-only probe into an ``sglang`` rollout engine's scheduler: where its parameters live (``data_ptr``).

:func:`report_parameter_storage` is a custom SGLang weight loader that loads nothing. An engine built
with ``engine_kwargs.server_args=SERVER_ARGS`` registers it; :func:`parameter_storage` then runs it
inside the (TP rank 0) scheduler process. Two reports around a swap show whether the swap reused the
parameter storage.

SGLang's scheduler imports the loader by its dotted name (``dynamic_import`` in its weight updater).
The scheduler is a ``spawn`` child of the process that starts the engine, and ``spawn`` hands the
child the parent's ``sys.path`` — which pytest has extended with this directory — so the name this
module was imported under (``__name__``) imports there too.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridrl.rollout.engines import sglang_compat as compat

if TYPE_CHECKING:
    from hybridrl.rollout.engines.sglang import SGLangRolloutEngine

STORAGE_REPORTER = f"{__name__}.report_parameter_storage"
SERVER_ARGS: dict[str, Any] = {"custom_weight_loader": [STORAGE_REPORTER]}  # engine_kwargs.server_args


def parameter_storage(engine: SGLangRolloutEngine) -> dict[str, int]:
    """``{name: data_ptr}`` of the engine's parameters, read inside its (TP rank 0) scheduler process."""
    from sglang.srt.utils import MultiprocessingSerializer

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "storage.json"
        payloads = [MultiprocessingSerializer.serialize([(str(path), torch.zeros(1))])] * engine.tp_size
        engine._ok(engine._call(compat.weight_update_session(engine.engine, "begin"), what="begin_weight_update"))
        try:
            request = compat.update_weights_from_tensor(engine.engine, payloads, load_format=STORAGE_REPORTER,
                                                        flush_cache=False, weight_version=None)
            engine._ok(engine._call(request, what="update_weights_from_tensor (storage report)"))
        finally:
            if engine.failure is None:
                engine._ok(engine._call(compat.weight_update_session(engine.engine, "end"), what="end_weight_update"))
        return {k: int(v) for k, v in json.loads(path.read_text()).items()}


def report_parameter_storage(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """The custom weight loader: writes ``{name: data_ptr}`` to the path it is sent (runs in the scheduler)."""
    (path, _), *_ = named_tensors
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        Path(path).write_text(json.dumps({n: p.data_ptr() for n, p in model.named_parameters()}))
