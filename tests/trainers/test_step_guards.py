"""Faults in a step never corrupt the model or hang the job (launch/train.py on a tiny model, real loop).

A throwaway distribution (pip-installed into a temp site dir, as a third party would) registers a reward
``fault`` that misbehaves on chosen calls: NaN scores, a wrong length, an exception on rank 1 only, a call
that never returns. Each torchrun run takes ~15–25 s on 2 cores (imports + Megatron init), hence the
several-minute total of this file.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.e2e import TRAIN, base_overrides, tiny  # noqa: F401  (tiny is a fixture)
from support.plugins import installed_plugin

from hybridrl.guards import (
    NonFiniteError,
    RewardContractError,
    SkipCounter,
    check_reward_scores,
    non_finite,
    update_skip_cause,
)

FAULT_REWARD = """
import os, time
from dataclasses import dataclass, field
import torch
from hybridrl.interfaces import RewardOutput

class Fault:
    @dataclass(kw_only=True, slots=True)
    class Config:
        fault: str = "nan_score"  # nan_score | wrong_length | raise_on_rank1 | sleep
        calls: list[int] = field(default_factory=list)  # faulty calls (1-based); empty: every call

    def __init__(self, config, *, tokenizer, **ctx):
        self.config, self.calls = config, 0

    def __call__(self, batch):
        self.calls += 1
        scores = batch.response_mask.sum(-1).float() % 2  # a learnable signal: odd lengths score 1
        if self.config.calls and self.calls not in self.config.calls:
            return RewardOutput(scores_B=scores)
        if self.config.fault == "nan_score":
            scores[1] = float("nan")
        elif self.config.fault == "wrong_length":
            scores = scores[:1]
        elif self.config.fault == "raise_on_rank1" and os.environ.get("RANK") == "1":
            raise ValueError("boom on rank 1")
        elif self.config.fault == "sleep":
            time.sleep(10**6)
        return RewardOutput(scores_B=scores)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed_plugin(tmp_path_factory.mktemp("fault_reward"), "fault_reward", "hybridrl.reward_managers",
                            {"fault": "fault_reward:Fault"}, FAULT_REWARD)


def train(tiny: dict[str, Path], site: Path, out: Path, *extra: str, nproc: int = 1,  # noqa: F811
          timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], float]:
    args = base_overrides(tiny, out, "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "trainer.val_before_train=false",
                          "trainer.test_freq=0", "reward.name=fault", *extra)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", TRAIN, *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    return proc, time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rows(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_reward_contract_and_causes_name_the_plugin() -> None:
    import torch

    with pytest.raises(RewardContractError, match=r"reward.name='r' returned scores_B of shape \(1,\); expected \(4"):
        check_reward_scores(torch.ones(1), batch_size=4, reward="r")
    with pytest.raises(RewardContractError, match="of dtype torch.int64"):
        check_reward_scores(torch.ones(4, dtype=torch.long), batch_size=4, reward="r")
    with pytest.raises(RewardContractError, match="of type list"):
        check_reward_scores([1.0] * 4, batch_size=4, reward="r")
    cause = non_finite("scores", torch.tensor([1.0, float("nan"), 0.0, float("inf")]), sample_ids=[7, 8, 9, 10])
    assert cause == "2 non-finite scores: sample 1 (dataset row 8) = nan, sample 3 (dataset row 10) = inf"
    assert non_finite("scores", torch.ones(3)) is None
    skips = SkipCounter(limit=2)
    skips.record("a")
    skips.record(None)  # a good step resets the run of skips
    skips.record("b")
    with pytest.raises(NonFiniteError, match="2 steps in a row were skipped .* the last because c"):
        skips.record("c")


