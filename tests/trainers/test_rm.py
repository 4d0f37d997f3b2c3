"""The reward-model trainer (launch/rm.py): config errors before anything is built; a short run whose held-out metrics
transformers reproduces from the saved *ForSequenceClassification; LoRA; TP=2 and PP=2 equal one rank; GRPO scored by
the saved model (reward.name=model)."""

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
from support.e2e import TRAIN, base_overrides, read_metrics, tiny  # noqa: F401  (tiny: a fixture)

from hybridrl.algorithms.rm_loss import bradley_terry_loss
from hybridrl.config.errors import ConfigError, DataError
from hybridrl.config.rm_schema import compose_rm, validate_rm
from hybridrl.data.rows import read_rows
from hybridrl.rewards.model import ModelReward, assistant_turn_end, load_reward_model

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def rm_args(tmp: Path, out: Path, *extra: str) -> list[str]:
    """rm_tiny on a random tiny model and the arithmetic pairs, both built by the recipe inside ``tmp`` (the hybridrl
    cache of the run), for ``STEPS`` steps of 16 pairs."""
    return [str(REPO / "launch" / "rm.py"), "recipe=rm_tiny", f"model.path={tmp / 'random'}",
            "model.build_if_missing=tiny", f"data.train_files=[{tmp / 'pairs' / 'train.parquet'}]",
            f"data.val_files=[{tmp / 'pairs' / 'test.parquet'}]", f"trainer.total_training_steps={STEPS}",
            "data.train_batch_size=16", "data.micro_batch_size_per_gpu=4", f"trainer.test_freq={STEPS // 2}",
            "optim.lr=1e-3", "optim.lr_warmup_steps=0", f"trainer.output_dir={out}", f"trainer.save_path={out / 'hf'}",
            *extra]


def metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The TP=1 run the tests below read: ~25 s on idle cores (Megatron's import, building the random model and
    4000 pairs, 4 steps, 2 evaluations of 200 pairs), over a minute when other jobs share the 2 cores."""
    tmp = tmp_path_factory.mktemp("rm")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_CACHE_DIR": str(tmp)}
    proc = subprocess.run([sys.executable, *rm_args(tmp, tmp / "tp1")], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "RM (Bradley–Terry, margin=none, center_rewards_coefficient=0): 4000 pairs, 4 steps of 16 pairs" in \
        proc.stdout
    return tmp


def _scores(path: Path, pairs: list[dict[str, Any]]) -> torch.Tensor:
    """``[2, N]`` transformers scores of each pair's chosen and rejected sequence: prompt + response + EOS, as the
    trainer renders them (the recipe has no chat template), right-padded in one batch (transformers pools at each
    row's last non-pad token)."""
    tok, model = load_reward_model(str(path), dtype=torch.float32)
    rows = [tok(p["prompt"])["input_ids"] + tok(p[key], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            for key in ("chosen", "rejected") for p in pairs]
    ids = torch.full((len(rows), max(map(len, rows))), tok.pad_token_id)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long()).logits[:, 0].double().view(2, -1)


@pytest.mark.slow
def test_eval_metrics_are_what_transformers_gives_on_the_saved_checkpoint(rm_run: Path) -> None:
    """The last ``eval/*`` metrics, recomputed by transformers from the saved checkpoint on each held-out sequence
    alone: the export (names, head, config), the position scored and the pair reduction all agree."""
    rows = metrics(rm_run / "tp1")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "eval/pair_accuracy" in r] == [STEPS // 2, STEPS]
    assert all(math.isfinite(r["rm/loss"]) and r["rm/grad_norm"] > 0 for r in rows)
    config = json.loads((rm_run / "tp1" / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["num_labels"] == 1
    _assert_eval_metrics_reproduced(rm_run, "tp1")
    weights = load_file(rm_run / "tp1" / "hf" / "model.safetensors")
    assert weights["score.weight"].shape == (1, config["hidden_size"]) and "lm_head.weight" not in weights


@pytest.mark.slow
def test_lora_trains_the_adapters_and_the_head(rm_run: Path) -> None:
    """LoRA (rank 8, every linear): the trunk's base frozen, adapters and the new head trained; the saved
    checkpoint is the merged model, and transformers reproduces its eval metrics. ~20 s on idle cores."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_CACHE_DIR": str(rm_run)}
    lora = ["model.lora_rank=8", "model.lora_alpha=16", "model.target_modules=all-linear"]
    proc = subprocess.run([sys.executable, *rm_args(rm_run, rm_run / "lora", *lora)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "(+ the score head, trained in full)" in proc.stdout
    start = load_file(rm_run / "random" / "model.safetensors")
    after = load_file(rm_run / "lora" / "hf" / "model.safetensors")
    assert not torch.equal(start["model.layers.0.self_attn.q_proj.weight"],
                           after["model.layers.0.self_attn.q_proj.weight"])  # merged adapters
    assert torch.equal(start["model.norm.weight"], after["model.norm.weight"])  # not adapted: frozen
    _assert_eval_metrics_reproduced(rm_run, "lora")


def _assert_eval_metrics_reproduced(rm_run: Path, run: str) -> None:
    """The run's last ``eval/*`` metrics equal transformers' on its saved checkpoint over the 200 held-out pairs."""
    pairs = [r for _, r in read_rows(rm_run / "pairs" / "test.parquet")]
    assert len(pairs) == 200
    s = _scores(rm_run / run / "hf", pairs)
    last = metrics(rm_run / run)[-1]
    for key, value in bradley_terry_loss(s[0], s[1]).metric_sums().items():
        assert last[f"eval/{key}"] == pytest.approx(float(value) / len(pairs), abs=2e-5), key


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [["megatron.tensor_model_parallel_size=2"],
                                    ["megatron.pipeline_model_parallel_size=2"]], ids=["tp2", "pp2"])
def test_two_ranks_equal_one(rm_run: Path, torchrun: Any, monkeypatch: pytest.MonkeyPatch,
                             layout: list[str]) -> None:
    """TP=2 (the head replicated, its input the all-reduced hidden state) and PP=2 (the scores on the last stage):
    step 1 — the same start model — gives the one-rank loss, accuracy and gradient norm; the later steps and the
    saved update agree too. Over a minute each on shared cores (~45 s idle): two ranks each import Megatron."""
    out = rm_run / layout[0].split(".")[1].split("_")[0]
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(rm_run))
    torchrun(rm_args(rm_run, out, *layout), nproc=2, timeout=600)
    for one, two in zip(metrics(rm_run / "tp1"), metrics(out), strict=True):
        for key in ("rm/loss", "rm/grad_norm", "rm/pair_accuracy", "rm/margin", "eval/loss", "eval/pair_accuracy"):
            assert (key in two) == (key in one), (one["step"], key)
            if key in one:
                assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (one["step"], key)
    start = load_file(rm_run / "random" / "model.safetensors")
    after_one = load_file(rm_run / "tp1" / "hf" / "model.safetensors")
    after_two = load_file(out / "hf" / "model.safetensors")
    assert after_one.keys() == after_two.keys()
    for name, w in after_one.items():
        d1 = w - start.get(name, torch.zeros_like(w))  # score.weight is new: compared whole
        d2 = after_two[name] - start.get(name, torch.zeros_like(w))
        assert float((d2 - d1).norm()) <= 1e-3 * float(d1.norm()) + 1e-7, name


@pytest.mark.distributed
def test_grpo_scores_with_the_saved_reward_model(rm_run: Path, tiny: dict[str, Path],  # noqa: F811 (the fixture)
                                                 torchrun: Any) -> None:
    """``reward.name=model`` loads the saved checkpoint as it is and an RL run trains on its scores: each sample's
    reward is transformers' score of its prompt + response."""
    rm, out = rm_run / "tp1" / "hf", rm_run / "grpo"
    # trained on plain text (data.apply_chat_template=false), saved without a chat template: read as plain text
    torchrun([TRAIN, *base_overrides(tiny, out, "reward.name=model", f"+reward.kwargs.path={rm}",
                                     "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                                     "actor_rollout_ref.rollout.n=4", "trainer.total_training_steps=2",
                                     "trainer.test_freq=0", "trainer.val_before_train=false",
                                     f"trainer.rollout_data_dir={out / 'rollouts'}")], nproc=1)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["reward/mean"]) and math.isfinite(r["actor/pg_loss"]) for r in rows)
    samples = [json.loads(line) for line in (out / "rollouts" / "1.jsonl").read_text().splitlines()]
    tok, model = load_reward_model(str(rm), dtype=torch.float32)
    for s in samples[:4]:
        ids = tok(s["input"], add_special_tokens=False)["input_ids"] + s["response_ids"]  # EOS included
        with torch.no_grad():
            expected = float(model(input_ids=torch.tensor([ids])).logits[0, 0])
        assert s["score"] == pytest.approx(expected, abs=1e-4)


def test_chat_rendering_is_what_the_reward_manager_scores(rm_run: Path, tmp_path: Path) -> None:
    """With a chat template, a trained sequence (the dataset's templated prompt + response + the template's end of an
    assistant turn) is token for token what ``ModelReward`` builds to score that prompt and response. (The recipe's
    own export, trained on plain text, has no template: it is read as plain text.)"""
    import shutil

    assert load_reward_model(str(rm_run / "tp1" / "hf"), dtype=torch.float32)[0].chat_template is None
    rm = tmp_path / "chat-rm"
    shutil.copytree(rm_run / "tp1" / "hf", rm)
    shutil.copy(rm_run / "random" / "chat_template.jinja", rm / "chat_template.jinja")  # as if trained on chat
    reward = ModelReward(ModelReward.Config(path=str(rm)), tokenizer=load_reward_model(str(rm),
                                                                                       dtype=torch.float32)[0])
    tok = reward.rm_tokenizer
    end = assistant_turn_end(tok)
    assert end == "<|im_end|>\n"
    prompt = tok.apply_chat_template([{"role": "user", "content": "12+34="}], add_generation_prompt=True,
                                     tokenize=False)
    prompt_ids = list(tok(prompt, add_special_tokens=False)["input_ids"])
    trained = prompt_ids + list(tok("46", add_special_tokens=False)["input_ids"]) \
        + list(tok(end, add_special_tokens=False)["input_ids"])
    response_ids = list(tok("46", add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
    assert reward.encode(prompt_ids, response_ids)[0] == trained


def test_bradley_terry_formula() -> None:
    chosen, rejected = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.5])
    margin = torch.tensor([0.5, 0.0, 1.0])
    t = bradley_terry_loss(chosen, rejected, margin_N=margin, center_rewards_coefficient=0.01)
    expected = [-math.log(1 / (1 + math.exp(-(c - r - m)))) + 0.01 * (c + r) ** 2
                for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin.tolist(), strict=True)]
    assert t.loss_N.tolist() == pytest.approx(expected, rel=1e-6)
    sums = t.metric_sums()
    assert float(sums["pair_accuracy"]) == 1.0 and float(sums["margin"]) == pytest.approx(-0.5)


