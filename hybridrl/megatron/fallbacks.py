"""megatron-core's "Transformer Engine / Apex not installed" import warnings, as one line.

megatron-core 0.16.1 warns (``UserWarning``) at import time in every module that falls back from
Transformer Engine or Apex, so each rank prints six of them before doing anything:

- ``optimizer/__init__.py``: "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
- ``optimizer/optimizer.py``, ``optimizer/clip_grads.py`` and
  ``distributed/fsdp/src/megatron_fsdp/mixed_precision.py``: "Transformer Engine and Apex are not
  installed. Falling back to local implementations of multi_tensor_applier ..."
- ``models/backends.py`` and ``models/gpt/gpt_layer_specs.py``: "Apex is not installed. Falling back
  to Torch Norm" (also on a GPU with TE: both check Apex alone).

``import hybridrl`` calls :func:`ignore_fallback_warnings` (before anything can import ``megatron.core``),
which ignores exactly those warnings; ``init_parallel`` prints instead, once per job (rank 0, stderr),
what is in use, read from upstream's own flags (:func:`fallback_line`); on CPU::

    megatron: Transformer Engine not installed → local layer spec, torch norms; apex not installed → torch AdamW/SGD

``tests/megatron/test_fallbacks.py`` fails once upstream no longer warns: then delete this module.
Not CPU-specific (a GPU machine without Apex warns too), hence not in ``cpu.py``.
"""

from __future__ import annotations

import os
import sys
import warnings

# the messages above; scoped to megatron.core's own modules
_MESSAGE = r"(Transformer Engine and Apex are|Apex is) not installed\. Falling back"
_MODULE = r"megatron\.core\."


def fallback_line() -> str:
    """What megatron-core uses where Transformer Engine / Apex are missing."""
    from megatron.core import optimizer
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs

    if gpt_layer_specs.HAVE_TE:  # hybridrl builds TE's layer spec when TE imports (model.layer_spec)
        layers = "Transformer Engine → TE layer spec"
    else:
        norms = "apex" if backends.HAVE_APEX else "torch"
        layers = f"Transformer Engine not installed → local layer spec, {norms} norms"
    if optimizer.USING_PYTORCH_OPTIMIZER:  # neither TE's nor apex's fused optimizers
        optim = "apex not installed → torch AdamW/SGD"
    else:
        optim = f"fused Adam/SGD from {optimizer.Adam.__module__.split('.')[0]}"
    return f"megatron: {layers}; {optim}"


def ignore_fallback_warnings() -> None:
    """Ignore megatron-core's TE/Apex-missing import warnings (only those, only from megatron.core)."""
    warnings.filterwarnings("ignore", message=_MESSAGE, category=UserWarning, module=_MODULE)


def say_fallbacks() -> None:
    """The one line instead of the warnings, from rank 0."""
    if os.environ.get("RANK", "0") == "0":
        print(fallback_line(), file=sys.stderr, flush=True)