@pytest.mark.distributed
def test_a_nan_reward_skips_the_step_and_the_run_goes_on(tiny: dict[str, Path], site: Path) -> None:  # noqa: F811
    out = tiny["tmp"] / "guard-nan"
    proc, _ = train(tiny, site, out, "+reward.kwargs.fault=nan_score", "+reward.kwargs.calls=[2]",
                    "trainer.total_training_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2 skipped: rank 0: 1 non-finite scores from reward.name='fault': sample 1" in proc.stdout
    got = rows(out)
    assert got[1] == {"step": 2, "training/skipped_steps": 1}  # nothing else happened in step 2
    assert got[2]["rollout/weight_version"] == 1.0  # step 3 samples with the one update made (step 1's)
    assert all(v == v for r in got for v in r.values())  # no NaN anywhere in the metrics


@pytest.mark.distributed
def test_nan_every_step_stops_the_run_with_the_cause(tiny: dict[str, Path], site: Path) -> None:  # noqa: F811
    out = tiny["tmp"] / "guard-nan-stop"
    proc, _ = train(tiny, site, out, "+reward.kwargs.fault=nan_score", "trainer.total_training_steps=5",
                    "trainer.max_consecutive_skipped_steps=2", "trainer.save_freq=1")
    assert proc.returncode != 0
    assert "2 steps in a row were skipped (trainer.max_consecutive_skipped_steps=2)" in proc.stderr
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step_*"))  # nothing saved


@pytest.mark.distributed
def test_a_reward_of_the_wrong_length_is_an_error_naming_it(tiny: dict[str, Path], site: Path) -> None:  # noqa: F811
    proc, _ = train(tiny, site, tiny["tmp"] / "guard-len", "+reward.kwargs.fault=wrong_length",
                    "trainer.total_training_steps=1")
    assert proc.returncode != 0
    assert "reward.name='fault' returned scores_B of shape (1,); expected (16,)" in proc.stderr


@pytest.mark.distributed
@pytest.mark.parametrize(("fault", "extra", "message"), [
    ("raise_on_rank1", [], "reward.name='fault' raised ValueError: boom on rank 1"),
    ("sleep", ["reward.timeout_s=5"], "reward.name='fault': scoring one batch took longer than 5.0 s"),
])
def test_a_failing_or_hung_reward_on_one_rank_ends_the_2_rank_run(tiny: dict[str, Path], site: Path,  # noqa: F811
                                                                  fault: str, extra: list[str], message: str) -> None:
    proc, took = train(tiny, site, tiny["tmp"] / f"guard-{fault}", f"+reward.kwargs.fault={fault}",
                       "trainer.total_training_steps=2", *extra, nproc=2,
                       timeout=240)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    print(f"{fault}: the run ended {took:.0f} s after launch")


def test_non_finite_weights_stop_before_a_sync_or_save() -> None:
    import torch
    import torch.distributed as dist

    from hybridrl.guards import require_finite

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        require_finite([torch.ones(3), torch.zeros(2)], what="the actor's weights")
        with pytest.raises(NonFiniteError, match="rank 0: the actor's weights are not all finite; stopping before it "
                                                 "reaches the rollout engines or a checkpoint"):
            require_finite([torch.ones(3), torch.tensor([1.0, float("inf")])], what="the actor's weights")
    finally:
        dist.destroy_process_group()


def test_update_skip_cause_counts_fp16_overflow_only_when_nothing_was_applied() -> None:
    ok, overflow = {"update_skipped": 0.0, "grad_nonfinite": 0.0}, {"update_skipped": 1.0, "grad_nonfinite": 0.0}
    guarded = {"update_skipped": 1.0, "grad_nonfinite": 1.0}
    assert update_skip_cause([ok, ok]) is None
    assert update_skip_cause([overflow, ok]) is None  # the scale halved, the next step applied: routine
    assert update_skip_cause([overflow, overflow]) == ("the fp16 loss scaler skipped all 2 optimizer step(s) "
                                                       "(gradient overflow)")
    assert update_skip_cause([ok, guarded]) == "an update's loss or gradient norm was not finite"


@pytest.mark.slow
def test_a_non_finite_gradient_skips_the_optimizer_step(tmp_path: Path) -> None:
    """fp32 Adam would step on NaN gradients; the policy skips the step, keeps the weights and the LR schedule.
    Under float16 Megatron's loss scaler skips it instead (and halves the scale); the guard stays out of its way."""
    from hybridrl.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "m", hidden=32, layers=2, heads=4, kv_heads=2, max_positions=64)
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parents[1] / "parallel" / "workers")!r})
from rl_step import fixed_batch
from transformers import AutoConfig
from hybridrl.megatron.config import MicroBatching
from hybridrl.config.schema import MegatronConfig, OptimConfig
from hybridrl.megatron.parallel import ParallelConfig, init_parallel, seed_everything
from hybridrl.megatron.policy import MegatronPolicy
init_parallel(ParallelConfig())
seed_everything(1)
hf = AutoConfig.from_pretrained({str(model)!r})
batch = fixed_batch(hf.vocab_size, hf.pad_token_id)
policy = MegatronPolicy(model_dir={str(model)!r}, megatron=MegatronConfig(), optim=OptimConfig(lr=1e-2),
                        total_steps=4, pad_token_id=hf.pad_token_id)
before = [p.detach().clone() for p in policy.parameters()]
def nan_loss(logp, ent, mb, *, normalizer):
    return (logp * float("nan")).sum() / normalizer, {{}}
m = policy.train_step(batch, nan_loss, batching=MicroBatching(micro_batch_size=8), loss_agg_mode="token-mean")
assert m["update_skipped"] == 1.0 and m["grad_nonfinite"] == 1.0, m
assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters())), "weights changed"
def ok_loss(logp, ent, mb, *, normalizer):
    return -(logp * mb.response_mask).sum() / normalizer, {{}}
m = policy.train_step(batch, ok_loss, batching=MicroBatching(micro_batch_size=8), loss_agg_mode="token-mean")
assert m["update_skipped"] == 0.0 and not all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))
# float16: the loss scaler, not the guard, handles it: the update is skipped and the scale drops
fp16 = MegatronPolicy(model_dir={str(model)!r}, megatron=MegatronConfig(dtype="float16"), optim=OptimConfig(lr=1e-2),
                      total_steps=4, pad_token_id=hf.pad_token_id)
before = [p.detach().clone() for p in fp16.parameters()]
scales = []
for _ in range(2):  # Megatron's hysteresis (2): the second overflow in a row halves the scale
    m = fp16.train_step(batch, nan_loss, batching=MicroBatching(micro_batch_size=8), loss_agg_mode="token-mean")
    assert m["update_skipped"] == 1.0 and m["grad_nonfinite"] == 0.0, m
    scales.append(m["loss_scale"])
assert scales == [2.0**16, 2.0**15], scales
assert all(torch.equal(a, b) for a, b in zip(before, fp16.parameters())), "weights changed"
m = fp16.train_step(batch, ok_loss, batching=MicroBatching(micro_batch_size=8), loss_agg_mode="token-mean")
assert m["update_skipped"] == 0.0 and m["loss_scale"] == 2.0**15, m
print("OK")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
