"""``hybridrl.megatron.lean_import``: megatron.core imported without dynamo/inductor/wandb/tensorboard.

Each check runs in a fresh interpreter (what is imported is per process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridrl.megatron.lean_import import _deferred_compile

PROBE = """
import json, sys{first}
import megatron.core
from megatron.core.fusions import fused_bias_swiglu
import torch
out = {{m: m in sys.modules for m in ("torch._dynamo", "torch._inductor", "wandb", "tensorboard")}}
out["deferred"] = bool(getattr(fused_bias_swiglu.swiglu, "hybridrl_deferred_compile", False))
out["compile_restored"] = torch.compile.__module__ == "torch"
import wandb  # importable as usual afterwards
out["wandb_after"] = wandb.__name__ == "wandb"
print(json.dumps(out))
"""


def _probe(first: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_plain_megatron_import_still_pulls_them_in() -> None:
    """Upstream: ``import megatron.core`` imports dynamo and inductor (its jit_fuser is torch.compile) and
    wandb/tensorboard (its inference context). Fails once it no longer does: then lean_import can go."""
    got = _probe("")
    assert got["torch._dynamo"] and got["torch._inductor"] and got["wandb"], got
    assert not got["deferred"]


def test_hybridrl_first_keeps_them_out() -> None:
    got = _probe("\nimport hybridrl")
    assert not any(got[m] for m in ("torch._dynamo", "torch._inductor", "wandb", "tensorboard")), got
    assert got["deferred"] and got["compile_restored"] and got["wandb_after"], got


def test_deferred_compile_makes_the_same_call_at_first_use() -> None:
    calls: list[tuple] = []

    def real_compile(fn, **kwargs):  # stands in for torch.compile: records, then returns a "compiled" fn
        calls.append((fn, kwargs))
        return lambda *a: ("compiled", fn(*a))

    def double(x: int) -> int:
        return 2 * x

    plain = _deferred_compile(real_compile, double)
    configured = _deferred_compile(real_compile, mode="max-autotune")(double)  # @torch.compile(mode=...)
    assert calls == [] and plain.__wrapped__ is double  # nothing compiled at decoration
    assert plain(3) == ("compiled", 6) and plain(4) == ("compiled", 8)
    assert configured(1) == ("compiled", 2)
    assert calls == [(double, {}), (double, {"mode": "max-autotune"})]  # once each, with the same arguments
