"""hybridrl/megatron/fallbacks.py: megatron-core still warns at import where TE/Apex are missing (so the
filter is still needed), and with hybridrl's Megatron modules imported first those warnings become one line.
Each case runs in a fresh interpreter, since the warnings fire once, at megatron-core's first import."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

NEITHER = importlib.util.find_spec("transformer_engine") is None and importlib.util.find_spec("apex") is None
CPU_LINE = ("megatron: Transformer Engine not installed → local layer spec, torch norms; "
            "apex not installed → torch AdamW/SGD")
# the upstream files that warn without TE and Apex (fallbacks.py's docstring)
WARNING_FILES = {"optimizer/__init__.py", "optimizer/optimizer.py", "optimizer/clip_grads.py",
                 "distributed/fsdp/src/megatron_fsdp/mixed_precision.py", "models/backends.py",
                 "models/gpt/gpt_layer_specs.py"}


def _stderr_of(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RANK")}
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=300, check=True)
    return proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not NEITHER, reason="with TE or Apex installed megatron-core warns less (or not at all)")
def test_megatron_core_still_warns_without_te_and_apex() -> None:
    stderr = _stderr_of("import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs")
    warned = re.findall(r"megatron/core/(\S+\.py):\d+: UserWarning: .*not installed", stderr)
    assert set(warned) == WARNING_FILES, stderr


@pytest.mark.slow
def test_hybridrl_turns_them_into_one_line_at_start() -> None:
    imports = "import hybridrl.metrics, megatron.core.optimizer, hybridrl.megatron.model"  # megatron.core first
    assert _stderr_of(imports) == ""  # `import hybridrl` silenced them, whoever imports megatron.core first
    start = "from hybridrl.megatron.parallel import ParallelConfig, init_parallel; init_parallel(ParallelConfig())"
    lines = _stderr_of(f"{imports}; {start}").splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron: "), lines
    if NEITHER:
        assert lines[0] == CPU_LINE
    assert _stderr_of("from hybridrl.megatron.fallbacks import say_fallbacks; say_fallbacks()", RANK="1") == ""
