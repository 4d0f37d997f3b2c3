"""Disaggregated placement (``hybridrl/rollout/disaggregated.py``, ``hybridrl/distributed/bridge.py``): engines on
ranks of their own, the trainer on the rest, the same run as colocated engines give."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridrl.bootstrap import write_arithmetic_task
from hybridrl.distributed.bridge import Bridge, BridgeError
from hybridrl.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
AOR = "actor_rollout_ref"


def _pair(store: dist.Store, launch_ranks: list[int], work) -> list[object]:  # type: ignore[no-untyped-def]
    """``work(bridge)`` on bridge ranks 0 and 1, one thread each; their results."""
    results: list[object] = [None, None]

    def run(rank: int) -> None:
        bridge = Bridge(rank=rank, launch_ranks=launch_ranks, timeout_s=30, store=store)
        try:
            results[rank] = work(bridge)
        finally:
            bridge.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_objects_and_weight_buckets_cross_the_bridge_exactly() -> None:
    # odd byte counts before wider dtypes: every tensor must still view as its dtype at its offset
    bucket = [("a", torch.arange(3, dtype=torch.bfloat16)), ("b", torch.randn(2, 3)),
              ("c", torch.tensor(7, dtype=torch.int8)), ("d", torch.randn(5, dtype=torch.float64)),
              ("e", torch.randn(4, 2).t()), ("empty", torch.zeros(0, 4))]  # "e": not contiguous

    def work(bridge: Bridge) -> object:
        sent = {"prompts": [[1, 2, 3]], "seed": 2**62}
        got = bridge.broadcast_object(sent if bridge.rank == 0 else None)
        if bridge.rank == 1:
            bridge.send_object(["made", got], dst=0)
        back = bridge.recv_object(src=1) if bridge.rank == 0 else None
        buckets = [bridge.broadcast_bucket(bucket if bridge.rank == 0 else None),
                   bridge.broadcast_bucket(None)]
        return got, back, buckets

    (got0, back, _), (got1, _, (received, end)) = _pair(dist.HashStore(), [0, 3], work)  # type: ignore[misc]
    assert got0 == got1 == {"prompts": [[1, 2, 3]], "seed": 2**62} and back == ["made", got1]
    assert end is None and [n for n, _ in received] == [n for n, _ in bucket]
    for (_, want), (_, t) in zip(bucket, received, strict=True):
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)


PEER = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch.distributed as dist
    from hybridrl.distributed.bridge import Bridge
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
    Bridge(rank=1, launch_ranks=[0, 7], timeout_s=30, store=store)
    print("joined", flush=True)
    os._exit(3)  # dies without a word, as a killed engine rank does
""")


