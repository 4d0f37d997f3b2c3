"""Each adaptation in hybridrl/megatron/cpu/ is still needed (the upstream call fails on CPU without
it, with the error its docstring names) and does its job. When an upstream release fixes one of
them, its ``*_still_fails`` test fails: delete the adaptation and the test.

All probes run in one 2-rank torchrun (tests/megatron/cpu_probes.py) to pay Megatron's import once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.distributed

NO_CUDA = "AssertionError: Torch not compiled with CUDA enabled"
PROBES = Path(__file__).with_name("cpu_probes.py")


@pytest.fixture(scope="module")
def probes(torchrun: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("cpu_probes")
    torchrun([str(PROBES), str(out)], nproc=2, timeout=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_current_device_still_fails(probes: list[dict[str, Any]]) -> None:
    assert probes[0]["rotary_without"] == NO_CUDA  # RotaryEmbedding.get_emb moves inv_freq to "GPU"
    assert probes[0]["rotary_with"] == [4, 1, 1, 8]


def test_rng_tracker_still_fails(probes: list[dict[str, Any]]) -> None:
    for rank in probes:
        assert rank["seed_without"] == NO_CUDA
        assert rank["fork_without"] == "Exception: cuda rng state model-parallel-rng is not added"
        assert rank["recompute_without"] == NO_CUDA


def test_cpu_rng_tracker_keeps_megatron_semantics(probes: list[dict[str, Any]]) -> None:
    with_ = [rank["rng_with"] for rank in probes]
    for tp_rank, got in enumerate(with_):
        # upstream's model-parallel seed: seed + 2718 + tp_rank, on its own generator
        expected = torch.rand(2, generator=torch.Generator().manual_seed(7 + 2718 + tp_rank)).tolist()
        assert got["tp_draw"] == expected
        assert got["checkpoint_grad"] == pytest.approx(got["expected_grad"], abs=0)  # recompute works
    assert with_[0]["tp_draw"] != with_[1]["tp_draw"]


def test_default_causal_mask_still_fails(probes: list[dict[str, Any]]) -> None:
    assert probes[0]["causal_mask_upstream"] == NO_CUDA
    assert probes[0]["causal_mask_ours"] == [[[[0, 1, 1], [0, 0, 1], [0, 0, 0]]]]  # True = masked


def test_schedule_cuda_literal_still_fails(probes: list[dict[str, Any]]) -> None:
    assert probes[0]["schedule_without"] == NO_CUDA
    assert probes[0]["schedule_with"] == 6.0  # forward + backward ran, grad of sum(2·w)


def test_batched_p2p_sync_still_fails(probes: list[dict[str, Any]]) -> None:
    for rank in probes:
        assert rank["p2p_without"] == NO_CUDA  # torch.cuda.synchronize() after batch_isend_irecv
    assert probes[0]["p2p_with"] == []
    assert probes[1]["p2p_with"] == [0.0, 1.0, 2.0, 3.0]


def test_batched_p2p_still_gives_wrong_interleaved_grads(probes: list[dict[str, Any]]) -> None:
    """At PP=2 both pipeline neighbours are the same rank: gloo pairs one batch's sends and receives in
    posting order and swaps an activation with a gradient, so the grads are silently wrong."""
    for rank in probes:
        expected = torch.tensor(rank["interleaved_expected"])  # autograd in one process
        assert torch.allclose(torch.tensor(rank["interleaved_unbatched"]), expected, rtol=1e-6, atol=1e-7)
        assert (torch.tensor(rank["interleaved_batched"]) - expected).abs().max() > 0.05  # batch_p2p_comm=True


def test_tied_embedding_setup_still_fails(probes: list[dict[str, Any]]) -> None:
    for rank in probes:
        assert rank["tied_without"] == NO_CUDA  # weight.data.cuda() before the embedding all-reduce
    first, last = probes[0]["tied_with"], probes[1]["tied_with"]
    assert isinstance(first, list) and first == last and any(first)  # last stage got stage 0's weights


def test_apply_is_idempotent_and_noop_on_cuda(probes: list[dict[str, Any]]) -> None:
    for rank in probes:
        assert rank["idempotent"] is True
        assert rank["noop_on_cuda"] == {"untouched": True, "mask_is_none": True, "no_kwargs": True}


def test_optimizer_cuda_literals_and_grad_type_assert_still_fail(probes: list[dict[str, Any]]) -> None:
    for rank in probes:
        assert rank["optimizer_without"] == NO_CUDA  # FP32Optimizer._scale = torch.tensor(..., device='cuda')
        assert rank["grad_norm_without"] == NO_CUDA  # get_grad_norm_fp32's dummy_overflow_buf
        assert rank["clip_assert_upstream"] == "AssertionError: "  # param.grad.type() == 'torch.cuda.FloatTensor'
        # DDP + SGD(lr=0.1) on sum(3·w), clip_grad=0.5: norm 6 over DP=2, clipped grads 0.25 → w = 0.975
        assert rank["optimizer_with"]["ok"] is True
        assert rank["optimizer_with"]["grad_norm"] == pytest.approx(6.0)
        assert rank["optimizer_with"]["w"] == pytest.approx([0.975] * 4)


def test_float16_optimizer_grad_type_check_still_fails(probes: list[dict[str, Any]]) -> None:
    for rank in probes:
        assert rank["bf16_optimizer_without"] == (  # Float16OptimizerWithFloat16Params.__init__
            "TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor,  torch.cuda.HalfTensor, or "
            "torch.cuda.BFloat16Tensor. Received torch.BFloat16Tensor")
        # SGD(lr=1e-3) on sum(w), w = 1 in bf16: the bf16 parameter can't move, the fp32 main weight does
        assert rank["bf16_optimizer_with"] == {"ok": True, "dtype": "torch.bfloat16", "w": [1.0] * 4,
                                               "main": [pytest.approx(0.999, abs=1e-7)] * 4}


def test_grad_scaler_cuda_literals_still_fail(probes: list[dict[str, Any]]) -> None:
    for rank in probes:
        assert rank["grad_scaler_without"] == NO_CUDA  # MegatronGradScaler._scale = torch.tensor(..., device='cuda')
        # DynamicGradScaler.load_state_dict: .cuda(torch.cuda.current_device()), the CPU device once adapted
        assert rank["grad_scaler_load_without"] == "RuntimeError: Invalid device, must be cuda device"
        # fp16 SGD(lr=0.1) on sum(3·w): scaled grads 3·2¹⁶, 3·2¹⁵ overflow fp16 (skipped, scale halves),
        # 3·2¹⁴ does not: w = 1 − 0.3 in the fp32 main weight; the scale survives a state-dict round trip
        got = rank["fp16_optimizer_with"]
        assert got["ok"] == [False, False, True]
        assert got["scales"] == [2.0**15, 2.0**14, 2.0**14]
        assert got["main"] == [pytest.approx(0.7)] * 4
        assert got["loaded_scale"] == 2.0**14


# The distributed optimizer probes: Adam (lr 0.1, clip 0.5) over w (1500) and v (500), loss
# sum((rank + 1)·(w + v)) on DP=2: the DP-mean grad is 1.5 per entry, norm 1.5·√2000, clipped to 0.5.
DISTOPT_NORM = 1.5 * 2000**0.5
DISTOPT_GRAD = 1.5 * 0.5 / DISTOPT_NORM


def test_distributed_optimizer_grad_type_check_still_fails(probes: list[dict[str, Any]]) -> None:
    for rank in probes:
        assert rank["distopt_without"] == (  # DistributedOptimizer._build_model_and_main_param_groups
            "TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor,  torch.cuda.HalfTensor, or "
            "torch.cuda.BFloat16Tensor. Received torch.FloatTensor")
        assert rank["distopt_with"]["ok"] is True
        assert rank["distopt_with"]["grad_norm"] == pytest.approx(DISTOPT_NORM)
        assert rank["distopt_with"]["weights"] == [pytest.approx(0.9)]  # Adam's first step, all-gathered
    assert [len(rank["distopt_with"]["steps"]) for rank in probes] == [2, 1]  # Adam states: w, v sharded


def test_distributed_optimizer_checkpoint_gather_still_fails(probes: list[dict[str, Any]]) -> None:
    for rank in probes:  # get_parameter_state_dp_zero: send_tensor.cuda() before the NCCL all-gather
        assert rank["distopt_ckpt_without"] == NO_CUDA
    assert probes[1]["distopt_ckpt_with"] is None  # the gloo path gathers on DP rank 0 only
    state = probes[0]["distopt_ckpt_with"]  # both ranks' shards, whole, in model space
    for name, numel in (("w", 1500), ("v", 500)):
        assert state[f"optimizer.state.param.{name}"] == [numel, [pytest.approx(0.9)]]
        assert state[f"optimizer.state.exp_avg.{name}"] == [numel, [pytest.approx(0.1 * DISTOPT_GRAD)]]  # 1 - β1
        assert state[f"optimizer.state.exp_avg_sq.{name}"] == [numel, [pytest.approx(0.001 * DISTOPT_GRAD**2)]]


def test_distributed_optimizer_resume_into_torch_adam_still_fails(probes: list[dict[str, Any]]) -> None:
    """Three gaps of the distributed optimizer with torch's Adam (no TE/apex) on resume; adapted, each
    rank gets its shard of the Adam state back and the next step is the uninterrupted one."""
    for rank in probes:
        resume = rank["distopt_resume"]
        assert resume["state_without"] == "AssertionError: "  # state_dict(): assert len(steps) == 1
        assert resume["step_without"] == "KeyError: 'step'"  # _set_main_param_and_optimizer_states
        assert resume["with"]["exp_avg"] == [pytest.approx(0.1 * DISTOPT_GRAD)]
        after = resume["with"]["after_step"]
        assert after["weights"] == [pytest.approx(0.8)] and set(after["steps"]) == {2.0}  # Adam's 2nd step
    # one step tensor for both of rank 0's Adam states: the step after a load counts it twice
    assert probes[0]["distopt_resume"]["shared_step_without"] == [3.0, 3.0]
    assert [rank["distopt_resume"]["with"]["shard"] for rank in probes] == [1012, 988]  # of 2000 entries


def test_cp_rope_slice_still_fails(probes: list[dict[str, Any]]) -> None:
    for rank in probes:  # torch.tensor(..., pin_memory=True).cuda() for the chunk index
        assert rank["cp_rope_without"].startswith("RuntimeError: pin_memory=True requires a CUDA")
    assert probes[0]["cp_rope_with"] == [0.0, 1.0, 6.0, 7.0]  # chunks 0 and 3 of 4
    assert probes[1]["cp_rope_with"] == [2.0, 3.0, 4.0, 5.0]  # chunks 1 and 2
