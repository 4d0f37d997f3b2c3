"""(a) grpo_tiny on one GPU in bf16, as the recipe is: does the RL loop stay on-policy and learn?

``launch/train.py recipe=grpo_tiny`` under torchrun (one rank) with ``trainer.device=cuda``,
``actor.megatron.dtype=bfloat16`` and the engine in bf16 too, ``GRPO_TINY_STEPS`` steps; the recipe
builds its own start model on first use (random tiny Qwen2 + the sft_tiny recipe, also on the GPU) in
``$HYBRIDRL_CACHE_DIR``. From ``metrics.jsonl``: the largest step mean of ``rollout/logprob_abs_diff``
(engine vs actor log-probs of the sampled tokens), the largest ``|actor/ppo_kl_first_mb|`` (the first
mini-batch is on-policy), and whether ``reward/mean`` rises (mean of the first 5 steps vs the last 5;
reported, not asserted: 20 steps are a noisy sample). The layer spec is the run's own
``megatron: ...`` line: the hf check runs whatever the box has (a bare box has no Transformer Engine:
Megatron's local spec; there is no key to force a spec); the sglang check (``--full``) needs TE.
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import pytest
import torch
from gpu_checks import (  # tests/gpu is on sys.path under pytest
    GRPO_TINY_STEPS,
    TRAIN,
    check_named,
    grpo_tiny_overrides,
    last_error,
    mean,
    megatron_line,
    read_metrics,
    report,
    work_dir,
)

from hybridrl.paths import cache_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: GPU checks run with tests/gpu/run_all.sh on a GPU machine"),
]
# bf16 on both sides (8 mantissa bits): engine and actor differ by rounding, not by a bug; fp32 runs
# give ≤ 1.1e-6 (README). Larger means a real mismatch (wrong weights after sync, wrong temperature, ...)
LOGPROB_ABS_DIFF_MAX = 0.05
PPO_KL_FIRST_MB_MAX = 1e-3  # the same model and batch twice: ~0 in any dtype


@pytest.mark.parametrize("engine", ["hf", pytest.param("sglang", marks=pytest.mark.sglang)])
def test_grpo_tiny(engine: str, torchrun) -> None:
    name = "grpo_tiny" if engine == "hf" else "grpo_tiny_sglang_te"
    if engine == "sglang":
        missing = [m for m in ("sglang", "transformer_engine") if importlib.util.find_spec(m) is None]
        if missing:
            report(check=name, figure=f"not run: {' and '.join(missing)} not installed (this check is for a full "
                                      "GPU environment: pip install 'hybridrl[sglang,te]')")
            pytest.fail(f"{name} needs {missing}")
    work = work_dir()
    out = work / f"grpo_tiny_{engine}"
    built = not (Path(cache_dir()) / "tiny" / "sft-qwen2").exists()
    t0 = time.perf_counter()
    try:
        proc = torchrun([str(TRAIN), *grpo_tiny_overrides(work, engine)], nproc=1,
                        timeout=check_named(name).timeout_s - 15)
    except AssertionError as e:
        report(check=name, figure=f"the run failed: {last_error(str(e))}")
        raise
    wall_s = time.perf_counter() - t0
    spec = megatron_line(proc.stderr + proc.stdout)
    rows = read_metrics(out)
    steps = [r for r in rows if "reward/mean" in r]
    diff = max(r["rollout/logprob_abs_diff"] for r in steps)
    diff_token = max(r["rollout/logprob_abs_diff_max"] for r in steps)
    kl = max(abs(r["actor/ppo_kl_first_mb"]) for r in steps)
    rewards = [r["reward/mean"] for r in steps]
    first, last = mean(rewards[:5]), mean(rewards[-5:])
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    figure = (f"{len(steps)} steps, {spec}, bf16, {engine} engine | logprob_abs_diff ≤ {diff:.1e} (token max "
              f"{diff_token:.2f}) | |ppo_kl_first_mb| ≤ {kl:.1e} | reward/mean {first:.3f} → {last:.3f} "
              f"({'rises' if last > first else 'does not rise'}) | eval/accuracy "
              f"{' → '.join(f'{a:.2f}' for a in accuracy)} | {mean([r['timing/step'] for r in steps]):.2f} s/step, "
              f"{wall_s:.0f} s in all{' incl. building the SFT start model' if built else ''}")
    report(check=name, figure=figure, logprob_abs_diff_max=diff, logprob_abs_diff_token_max=diff_token,
           ppo_kl_first_mb_abs_max=kl, reward_first5=first, reward_last5=last, reward_rises=last > first,
           eval_accuracy=accuracy, spec=spec, wall_s=wall_s, built_start_model=built)
    assert len(steps) == GRPO_TINY_STEPS, [r["step"] for r in rows]
    assert all(math.isfinite(v) for r in steps for v in r.values() if isinstance(v, float)), steps
    assert diff <= LOGPROB_ABS_DIFF_MAX, \
        f"engine and actor disagree: logprob_abs_diff {diff:.3g} (bf16 bound {LOGPROB_ABS_DIFF_MAX})"
    assert kl <= PPO_KL_FIRST_MB_MAX, f"the first mini-batch is not on-policy: |ppo_kl_first_mb| {kl:.3g}"
    # the engine sampled step k with the weights of update k-1: every sync arrived, with its version
    assert [r["rollout/weight_version"] for r in steps] == list(range(GRPO_TINY_STEPS))
    if engine == "sglang":
        assert spec == "TE spec", f"expected Transformer Engine's layer spec, the run used the {spec}"