def test_a_dead_engine_rank_is_named_not_waited_for(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    peer = subprocess.Popen([sys.executable, str(script), str(store.port)], stdout=subprocess.PIPE, text=True)
    bridge = Bridge(rank=0, launch_ranks=[0, 7], timeout_s=20, store=store)
    assert peer.wait(30) == 3
    start = time.monotonic()
    with pytest.raises(BridgeError, match="launch rank 0 could not receive from launch rank 7"):
        bridge.recv_object(src=1)
    assert time.monotonic() - start < 20  # the closed connection is seen, not the timeout waited out


# ---- a whole run: disaggregated equals colocated ----
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("disagg")
    model = make_tiny_model(tmp / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    write_arithmetic_task(tmp / "train.parquet", tmp / "test.parquet")
    return {"model": model, "train": tmp / "train.parquet", "test": tmp / "test.parquet", "tmp": tmp}


# a random model never solves arithmetic; a keyword reward gives it a learning signal
KEYWORD = ("reward.name=keyword", "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any")


def run(torchrun, tiny: dict[str, Path], name: str, nproc: int, *extra: str,  # type: ignore[no-untyped-def]
        reward: tuple[str, ...] = KEYWORD) -> list[dict[str, float]]:
    out = tiny["tmp"] / name
    torchrun([TRAIN, "recipe=grpo_tiny", f"{AOR}.model.path={tiny['model']}", f"{AOR}.model.build_if_missing=null",
              f"data.train_files=[{tiny['train']}]", f"data.val_files=[{tiny['test']}]", "data.build_if_missing=null",
              f"trainer.output_dir={out}", "data.train_batch_size=4", f"{AOR}.actor.ppo_mini_batch_size=2",
              f"{AOR}.actor.ppo_micro_batch_size_per_gpu=4", f"{AOR}.rollout.n=4", "data.val_batch_size=32",
              "trainer.total_training_steps=3", "trainer.test_freq=3", "trainer.val_before_train=false",
              *reward, *extra], nproc=nproc, timeout=600)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def same_metrics(got: list[dict[str, float]], want: list[dict[str, float]]) -> None:
    """Every metric of ``want`` but times equal in ``got`` to 1e-6, step by step."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, c in zip(got, want, strict=True):
        compared = {k for k in c if not k.startswith(("timing", "perf/"))}  # timing/, timing_cpu/
        assert compared <= a.keys()
        for k in compared:
            assert math.isclose(a[k], c[k], rel_tol=0, abs_tol=1e-6), (a["step"], k, a[k], c[k])


@pytest.fixture(scope="module")
def colocated(torchrun, tiny: dict[str, Path]) -> list[dict[str, float]]:  # type: ignore[no-untyped-def]
    return run(torchrun, tiny, "colocated", 2)


DISAGG = (f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=2")


@pytest.mark.distributed
def test_a_disaggregated_run_equals_the_colocated_one(torchrun, tiny: dict[str, Path],  # type: ignore[no-untyped-def]
                                                      colocated: list[dict[str, float]]) -> None:
    """2 trainer ranks (DP=2) + 2 engine ranks against 2 colocated ranks (DP=2, 2 engines): the same samples (the
    ``hf`` engine honours per-prompt seeds), so the same metrics; the weights reach the engine ranks at every
    step (log-probs agree, versions rise). ~30 s: the colocated reference (shared with the next test) and a launch
    of 4 ranks on 2 cores."""
    apart = run(torchrun, tiny, "disaggregated", 4, *DISAGG)
    assert [r["rollout/weight_version"] for r in apart] == [0.0, 1.0, 2.0]
    assert 0 < apart[0]["reward/mean"] < 1 and "eval/accuracy" in apart[-1]
    assert all(r["rollout/logprob_abs_diff"] <= 1e-4 for r in apart)
    same_metrics(apart, colocated)


@pytest.mark.distributed
def test_asynchronous_at_staleness_0_is_the_synchronous_run(torchrun, tiny: dict[str, Path],  # type: ignore[no-untyped-def]
                                                            colocated: list[dict[str, float]]) -> None:
    """S = 0 admits one batch per weight version: the synchronous schedule, the same run (verl#6780 reports the
    opposite for its fully-async trainer). ~17 s: a launch of 4 ranks."""
    got = run(torchrun, tiny, "async0", 4, *DISAGG, "async_training.enable=true")
    same_metrics(got, colocated)
    assert [(r["async/staleness_max"], r["async/dropped_samples"]) for r in got] == [(0.0, 0.0)] * 3


CORRECTION = "algorithm.rollout_correction.rollout_is=token"
ONE_OFF = (f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=1", "async_training.enable=true",
           "async_training.staleness_threshold=1", CORRECTION,
           "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.max_checkpoints_to_keep=0")


@pytest.fixture(scope="module")
def one_step_off(torchrun, tiny: dict[str, Path]) -> list[dict[str, float]]:  # type: ignore[no-untyped-def]
    """S = 1 on 1 trainer + 1 engine rank, 4 steps, checkpoints at steps 2 and 4, every step's samples dumped."""
    return run(torchrun, tiny, "async1", 2, *ONE_OFF, f"trainer.rollout_data_dir={tiny['tmp'] / 'async1_samples'}")


def _samples(directory: Path, step: int) -> list[dict[str, object]]:
    return [json.loads(line) for line in (directory / f"{step}.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_one_step_off_policy_trains_each_batch_one_version_late(one_step_off: list[dict[str, float]]) -> None:
    """S = 1: step k's batch was generated while step k − 1 trained, on the weights before that update — every
    sample exactly one version behind from step 2 on, never more; the rollout correction sees the mismatch."""
    got = one_step_off
    assert [r["rollout/weight_version"] for r in got] == [0.0, 0.0, 1.0, 2.0]
    assert [(r["async/staleness_mean"], r["async/staleness_max"]) for r in got] == [(0.0, 0.0)] + [(1.0, 1.0)] * 3
    assert all(r["async/dropped_samples"] == 0 and 0 <= r["async/trainer_idle_ratio"] <= 1 for r in got)
    assert got[0]["rollout/logprob_abs_diff"] <= 1e-4 < got[1]["rollout/logprob_abs_diff"]  # off-policy from step 2


HELD_ENGINE = """
from dataclasses import dataclass

from hybridrl.rollout.engines.hf import HFRolloutEngine


class HeldHF(HFRolloutEngine):
    \"\"\"The hf engine whose ``hold_call``-th generate call stops at its first decoding step until ``abort()``
    (at most ``hold_s``): that call is certainly running when the next weight update comes.\"\"\"

    @dataclass(kw_only=True, slots=True)
    class Config(HFRolloutEngine.Config):
        hold_call: int = 2
        hold_s: float = 300.0

    def __init__(self, config, **ctx):
        super().__init__(config, **ctx)
        self.calls, self.held = 0, False
        self.model.register_forward_pre_hook(self._hold, with_kwargs=True)

    def generate(self, prompts, params, **kw):
        self.calls += 1
        return super().generate(prompts, params, **kw)

    def _hold(self, module, args, kwargs):
        decoding = kwargs["input_ids"].shape[1] == 1  # a sampled token in: the prompt's forward is done
        if decoding and self.calls == self.config.hold_call and not self.held:
            self.held = True
            self._abort.wait(self.config.hold_s)
"""


@pytest.fixture(scope="module")
def held_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site dir with the ``held_hf`` rollout engine, installed as a third party's engine would be."""
    from support.plugins import installed_plugin

    return installed_plugin(tmp_path_factory.mktemp("held_engine"), "held_engine", "hybridrl.rollout_engines",
                            {"held_hf": "held_engine:HeldHF"}, HELD_ENGINE)


@pytest.mark.distributed
def test_partial_rollouts_continue_interrupted_samples_within_the_bound(  # type: ignore[no-untyped-def]
        torchrun, tiny: dict[str, Path], held_engine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """S = 2 with ``partial_rollout``: the engine's second generate call (step 2's batch, made while step 1
    trains) is held at its first decoding step until the update after step 1 interrupts it — forced, not hoped for
    on an idle machine — and its samples continue on the new weights: samples spanning two versions, still never
    more than S behind. ~25 s: a 2-rank launch."""
    monkeypatch.setenv("PYTHONPATH", f"{held_engine}:{REPO}")
    got = run(torchrun, tiny, "partial", 2, f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=1",
              "async_training.enable=true", "async_training.staleness_threshold=2",
              "async_training.partial_rollout=true", "async_training.mask_stale_prefix=true",
              "algorithm.rollout_correction.rollout_is=token", "trainer.total_training_steps=3",
              f"{AOR}.rollout.name=held_hf", "data.max_response_length=16")
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_samples"] == 0 for r in got)
    assert got[0]["async/partial_samples"] == 0  # trained before any update
    assert got[1]["async/partial_samples"] > 0 and got[1]["async/stale_prefix_tokens"] > 0  # the held batch
    assert max(r["async/staleness_max"] for r in got) >= 1


@pytest.mark.distributed
def test_a_resumed_asynchronous_run_trains_the_same_prompts_within_the_bound(  # type: ignore[no-untyped-def]
        torchrun, tiny: dict[str, Path], one_step_off: list[dict[str, float]]) -> None:
    """Resumed from the S = 1 run's step-2 checkpoint (the batch of step 3 had been generated ahead, not trained):
    the resumed run draws it again from the saved position — steps 3 and 4 train the uninterrupted run's prompts,
    with the same per-step seeds — regenerated on the restored weights, so step 3 is fresh (staleness 0) and the
    bound holds after it (AReaL#1388: there it grew past S). ~15 s: a 2-rank launch of 2 steps."""
    checkpoint = tiny["tmp"] / "async1" / "checkpoints" / "step_00000002"
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    assert state["rollout"]["next_step"] == 3 and state["rollout"]["gate"]["consumed"] == 2 * 4
    assert state["sampler"]["batch_in_epoch"] == 2  # the oldest untrained batch, though the loader had run ahead
    got = run(torchrun, tiny, "async1_resumed", 2, *ONE_OFF, f"trainer.resume={checkpoint}",
              f"trainer.rollout_data_dir={tiny['tmp'] / 'resumed_samples'}")
    assert [r["step"] for r in got] == [3, 4]
    assert [(r["async/staleness_max"], r["async/dropped_samples"]) for r in got] == [(0.0, 0.0), (1.0, 0.0)]
    assert [r["rollout/weight_version"] for r in got] == [2.0, 2.0]  # step 4's batch was made while 3 trained
    for step in (3, 4):
        before, after = _samples(tiny["tmp"] / "async1_samples", step), _samples(tiny["tmp"] / "resumed_samples", step)
        assert [r["input"] for r in after] == [r["input"] for r in before]
    # the batch regenerated on the restored (newer) weights is not the stale one the first run trained
    assert [r["response_ids"] for r in _samples(tiny["tmp"] / "resumed_samples", 3)] != [
        r["response_ids"] for r in _samples(tiny["tmp"] / "async1_samples", 3)]


# ---- dynamic sampling (algorithm.filter_groups), asynchronously: hybridrl/rollout/async_dynamic.py ----
APART = (f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=1")
# 2 prompts a round, 4 groups a step; the keyword reward scores some samples of a prompt and not others
DAPO = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score", "data.gen_batch_size=2",
        "algorithm.filter_groups.max_num_gen_batches=5")


def _rounds(r: dict[str, float]) -> tuple[int, ...]:
    return tuple(int(r[f"dynamic_sampling/{k}"]) for k in ("gen_rounds", "kept_groups", "dropped_groups",
                                                           "refilled_groups", "wasted_rounds"))


@pytest.mark.distributed
def test_asynchronous_dynamic_sampling_at_staleness_0_is_the_synchronous_run(  # type: ignore[no-untyped-def]
        torchrun, tiny: dict[str, Path]) -> None:
    """S = 0 queues a step's rounds as the synchronous dynamic-sampling run draws them — the same loader batches,
    round seeds and filtering — so the same run, rounds and all. ~35 s: two 2-rank launches."""
    sync = run(torchrun, tiny, "dapo_sync", 2, *APART, *DAPO)
    got = run(torchrun, tiny, "dapo_async0", 2, *APART, *DAPO, "async_training.enable=true")
    same_metrics(got, sync)
    assert all(r["async/staleness_max"] == 0 and r["dynamic_sampling/wasted_rounds"] == 0 for r in got)
    assert all(_rounds(r)[0] >= 2 for r in got) and sum(_rounds(r)[2] for r in got) > 0  # groups were filtered


ASYNC_DAPO = (*APART, *DAPO, "async_training.enable=true", "async_training.staleness_threshold=1", CORRECTION,
              "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.max_checkpoints_to_keep=0")


@pytest.mark.distributed
def test_asynchronous_dynamic_sampling_keeps_the_bound_sample_by_sample_and_after_a_resume(  # type: ignore[no-untyped-def]
        torchrun, tiny: dict[str, Path]) -> None:
    """S = 1: rounds for the next step are generated while this one trains, so from step 2 on a step's samples are
    one version old (never more), read sample by sample from the dumped rollouts; every step trains 4 groups with
    signal (or refills at the cap). Resumed from step 2: the rounds generated ahead are drawn again from the saved
    position and regenerated on the restored weights — step 3 on-policy, the bound kept after it. ~45 s: a 2-rank
    run of 4 steps and its resume of 2."""
    first, again = tiny["tmp"] / "dapo1_samples", tiny["tmp"] / "dapo1_resumed_samples"
    got = run(torchrun, tiny, "dapo1", 2, *ASYNC_DAPO, f"trainer.rollout_data_dir={first}")
    for step, r in enumerate(got, start=1):
        trained = step - 1
        versions = [s["weight_version"] for s in _samples(first, step)]
        assert len(versions) == 16 and all(trained - 1 <= v <= trained for v in versions), (step, versions)
        assert r["async/staleness_max"] == trained - min(versions) and r["async/dropped_samples"] == 0
        rounds, kept, dropped, refilled, _ = _rounds(r)
        assert kept + dropped == 2 * rounds and refilled == (max(4 - kept, 0) if rounds == 5 else 0), r
    assert [r["async/staleness_max"] for r in got] == [0.0, 1.0, 1.0, 1.0]
    checkpoint = tiny["tmp"] / "dapo1" / "checkpoints" / "step_00000002"
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)["rollout"]
    assert state["next_step"] == 3 and state["gate"]["consumed"] == 2 * 4 and 0 < state["signal_rate"] <= 1
    resumed = run(torchrun, tiny, "dapo1_resumed", 2, *ASYNC_DAPO, f"trainer.resume={checkpoint}",
                  f"trainer.rollout_data_dir={again}")
    assert [(r["step"], r["async/staleness_max"]) for r in resumed] == [(3, 0.0), (4, 1.0)]
    # step 3's first round is the one the first run had drawn ahead: the same prompts, new samples
    assert _samples(again, 3)[0]["input"] == _samples(first, 3)[0]["input"]


SLOW_REWARD = '''
import time

def score(batch, tokenizer):
    time.sleep(0.6)  # a slow reward: the trainer takes longer per step than the engine
    return [float(len(r) > 0) for r in batch.response_ids]
'''


@pytest.mark.distributed
def test_a_slowed_trainer_meets_the_bound_sample_by_sample_and_never_passes_it(  # type: ignore[no-untyped-def]
        torchrun, tiny: dict[str, Path]) -> None:
    """S = 2 with a trainer slowed by its reward (0.6 s a step): the engine runs as far ahead as the gate lets it,
    so from step 3 on the samples are exactly S versions old — read sample by sample from the dumped rollouts:
    each sample trained at version v was sampled at a version ≥ v − S. ~20 s: a 2-rank launch of 5 steps."""
    fn = tiny["tmp"] / "slow_reward.py"
    fn.write_text(SLOW_REWARD)
    samples = tiny["tmp"] / "slow_samples"
    got = run(torchrun, tiny, "slow", 2, f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=1",
              "async_training.enable=true", "async_training.staleness_threshold=2",
              "algorithm.rollout_correction.rollout_is=token", "trainer.total_training_steps=5",
              f"trainer.rollout_data_dir={samples}",
              reward=("reward.name=function", f"+reward.kwargs.path={fn}:score", "+reward.kwargs.granularity=batch"))
    for step, r in enumerate(got, start=1):
        trained = step - 1  # one update per step
        versions = [s["weight_version"] for s in _samples(samples, step)]
        assert len(versions) == 16 and all(trained - 2 <= v <= trained for v in versions), (step, versions)
        assert r["async/staleness_max"] == trained - min(versions)
    assert [r["async/staleness_max"] for r in got] == [0.0, 1.0, 2.0, 2.0, 2.0]  # ahead as far as S allows
    assert all(r["async/dropped_samples"] == 0 for r in got)
    assert got[-1]["async/trainer_idle_ratio"] < 0.5  # the engine kept up: the trainer hardly waits


@pytest.mark.sglang
@pytest.mark.distributed
def test_sglang_on_an_engine_rank_with_partial_rollouts(torchrun, tiny: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    """The SGLang engine on the engine rank (its loop driven from the generating thread, weight updates from the
    command thread while paused): step 1 on-policy (SGLang's log-probs = the actor's), then one version behind at
    most, and no SGLang process outlives the run. ~40 s: SGLang's start on CPU."""
    import psutil

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed: run `bash launch/install_sglang_cpu.sh` (CI's test command does)")
    before = {p.pid for p in psutil.process_iter()}
    got = run(torchrun, tiny, "sglang_partial", 2, f"{AOR}.rollout.placement=disaggregated",
              f"{AOR}.rollout.num_ranks=1", f"{AOR}.rollout.name=sglang", "async_training.enable=true",
              "async_training.staleness_threshold=1", "async_training.partial_rollout=true",
              "algorithm.rollout_correction.rollout_is=token", "trainer.total_training_steps=3")
    assert got[0]["rollout/logprob_abs_diff_max"] <= 1e-4 and got[0]["async/staleness_max"] == 0
    assert all(r["async/staleness_max"] <= 1 and r["async/dropped_samples"] == 0 for r in got)
    assert [r["step"] for r in got] == [1, 2, 3] and "eval/accuracy" in got[-1]
    left = [p for p in psutil.process_iter() if p.pid not in before and p.name().startswith("sglang::")]
    assert left == [], left


@pytest.mark.distributed
def test_a_hung_engine_rank_ends_the_run_named_within_the_timeout(tiny: dict[str, Path]) -> None:
    """The engine rank is stopped (SIGSTOP: alive, silent — a hang no error reports) after step 1: trainer rank 0
    gives up on it within ``trainer.dist_timeout_s`` naming launch rank 1, the run fails, and torchrun leaves no
    rank behind. ~55 s: the 8 s timeout waited out and torchrun's shutdown of a stopped process."""
    import os
    import signal
    import socket

    import psutil

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tiny["tmp"] / "hung"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={port}", TRAIN, "recipe=grpo_tiny", f"{AOR}.model.path={tiny['model']}",
           f"{AOR}.model.build_if_missing=null", f"data.train_files=[{tiny['train']}]", "data.val_files=[]",
           "data.build_if_missing=null", f"trainer.output_dir={out}", "data.train_batch_size=4",
           f"{AOR}.actor.ppo_mini_batch_size=2", f"{AOR}.actor.ppo_micro_batch_size_per_gpu=4", f"{AOR}.rollout.n=4",
           "trainer.total_training_steps=50", "trainer.test_freq=0", "trainer.val_before_train=false", *KEYWORD,
           f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=1", "async_training.enable=true",
           "trainer.dist_timeout_s=8", "reward.timeout_s=5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").is_file() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        ranks = {int(env["RANK"]): p for p, env in _environs(psutil.Process(proc.pid).children(recursive=True))
                 if "RANK" in env}
        engine = ranks[1]
        engine.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        output, _ = proc.communicate(timeout=180)
        waited = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    named = "launch rank 1" in output or "engine ranks [1]" in output  # a receive names its peer, a broadcast all
    assert "BridgeError" in output and named and "trainer.dist_timeout_s" in output, output[-3000:]
    assert waited < 8 + 60, waited  # the bridge's timeout, then torchrun's shutdown
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE


def _environs(procs: list) -> list[tuple[object, dict[str, str]]]:  # type: ignore[type-arg]
    """Each process with its environment; one that ended meanwhile (a short-lived helper of a rank) is left out."""
    import psutil

    out = []
    for p in procs:
        try:
            out.append((p, p.environ()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out
