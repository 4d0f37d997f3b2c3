"""DPO (launch/dpo.py): config errors before anything is built; a short run end to end (full and LoRA) whose
metrics agree with an independent transformers computation from the saved checkpoint; TP=2, PP=2 and DP=2
equal 1 rank."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridrl.algorithms.dpo_loss import dpo_loss
from hybridrl.config.dpo_schema import compose_dpo, validate_dpo
from hybridrl.config.errors import ConfigError
from hybridrl.data.rows import read_rows

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
BETA = 0.5


def dpo_args(tmp: Path, out: Path, *extra: str) -> list[str]:
    """dpo_tiny on a random tiny model and the arithmetic pairs, both built by the recipe inside ``tmp``
    (the hybridrl cache of the run), for ``STEPS`` steps of 16 pairs."""
    return [str(REPO / "launch" / "dpo.py"), "recipe=dpo_tiny", f"model.path={tmp / 'random'}",
            "model.build_if_missing=tiny", f"data.train_files=[{tmp / 'pairs' / 'train.parquet'}]",
            f"data.val_files=[{tmp / 'pairs' / 'test.parquet'}]", f"trainer.total_training_steps={STEPS}",
            "data.train_batch_size=16", "data.micro_batch_size_per_gpu=4", f"trainer.test_freq={STEPS // 2}",
            "optim.lr=1e-3", f"algorithm.beta={BETA}", f"trainer.output_dir={out}", f"trainer.save_path={out / 'hf'}",
            *extra]


def metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The TP=1 run the tests below read: ~25 s on idle cores (Megatron's import, building the random model
    and 4000 pairs, 4 steps, 2 validations), over a minute when other jobs share the 2 cores."""
    tmp = tmp_path_factory.mktemp("dpo")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_CACHE_DIR": str(tmp)}
    proc = subprocess.run([sys.executable, *dpo_args(tmp, tmp / "tp1")], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"DPO (sigmoid, beta={BETA}, label_smoothing=0.0): 4000 pairs, 4 steps of 16 pairs" in proc.stdout
    return tmp


@pytest.fixture(scope="module")
def lora_run(dpo_run: Path) -> Path:
    """The same run with LoRA adapters (rank 8) on every linear: the reference is the policy with its adapters
    off. ~20 s on idle cores (model and pairs are dpo_run's)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_CACHE_DIR": str(dpo_run)}
    lora = ["model.lora_rank=8", "model.lora_alpha=16", "model.target_modules=all-linear"]
    proc = subprocess.run([sys.executable, *dpo_args(dpo_run, dpo_run / "lora", *lora)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "trainable parameters" in proc.stdout  # the adapters were on (the policy's LoRA start-up line)
    return dpo_run / "lora"


@pytest.mark.slow
@pytest.mark.parametrize("run", ["tp1", "lora"])
def test_first_step_has_policy_equal_to_reference(dpo_run: Path, lora_run: Path, run: str) -> None:
    rows = metrics(dpo_run / run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first = rows[0]
    assert first["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)  # h = 0 on every pair
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margin"] == 0.0
    assert first["dpo/grad_norm"] > 0 and first["dpo/update_skipped"] == 0.0
    assert rows[-1]["dpo/loss"] < math.log(2) and rows[-1]["rewards/margin"] > 0  # it learns the preference
    assert [r["step"] for r in rows if "val/dpo/loss" in r] == [STEPS // 2, STEPS]


def _sequence_logprobs(model: torch.nn.Module, tok: AutoTokenizer, prompt: str, response: str) -> float:
    prompt_ids = tok(prompt)["input_ids"]
    response_ids = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    targets = ids[0, 1:]
    return float(logp.gather(1, targets[:, None])[len(prompt_ids) - 1:].sum())


@pytest.mark.parametrize("run", ["tp1", "lora"])
def test_validation_metrics_match_transformers_on_the_saved_checkpoint(dpo_run: Path, lora_run: Path,
                                                                      run: str) -> None:
    """The last ``val/*`` metrics, recomputed from the saved HF checkpoint (policy; LoRA: merged) and the start
    model (reference; LoRA: the policy with its adapters off must be exactly that) with transformers: pair
    alignment, EOS, sequence sums and the reduction all agree."""
    policy = AutoModelForCausalLM.from_pretrained(dpo_run / run / "hf").eval()
    ref = AutoModelForCausalLM.from_pretrained(dpo_run / "random").eval()
    tok = AutoTokenizer.from_pretrained(dpo_run / "random")
    pairs = [r for _, r in read_rows(dpo_run / "pairs" / "test.parquet")][:200]
    lp = {name: torch.tensor([[_sequence_logprobs(m, tok, p["prompt"], p[k]) for p in pairs]
                              for k in ("chosen", "rejected")]) for name, m in (("policy", policy), ("ref", ref))}
    terms = dpo_loss(lp["policy"][0], lp["policy"][1], lp["ref"][0], lp["ref"][1], beta=BETA)
    expected = {f"val/{k}": float(v) / len(pairs) for k, v in terms.metric_sums().items()}
    last = metrics(dpo_run / run)[-1]
    assert len(pairs) == 200
    for key, value in expected.items():
        assert last[key] == pytest.approx(value, abs=2e-5), key


def test_saved_checkpoint_is_the_trained_policy(dpo_run: Path) -> None:
    before = load_file(dpo_run / "random" / "model.safetensors")
    after = load_file(dpo_run / "tp1" / "hf" / "model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "layout"), [("tp2", ["megatron.tensor_model_parallel_size=2"]),
                                              ("pp2", ["megatron.pipeline_model_parallel_size=2"]),
                                              ("dp2", [])], ids=["tp2", "pp2", "dp2"])
def test_two_ranks_equal_one(dpo_run: Path, torchrun: Any, monkeypatch: pytest.MonkeyPatch, name: str,
                             layout: list[str]) -> None:
    """The same run on 2 gloo ranks at TP=2, PP=2 (the loss on the last stage only) or DP=2 (8 pairs a rank,
    the mean over all 16): the same metrics every step (the loss at step k > 1 depends on the weights after
    k − 1 steps; step 1's grad norm is the split gradient's) and the same update.
    Over a minute each on shared cores (~45 s idle): two ranks each import Megatron and run the whole launch."""
    out = dpo_run / name
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(dpo_run))  # torchrun's ranks inherit it (the recipe's cache)
    torchrun(dpo_args(dpo_run, out, *layout), nproc=2, timeout=600)
    for one, two in zip(metrics(dpo_run / "tp1"), metrics(out), strict=True):
        for key in ("dpo/loss", "dpo/grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracy",
                    "val/dpo/loss", "val/rewards/accuracy"):
            assert (key in two) == (key in one), (one["step"], key)
            # step 1: the policy is the reference, every margin 0 up to float noise (at TP=2 the frozen reference
            # runs Megatron's frozen-weight linear, ~5e-7 off the trained one's in log-prob on packed rows), so its
            # accuracy counts noise signs; the rewards themselves are compared
            if key in one and not (key == "rewards/accuracy" and one["step"] == 1):
                assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (one["step"], key)
    start = load_file(dpo_run / "random" / "model.safetensors")
    after_one = load_file(dpo_run / "tp1" / "hf" / "model.safetensors")
    after_two = load_file(out / "hf" / "model.safetensors")
    for name, w in start.items():
        d1, d2 = after_one[name] - w, after_two[name] - w
        assert float((d2 - d1).norm()) <= 1e-3 * float(d1.norm()) + 1e-7, name


# ---- config errors: all at once, before any model is built ----
def test_algorithm_and_shared_problems_reported_together() -> None:
    cfg = compose_dpo(["recipe=dpo_tiny", "algorithm.loss_type=hinge", "algorithm.beta=0",
                       "algorithm.label_smoothing=0.7", "data.micro_batch_size_per_gpu=5",
                       "data.rejected_key=chosen"])
    with pytest.raises(ConfigError) as e:
        validate_dpo(cfg, world_size=1, before_bootstrap=True)
    found = {i.key: i.message for i in e.value.issues}
    assert found["algorithm.loss_type"] == "valid: sigmoid, ipo"
    assert found["algorithm.beta"] == "must be > 0 (e.g. 0.1)"
    assert found["algorithm.label_smoothing"].startswith("must be in [0, 0.5)")
    assert "split into micro-batches of this size" in found["data.micro_batch_size_per_gpu"]  # SFT's check
    assert "must differ" in found["data.rejected_key"]


def test_label_smoothing_is_for_sigmoid_only() -> None:
    cfg = compose_dpo(["recipe=dpo_tiny", "algorithm.loss_type=ipo", "algorithm.label_smoothing=0.1"])
    with pytest.raises(ConfigError, match=r"algorithm.label_smoothing=0.1: applies to loss_type=sigmoid only"):
        validate_dpo(cfg, world_size=1, before_bootstrap=True)
    validate_dpo(compose_dpo(["recipe=dpo_tiny", "algorithm.loss_type=ipo"]), world_size=1, before_bootstrap=True)


def test_unknown_key_and_unknown_data_build_are_named() -> None:
    with pytest.raises(ConfigError, match=r"algorithm.betta"):
        compose_dpo(["recipe=dpo_tiny", "algorithm.betta=0.2"])
    cfg = compose_dpo(["recipe=dpo_tiny", "data.build_if_missing=pairs"])
    with pytest.raises(ConfigError, match=r"data.build_if_missing='pairs': valid: arithmetic, arithmetic_preference"):
        validate_dpo(cfg, world_size=1, before_bootstrap=True)


def test_launch_exits_with_the_config_error_before_building(tmp_path: Path) -> None:
    env = {**os.environ, "HYBRIDRL_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "dpo.py"), "recipe=dpo_tiny", "algorithm.beta=-1",
                           f"trainer.output_dir={tmp_path / 'out'}"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 2 and "algorithm.beta=-1.0: must be > 0" in proc.stderr, proc.stderr[-3000:]
    assert not any(tmp_path.iterdir())  # no data, no model, no output dir