# ---- config errors: all at once, before any model is built ----
def test_problems_reported_together(tmp_path: Path) -> None:
    cfg = compose_rm(["recipe=rm_tiny", "algorithm.center_rewards_coefficient=-1", "data.margin_key=chosen",
                      "data.micro_batch_size_per_gpu=5"])
    with pytest.raises(ConfigError) as e:
        validate_rm(cfg, world_size=1, before_bootstrap=True)
    found = {i.key: i.message for i in e.value.issues}
    assert found["algorithm.center_rewards_coefficient"].startswith("must be a number ≥ 0")
    assert found["data.margin_key"].startswith("must differ from the pair's columns")
    assert "split into micro-batches of this size" in found["data.micro_batch_size_per_gpu"]  # SFT's check


def test_a_family_transformers_cannot_load_as_a_reward_model_is_refused(tmp_path: Path) -> None:
    config = json.loads((REPO / "recipes" / "model_configs" / "glm-4.5.json").read_text())
    (tmp_path / "glm.json").write_text(json.dumps(config))
    cfg = compose_rm(["recipe=rm_tiny"])
    with pytest.raises(ConfigError, match=r"'glm4_moe' model, for which the installed transformers has no "
                                          r"\*ForSequenceClassification"):
        validate_rm(cfg, world_size=64, before_bootstrap=True, model_config=tmp_path / "glm.json")


def test_a_non_numeric_margin_names_the_file_and_row(rm_run: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from hybridrl.data.preference import PreferenceDataset, PreferenceDatasetConfig

    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "gap": 1.0},
            {"prompt": "2+2=", "chosen": "4", "rejected": "5", "gap": "big"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = AutoTokenizer.from_pretrained(rm_run / "random")
    with pytest.raises(DataError, match=r"pairs.jsonl row 1: 'gap' \(data.margin_key\) must be a finite number, got "
                                        r"'big'"):
        ds = PreferenceDataset([path], tokenizer=tok, config=PreferenceDatasetConfig(
            apply_chat_template=False, margin_key="gap"))
        [ds[i] for i in range(len(ds))]


def test_launch_exits_with_the_config_error_before_building(tmp_path: Path) -> None:
    env = {**os.environ, "HYBRIDRL_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "rm.py"), "recipe=rm_tiny",
                           "algorithm.center_rewards_coefficient=-1", f"trainer.output_dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "algorithm.center_rewards_coefficient=-1.0: must be a number ≥ 0" in proc.stderr, \
        proc.stderr[-3000:]
    assert not any(tmp_path.iterdir())  # no data, no model, no output dir


def test_validate_plans_the_7b_recipe_at_scale(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridrl.cli import main

    qwen = str(REPO / "recipes" / "model_configs" / "qwen2.5-7b.json")
    assert main(["validate", "recipe=rm_qwen7b", "--model-config", qwen]) == 0
    out = capsys.readouterr().out
    assert "world_size: 8 (launch/rm.py)" in out and "config OK" in out
    assert "scored by a one-output head in place of the LM head" in out
    assert "GB of 80 GB (trainer.device_memory_gb)" in out
    # the same recipe on too small GPUs is refused naming the key and what would fit
    assert main(["validate", "recipe=rm_qwen7b", "--model-config", qwen, "trainer.device_memory_gb=24",
                 "megatron.tensor_model_parallel_size=1", "megatron.use_distributed_optimizer=false"]) == 2
    err = capsys.readouterr().err
    assert "trainer.device_memory_gb=24" in err and "cannot fit" in err
