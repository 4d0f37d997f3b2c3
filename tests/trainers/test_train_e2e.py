"""The RL loop end to end (launch/train.py under torchrun, real Megatron + hf engine), a few steps."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from support.e2e import TRAIN, base_overrides, overrides, read_metrics, tiny  # noqa: F401, F811  (tiny: a fixture)

EXPECTED_KEYS = {
    "reward/mean", "response/length_mean", "actor/pg_loss", "actor/ppo_kl", "actor/ppo_kl_first_mb",
    "actor/clipfrac", "actor/entropy", "actor/grad_norm", "actor/kl_ref", "rollout/logprob_abs_diff",
    "rollout/weight_version", "timing/gen", "timing/update_actor", "timing/sync_weights", "perf/tokens_per_s",
}


@pytest.mark.distributed
def test_grpo_tiny_runs_and_engine_actor_sync_agree(torchrun, tiny: dict[str, Path],  # noqa: F811 (the fixture)
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tiny["tmp"] / "run"
    monkeypatch.setenv("HYBRIDRL_CHECK_COLLECTIVES", "1")  # every collective checks its tensors' device
    # a random model never solves arithmetic; a keyword reward gives it a learning signal
    keyword = ["reward.name=keyword", "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any"]
    proc = torchrun([TRAIN, *overrides(tiny, out, *keyword, f"trainer.rollout_data_dir={out / 'rollouts'}")], nproc=1)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # eval at start, then each step
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[3]
    for r in rows[1:]:
        assert EXPECTED_KEYS <= r.keys(), EXPECTED_KEYS - r.keys()
        assert all(math.isfinite(v) for v in r.values()), r
        # engine, actor and weight sync agree: log-probs match, the first mini-batch is on-policy
        assert r["rollout/logprob_abs_diff"] <= 1e-4
        assert abs(r["actor/ppo_kl_first_mb"]) <= 1e-6
    # timing/step is the wall time between steps: step 3's holds its evaluation, which no other step has
    stages = ("timing/gen", "timing/update_actor", "timing/sync_weights")
    assert "timing/eval" in rows[3] and not any("timing/eval" in r for r in rows[1:3])
    assert rows[3]["timing/step"] >= rows[3]["timing/eval"] + sum(rows[3][k] for k in stages)
    assert all(r["timing/step"] >= sum(r[k] for k in stages) for r in rows[1:])
    # the share of computed positions that are padding, per pass: none, as rows are packed (the default)
    for r in rows[1:]:
        shares = {k: v for k, v in r.items() if k.startswith("perf/padding_share/")}
        assert {"perf/padding_share/old_log_prob", "perf/padding_share/update_actor", "perf/padding_share/ref"} <= \
            shares.keys(), shares
        assert all(v == 0.0 for v in shares.values()), shares
    # timing_cpu/step: the process's CPU over the same span, at least its stages' (1 thread: about the wall time)
    cpu = tuple(k.replace("timing/", "timing_cpu/") for k in stages)
    assert all(r["timing_cpu/step"] >= sum(r[k] for k in cpu) - 1e-3 > 0 for r in rows[1:])
    # the engine reports the weights it sampled with: version k-1 at step k (synced after each update)
    assert [r["rollout/weight_version"] for r in rows[1:]] == [0.0, 1.0, 2.0]
    # actor == ref on the first of step 1's two mini-batches; the KL grows with the updates
    assert 0 <= rows[1]["actor/kl_ref"] < rows[3]["actor/kl_ref"]
    assert 0 < rows[1]["reward/mean"] < 1
    assert "step 3/3 (100%)" in proc.stdout and "ETA" in proc.stdout
    checked = re.search(r"collective device check: (\d+) calls checked", proc.stdout)
    # every step's log-prob reductions, loss normaliser and metric all-reduces went through the check (46 calls
    # with the fused log-prob kernels, which reduce max and sums in two calls; 82 without them)
    assert checked and int(checked[1]) > 30, proc.stdout[-2000:]
    # trainer.rollout_data_dir: every step's 16 samples, their score the one the step's reward/mean averages
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["1.jsonl", "2.jsonl", "3.jsonl"]
    for r in rows[1:]:
        dumped = [json.loads(line) for line in (out / "rollouts" / f"{r['step']}.jsonl").read_text().splitlines()]
        assert len(dumped) == 16 and {d["step"] for d in dumped} == {r["step"]}
        assert abs(sum(d["score"] for d in dumped) / 16 - r["reward/mean"]) <= 1e-6
        assert all(d["turns"] == 1 and d["loss_mask"] == [1] * len(d["response_ids"]) for d in dumped)
        assert all(d["input"].endswith("=") and d["data_source"] for d in dumped), dumped[0]


@pytest.mark.distributed
def test_bad_config_fails_before_any_model_is_built(torchrun, tiny: dict[str, Path]) -> None:  # noqa: F811
    out = tiny["tmp"] / "bad"
    with pytest.raises(AssertionError) as e:
        torchrun([TRAIN, *overrides(tiny, out, "actor_rollout_ref.rollout.n=1", "reward.name=nope")], nproc=1)
    msg = str(e.value)
    assert "actor_rollout_ref.rollout.n=1" in msg and "reward.name='nope'" in msg
    assert "loading" not in msg  # nothing was built
    assert not (out / "metrics.jsonl").exists()
