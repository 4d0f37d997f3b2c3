"""The RL loop with the SGLang engine (launch/train.py under torchrun): only ``rollout.name=sglang``
changes (the engine picks CPU-correct defaults itself); engine and actor log-probs agree on every trained token, the
weight version travels with the samples, and no engine process outlives the run. The run is multi-turn (episodes
with environment feedback between the policy's turns, :data:`test_train_e2e.MULTI_TURN`, on a random model that
ends its turns often): token ids in and out of SGLang over several turns per step, the engine awake throughout."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from support.e2e import MULTI_TURN, TRAIN, chatty, overrides, read_metrics, tiny  # noqa: F401

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed: run `bash launch/install_sglang_cpu.sh` (CI's test command does)",
                allow_module_level=True)


@pytest.mark.sglang
@pytest.mark.distributed
def test_grpo_with_sglang_engine_actor_sync_agree(torchrun, tiny: dict[str, Path]) -> None:  # noqa: F811
    import psutil

    out = tiny["tmp"] / "run_sglang"
    run = {**tiny, "model": chatty(tiny["model"], tiny["tmp"] / "chatty_sglang")}
    before = {p.pid for p in psutil.process_iter()}
    proc = torchrun([TRAIN, *overrides(run, out, "actor_rollout_ref.rollout.name=sglang", *MULTI_TURN)], nproc=1,
                    timeout=600)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert all(math.isfinite(v) for v in r.values()), r
        assert r["rollout/logprob_abs_diff_max"] <= 1e-4, r  # SGLang's log-probs = the actor's log_softmax(logits/T)
        assert r["multi_turn/turns_mean"] > 1.2, r
        assert abs(r["actor/ppo_kl_first_mb"]) <= 1e-6
    assert [r["rollout/weight_version"] for r in rows[1:]] == [0.0, 1.0, 2.0]  # reported by SGLang per sample
    assert "step 3/3 (100%)" in proc.stdout
    left = [p for p in psutil.process_iter() if p.pid not in before and p.name().startswith("sglang::")]
    assert left == [], left
