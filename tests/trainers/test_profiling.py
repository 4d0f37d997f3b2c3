"""``trainer.profile_steps``: a torch.profiler trace per rank for the chosen steps, results unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridrl.bootstrap import write_arithmetic_task
from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate
from hybridrl.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("profiling")
    make_tiny_model(tmp / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    write_arithmetic_task(tmp / "train.parquet", tmp / "test.parquet")
    return tmp


def overrides(tiny: Path, out: Path, *extra: str) -> list[str]:
    """grpo_tiny, 2 steps on a 2-layer model, saving the actor's HF weights at the end."""
    return ["recipe=grpo_tiny", f"actor_rollout_ref.model.path={tiny / 'model'}",
            "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{tiny / 'train.parquet'}]",
            "data.val_files=[]", "data.build_if_missing=null", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.n=4", "trainer.total_training_steps=2", "trainer.save_freq=2",
            "trainer.save_hf_weights=true", f"trainer.output_dir={out}", *extra]


# differ between any two runs: wall/CPU times, and the mean engine-vs-actor log-prob gap (seen to change in the
# 8th digit between two unprofiled step 1s at DP=2 on CPU; its max and everything else are bitwise equal)
NOT_REPRODUCIBLE = ("timing", "perf/tokens_per_s", "rollout/logprob_abs_diff")


def metrics(out: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOT_REPRODUCIBLE) or k.endswith("_max")} for r in rows]


@pytest.mark.distributed
def test_profiled_steps_leave_a_trace_per_rank_and_change_nothing(torchrun, tiny: Path) -> None:
    """Two 2-rank (DP=2) runs of 2 steps, one profiling step 2: two launches, ~1.5 min on 2 idle cores."""
    plain, profiled = tiny / "plain", tiny / "profiled"
    torchrun([TRAIN, *overrides(tiny, plain)], nproc=2)
    proc = torchrun([TRAIN, *overrides(tiny, profiled, "trainer.profile_steps=[2]")], nproc=2)

    for rank in (0, 1):  # a Chrome trace per rank, with the ops of the step's phases in it
        trace = json.loads((profiled / "profile" / f"step_2.rank_{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"aten::mm", "aten::softmax"} & names, sorted(n for n in names if n)[:50]
        table = (profiled / "profile" / f"top_ops.rank_{rank}.txt").read_text()
        assert f"top ops of step(s) [2] on rank {rank}, by self CPU time" in table
    assert not list((profiled / "profile").glob("step_1.*"))  # only the listed step
    # rank 0 prints its table at the end: ops sorted by self CPU time
    printed = proc.stdout[proc.stdout.index("top ops of step(s) [2] on rank 0"):].splitlines()[2:12]
    self_ms = [float(line.split()[0]) for line in printed]
    assert self_ms == sorted(self_ms, reverse=True) and self_ms[0] > 0

    assert metrics(profiled) == metrics(plain)
    gaps = [[json.loads(line)["rollout/logprob_abs_diff"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            for out in (plain, profiled)]
    assert gaps[0] == pytest.approx(gaps[1], abs=1e-6)
    weights = [load_file(out / "checkpoints" / "step_00000002" / "hf" / "model.safetensors") for out in (plain,
                                                                                                          profiled)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_profile_steps_outside_the_run_are_a_config_error(tiny: Path) -> None:
    cfg = compose_config(overrides(tiny, tiny / "bad", "trainer.profile_steps=[0,2,3]"))
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1)
    assert "trainer.profile_steps" in str(e.value) and "step(s) [0, 3] outside the run: valid steps are 1..2" in str(
        e.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: a GPU check (tests/gpu/run_all.sh)")
def test_on_cuda_kernels_are_traced_and_the_table_is_by_self_cuda_time(tmp_path: Path) -> None:
    from hybridrl.trainers.profiling import StepProfiler

    profiler = StepProfiler([1], tmp_path)
    x = torch.randn(1024, 1024, device="cuda")
    for step in (1, 2):  # step 2 is not profiled
        with profiler.step(step):
            for _ in range(5):
                x = torch.tanh(x @ x)
            torch.cuda.synchronize()
    trace = json.loads((tmp_path / "profile" / "step_1.rank_0.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
    lines = (tmp_path / "profile" / "top_ops.rank_0.txt").read_text().splitlines()
    assert "by self CUDA time" in lines[0] and "self CUDA ms" in lines[1]
    cuda_ms = [float(line.split()[2]) for line in lines[2:]]
    assert cuda_ms == sorted(cuda_ms, reverse=True) and cuda_ms[0] > 0
