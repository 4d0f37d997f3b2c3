"""The RL loop with the vLLM engine (launch/train.py under torchrun): only ``rollout.name=vllm`` changes (the engine
picks CPU-correct defaults itself); engine and actor log-probs agree on every trained token, the weight version rises
with each swap, and no engine process outlives the run. The run is multi-turn (environment feedback between the
policy's turns, :data:`test_train_e2e.MULTI_TURN`, on a random model that ends its turns often) on 2 ranks: each rank
drives its own engine process, with vLLM's prefix cache kept over a step's turns and reset after each swap.
Time: ~60 s (two engine starts, 3 steps)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from support.e2e import MULTI_TURN, TRAIN, chatty, overrides, read_metrics

from hybridrl.bootstrap import write_arithmetic_task
from hybridrl.models.tiny import make_tiny_model

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: run `bash launch/install_vllm_cpu.sh` (CI's test command does)",
                allow_module_level=True)


@pytest.mark.vllm
@pytest.mark.distributed
def test_grpo_with_vllm_engine_actor_sync_agree(torchrun, tmp_path: Path) -> None:
    import psutil

    # head_dim 32: vLLM's CPU attention needs ≥ 32
    model = make_tiny_model(tmp_path / "model", hidden=64, layers=2, heads=2, kv_heads=1, max_positions=256)
    train, test = tmp_path / "train.parquet", tmp_path / "test.parquet"
    write_arithmetic_task(train, test)
    run = {"model": chatty(model, tmp_path / "chatty"), "train": train, "test": test, "tmp": tmp_path}
    out = tmp_path / "run_vllm"
    before = {p.pid for p in psutil.process_iter()}
    proc = torchrun([TRAIN, *overrides(run, out, "actor_rollout_ref.rollout.name=vllm", *MULTI_TURN,
                                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")], nproc=2,
                    timeout=600)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert all(math.isfinite(v) for v in r.values()), r
        assert r["rollout/logprob_abs_diff_max"] <= 1e-4, r  # vLLM's processed log-probs = log_softmax(logits/T)
        assert r["multi_turn/turns_mean"] > 1.2, r
        assert abs(r["actor/ppo_kl_first_mb"]) <= 1e-6
    assert [r["rollout/weight_version"] for r in rows[1:]] == [0.0, 1.0, 2.0]
    assert "step 3/3 (100%)" in proc.stdout
    assert "note: rollout engine vllm on CPU: release/resume around the train phase are no-ops" in proc.stdout
    left = [p for p in psutil.process_iter() if p.pid not in before and _is_engine(p)]
    assert left == [], left


def _is_engine(p: object) -> bool:
    import psutil

    try:
        return any("vllm" in part.lower() or "EngineCore" in part for part in p.cmdline())  # type: ignore[attr-defined]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
