"""Without a usable toolchain the fused kernels fall back to plain PyTorch: one warning naming the cause, the
same numbers, ``use_fused_kernels: null`` takes the current path and ``true`` is an error naming the key."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from hybridrl.megatron.vocab_parallel import use_fused_kernels
from hybridrl.ops import compiled_kernels, kernels_for, lm_head_logprob_entropy, torch_kernels
from hybridrl.ops.cpp_build import DISABLE_ENV, load_cpu_ops

CPU = torch.device("cpu")


@pytest.fixture
def fresh_loader():
    load_cpu_ops.cache_clear()
    yield
    load_cpu_ops.cache_clear()  # later tests load the real build again


def _no_compiler(mp: pytest.MonkeyPatch) -> None:
    mp.setenv("CXX", "/nonexistent/bin/c++")


def _no_ninja(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(torch.utils.cpp_extension, "is_ninja_available", lambda: False)


def _disabled(mp: pytest.MonkeyPatch) -> None:
    mp.setenv(DISABLE_ENV, "1")


@pytest.mark.parametrize(("cause", "says"), [(_no_compiler, "no C++ compiler ('/nonexistent/bin/c++'"),
                                             (_no_ninja, "ninja is not installed"),
                                             (_disabled, f"{DISABLE_ENV}=1")])
def test_fallback_warns_once_and_computes_the_same(fresh_loader, monkeypatch, cause, says: str) -> None:
    cause(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compiled_kernels(CPU) is None
        assert kernels_for(CPU) is torch_kernels
        assert use_fused_kernels(None, CPU) is False  # null: the current implementation
        assert use_fused_kernels(False, CPU) is False
        g = torch.Generator().manual_seed(0)
        hidden, weight = torch.randn(9, 16, generator=g), torch.randn(40, 16, generator=g)
        target = torch.randint(0, 37, (9,), generator=g)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = lm_head_logprob_entropy(h, w, target, vocab_size=37, temperature=0.8, chunk_size=16)
        (lp + 0.5 * ent).sum().backward()
    mine = [str(c.message) for c in caught if "fused log-prob/entropy kernels unavailable" in str(c.message)]
    assert len(mine) == 1 and says in mine[0], mine
    with pytest.raises(RuntimeError, match=r"actor_rollout_ref\.actor\.megatron\.use_fused_kernels=true"):
        use_fused_kernels(True, CPU)

    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp = torch.log_softmax((h64 @ w64.t())[:, :37] / 0.8, -1)
    lp64, ent64 = logp.gather(-1, target[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    (lp64 + 0.5 * ent64).sum().backward()
    for a, b in ((lp, lp64), (ent, ent64), (h.grad, h64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-6 * b.abs().max().item())


def test_null_uses_the_kernels_when_they_build(fresh_loader) -> None:
    assert use_fused_kernels(None, CPU) is True and use_fused_kernels(True, CPU) is True


@pytest.mark.distributed
def test_every_rank_takes_the_same_path(torchrun, tmp_path) -> None:
    """One rank without the kernels: with null every rank takes the plain path (their TP collectives differ),
    with true every rank raises (none is left waiting in a collective), false stays off."""
    out = torchrun([str(Path(__file__).parent / "workers" / "fused_agree.py"), str(tmp_path)], nproc=2).stdout
    got = {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)}
    for rank in (0, 1):
        assert got[rank]["null"] is False and got[rank]["false"] is False, got
        assert got[rank]["true"].startswith("error: actor_rollout_ref.actor.megatron.use_fused_kernels=true but "
                                            "rank 1: the fused kernels are unavailable on cpu"), got
    assert "the plain log-prob path on every rank, as rank 1" in out  # said where the kernels were there


def test_validate_refuses_true_without_a_toolchain(monkeypatch, tmp_path) -> None:
    """``use_fused_kernels=true`` on a machine without a C++ compiler: a config error before any model is built
    (not at the first log-prob pass); null passes (it falls back with a warning)."""
    from hybridrl.config.compose import compose_config
    from hybridrl.config.errors import ConfigError
    from hybridrl.config.validate import validate

    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path))  # nothing built: model/data checks are pending
    _no_compiler(monkeypatch)
    key = "actor_rollout_ref.actor.megatron.use_fused_kernels"
    with pytest.raises(ConfigError, match=rf"{key}=True: the fused kernels cannot be used here: no C\+\+ compiler"):
        validate(compose_config(["recipe=grpo_tiny", f"{key}=true"]), world_size=1, before_bootstrap=True)
    validate(compose_config(["recipe=grpo_tiny"]), world_size=1, before_bootstrap=True)
