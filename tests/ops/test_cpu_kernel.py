"""The C++ block kernels (csrc/logprob_entropy.cpp) against the plain-PyTorch ones, one process: every input
dtype, rows with a stride (a column slice of a wider tensor), targets off-block and in the padding, a block of
padding only, and the gradient written in place over the logits (as the LM-head backward does)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.ops import compiled_kernels, torch_kernels
from hybridrl.ops.cpp_build import build_name


@pytest.fixture(scope="module")
def cpp():
    kernels = compiled_kernels(torch.device("cpu"))
    assert kernels is not None, "the C++ kernels did not build here (see the warning)"
    return kernels


def _block(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    wide_NC = (torch.randn(6, 300, generator=g, dtype=torch.float64) * 3).to(dtype)
    return wide_NC[:, 40:240], torch.tensor([0, 150, -1, 199, 7, 181])  # 200 columns, row stride 300


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("valid", [200, 180, 0])
def test_cpp_kernels_match_torch(cpp, dtype: torch.dtype, valid: int) -> None:
    logits_NC, target_N = _block(dtype)
    assert logits_NC.stride(0) == 300
    got, want = cpp.row_stats(logits_NC, target_N, valid, 0.7), torch_kernels.row_stats(logits_NC, target_N, valid, 0.7)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # both fp64 (±inf, 0 compared exactly)
    if valid == 180:  # target 199 lies in the padding: log p = -inf, as the current implementation gives
        assert got[3, 2] == float("-inf")
    g = torch.Generator().manual_seed(2)
    log_z, ent = torch.randn(6, generator=g, dtype=torch.float64) + 9, torch.rand(6, generator=g, dtype=torch.float64)
    g_lp, g_ent = torch.randn(6, generator=g), torch.randn(6, generator=g)
    args = (target_N, valid, 0.7, log_z, ent, g_lp, g_ent)
    want = torch_kernels.row_grad(logits_NC, *args, torch.empty_like(logits_NC))
    in_place = logits_NC.clone()
    got = cpp.row_grad(in_place, *args, in_place)
    assert got.data_ptr() == in_place.data_ptr() and got.dtype == dtype
    tol = {torch.float32: 1e-6, torch.float64: 1e-12}.get(dtype, 1e-2)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    assert not got[:, valid:].any()  # padding columns get no gradient


def test_build_is_cached_under_the_hybridrl_cache(cpp) -> None:
    name, build_dir = build_name()
    assert (build_dir / f"{name}.so").is_file(), list(build_dir.iterdir())


def test_a_test_cache_reuses_the_default_caches_build(cpp, tmp_path, monkeypatch) -> None:
    from hybridrl.ops import cpp_build

    name, built = build_name()
    monkeypatch.setattr(cpp_build, "DEFAULT_CACHE", built.parents[1])  # where the build above lives
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path / "own-cache"))
    assert build_name() == (name, built)  # no second compile for a process with its own cache
    monkeypatch.setattr(cpp_build, "DEFAULT_CACHE", tmp_path / "no-build-here")
    assert build_name() == (name, tmp_path / "own-cache" / "torch_extensions" / name)


def test_consume_logits_writes_the_gradient_into_the_logits(cpp) -> None:
    """``logprob_entropy(consume_logits=True)``: same values and gradient as without, with the gradient in the
    logits' own storage (the [N, V] gradient the policy would otherwise allocate); a second saved use of the
    logits then fails loudly instead of reading gradients."""
    from hybridrl.ops.logprob import logprob_entropy

    g = torch.Generator().manual_seed(3)
    hidden_Nh = torch.randn(5, 8, generator=g, requires_grad=True)
    weight_Vh = torch.randn(300, 8, generator=g)
    target_N = torch.tensor([0, 299, 17, 250, 3])
    grads, storages = [], []
    for consume in (False, True):
        logits_NV = hidden_Nh @ weight_Vh.t()
        lp, ent = logprob_entropy(logits_NV, target_N, vocab_size=280, temperature=0.7, kernels=cpp,
                                  consume_logits=consume)
        seen: list[torch.Tensor] = []
        logits_NV.register_hook(seen.append)
        (lp.sum() + 0.3 * ent.sum()).backward()
        grads.append(hidden_Nh.grad.clone())
        hidden_Nh.grad = None
        storages.append(seen[0].data_ptr() == logits_NV.data_ptr())
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert storages == [False, True]
    # another op that saved the logits: whichever backward runs first, the result is right or it raises
    outcomes = []
    for squares_first in (True, False):
        for consume in (False, True):
            logits_NV = hidden_Nh @ weight_Vh.t()
            squares = (logits_NV * logits_NV).sum() if squares_first else None
            lp, _ = logprob_entropy(logits_NV, target_N, vocab_size=280, kernels=cpp, consume_logits=consume)
            squares = (logits_NV * logits_NV).sum() if squares is None else squares
            try:
                (lp.sum() + squares).backward()
            except RuntimeError as e:
                assert consume and "modified by an inplace operation" in str(e)
                outcomes.append("raised")
                continue
            finally:
                got, hidden_Nh.grad = hidden_Nh.grad, None
            if not consume:
                want = got
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=0)
                outcomes.append("same")
    assert "raised" in outcomes, outcomes  # autograd's version check did catch one order
