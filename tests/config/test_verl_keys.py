"""A verl user's command line runs here (issue 25): verl's keys with verl's meaning, every unknown key in one error,
the verl key table in agreement with the schema and docs/verl.md.

The ``tests/fixtures/verl/*.args`` files are the overrides of verl's own Megatron example scripts (GRPO, PPO with a
critic, DAPO; the source script and commit in each file's header), data paths replaced by our own files.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.overrides import key_problem, schema_keys
from hybridrl.config.schema import RLConfig
from hybridrl.config.validate import validate
from hybridrl.config.verl_keys import VERL_KEYS, markdown_table
from hybridrl.registry import Registry

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "tests" / "fixtures" / "verl").glob("*.args"))
QWEN7B = REPO / "recipes" / "model_configs" / "qwen2.5-7b.json"
AOR = "actor_rollout_ref"


def script_overrides(path: Path, data: Path, home: Path) -> list[str]:
    lines = [x for x in path.read_text().splitlines() if x and not x.startswith("#")]
    return [x.replace("$DATA", str(data)).replace("$HOME", str(home)) for x in lines]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Parquet files at every path the scripts name (7473 GSM8K-sized train rows each)."""
    root = tmp_path_factory.mktemp("verl_data")
    for name in ("gsm8k/train", "gsm8k/test", "math/train", "math/test", "dapo-math-17k", "aime-2024"):
        path = root / f"{name}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = 7473 if "train" in name or "17k" in name else 30
        pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "1+1?"}]] * rows,
                                 "ground_truth": ["2"] * rows}), path)
    return root


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_verl_example_scripts_validate_for_their_gpus(script: Path, data_dir: Path, tmp_path: Path) -> None:
    """Each script's overrides, exactly as written, validate on 80 GB GPUs for the nodes it names (planned with a
    7B config.json: no weights, no GPU here), and the run lasts what verl would make of total_epochs."""
    overrides = script_overrides(script, data_dir, tmp_path)
    cfg = compose_config(["recipe=grpo_qwen7b", *overrides, "trainer.device_memory_gb=80"])
    t = cfg.trainer
    plan = validate(cfg, model_config=QWEN7B, world_size=t.nnodes * t.n_gpus_per_node)
    assert plan.memory is not None and plan.memory.peak <= 80e9
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in cfg.data.train_files)
    assert plan.config.trainer.total_training_steps == rows // cfg.data.train_batch_size * t.total_epochs  # verl's
    assert t.total_training_steps is None  # the config validated is left as it was
    assert any(n.startswith("total steps ") for n in plan.notes)


def test_verl_meanings_land_on_hybridrl_keys(data_dir: Path, tmp_path: Path) -> None:
    cfg = compose_config(["recipe=grpo_qwen7b", *script_overrides(SCRIPTS[0], data_dir, tmp_path)])
    for path in SCRIPTS:
        if path.stem == "dapo_7b_math_megatron":
            cfg = compose_config(["recipe=grpo_qwen7b", *script_overrides(path, data_dir, tmp_path)])
    assert cfg.algorithm.policy_loss_kwargs == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 10.0}
    assert cfg.reward.overlong_buffer.enable and cfg.reward.overlong_buffer.len == 4096
    assert cfg.trainer.resume == "auto" and cfg.trainer.output_dir.endswith("DAPO-Qwen2.5-7b-MATH-megatron-0519a1")
    assert cfg.data.train_files == [str(data_dir / "dapo-math-17k.parquet")]  # a lone path is a list of one
    assert cfg.data.truncation == "left" and cfg.actor_rollout_ref.rollout.val_kwargs.do_sample
    sync = compose_config(["recipe=grpo_qwen7b", "data.return_raw_chat=", "trainer.resume_mode=disable",
                           f"{AOR}.model.enable_gradient_checkpointing=True", f"{AOR}.rollout.enforce_eager=True",
                           f"{AOR}.rollout.name=vllm", "trainer.critic_warmup=0"])
    assert sync.trainer.resume == "never"
    assert sync.actor_rollout_ref.rollout.engine_kwargs == {"enforce_eager": True}
    derived = validate(sync, model_config=QWEN7B).config.actor_rollout_ref.actor.megatron
    assert derived.override_transformer_config["recompute_granularity"] == "full"
    hf = compose_config(["recipe=grpo_tiny", f"{AOR}.rollout.enforce_eager=True"])
    assert hf.actor_rollout_ref.rollout.engine_kwargs == {}  # hf has no CUDA graphs: a notice, no effect


def test_notices_name_each_verl_key_once(capsys: pytest.CaptureFixture[str]) -> None:
    compose_config(["recipe=grpo_tiny", "data.return_raw_chat=True", "trainer.log_val_generations=10",
                    f"{AOR}.actor.clip_ratio_high=0.28", f"{AOR}.rollout.enforce_eager=True"])
    out = capsys.readouterr().out
    assert "verl's data.return_raw_chat has no effect in hybridrl" in out
    assert "verl's trainer.log_val_generations has no effect" in out and "trainer.rollout_data_dir" in out
    assert f"verl's {AOR}.actor.clip_ratio_high is hybridrl's algorithm.policy_loss_kwargs.clip_ratio_high" in out
    assert f"verl's {AOR}.rollout.enforce_eager has no effect with rollout engine 'hf'" in out


def test_keys_that_would_change_the_run_are_refused_naming_what_to_use() -> None:
    with pytest.raises(ConfigError) as e:
        compose_config(["recipe=grpo_tiny", f"{AOR}.actor.megatron.use_dist_checkpointing=True",
                        "custom_reward_function.path=/x/reward.py", "reward_model.reward_manager=prime",
                        f"{AOR}.actor.megatron.expert_tensor_parallel_size=2"])
    keys = {i.key: i.message for i in e.value.issues}
    assert len(keys) == 4
    assert "model.path" in keys[f"{AOR}.actor.megatron.use_dist_checkpointing"]
    assert "reward.name=function" in keys["custom_reward_function.path"]
    assert "the experts' TP is the model's TP" in keys[f"{AOR}.actor.megatron.expert_tensor_parallel_size"]
    compose_config(["recipe=grpo_tiny", f"{AOR}.actor.megatron.use_dist_checkpointing=False",
                    "reward_model.reward_manager=dapo", f"{AOR}.actor.megatron.expert_tensor_parallel_size=1",
                    f"{AOR}.actor.megatron.expert_model_parallel_size=1"])  # EP: the actor's own key now


def test_an_engine_knob_set_twice_must_agree() -> None:
    with pytest.raises(ConfigError, match="disagrees with actor_rollout_ref.rollout.engine_kwargs.enforce_eager"):
        compose_config(["recipe=grpo_tiny", f"{AOR}.rollout.name=vllm", f"{AOR}.rollout.enforce_eager=True",
                        f"+{AOR}.rollout.engine_kwargs.enforce_eager=false"])


@pytest.mark.slow
def test_three_misspelled_keys_are_reported_in_one_run_of_the_trainer() -> None:
    """Hydra stops at the first; launch/train.py reports all three (and a bad value) before anything is built."""
    r = subprocess.run([sys.executable, "launch/train.py", "recipe=grpo_tiny", "trainer.totl_epochs=2",
                        f"{AOR}.rollout.gpu_memory_utilisation=0.5", "data.max_promt_length=64", "trainer.seed=abc"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "4 problems in the config" in r.stderr
    for wrong, right in (("trainer.totl_epochs", "trainer.total_epochs"),
                         (f"{AOR}.rollout.gpu_memory_utilisation", f"{AOR}.rollout.gpu_memory_utilization"),
                         ("data.max_promt_length", "data.max_prompt_length")):
        assert f"{wrong}: is not a config key; did you mean {right}" in r.stderr
    assert "trainer.seed='abc': Value 'abc'" in r.stderr and "loading" not in r.stdout


def test_a_recipe_files_unknown_keys_are_reported_with_the_overrides(tmp_path: Path) -> None:
    recipes = tmp_path / "recipes"
    (recipes / "recipe").mkdir(parents=True)
    (recipes / "config.yaml").write_text((REPO / "recipes" / "config.yaml").read_text())
    (recipes / "recipe" / "mine.yaml").write_text("# @package _global_\ntrainer:\n  total_epoch: 3\n")
    with pytest.raises(ConfigError) as e:
        compose_config(["recipe=mine", "data.max_promt_length=3"], config_dir=recipes)
    assert {i.key for i in e.value.issues} == {"trainer.total_epoch", "data.max_promt_length"}


def test_the_verl_table_agrees_with_the_schema_the_engines_and_the_docs() -> None:
    keys = set(schema_keys(RLConfig))
    for e in VERL_KEYS.values():
        if e.status == "same":
            assert e.key in keys, f"{e.key}: marked same, not in the schema"
        else:
            assert key_problem(RLConfig, e.key) is not None, f"{e.key}: in the schema, yet marked {e.status}"
        if e.status == "alias":
            assert e.target is not None and key_problem(RLConfig, e.target) is None, e.key
        for engine, name in e.engines.items():
            fields = {f.name for f in dataclasses.fields(Registry("rollout_engines").load(engine).Config)}
            assert name in fields, f"{e.key}: {engine} has no engine_kwargs.{name}"
    assert markdown_table() in (REPO / "docs" / "verl.md").read_text(), "regenerate the table in docs/verl.md"


def test_total_epochs_as_verl_resolves_it(tmp_path: Path) -> None:
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join('{"prompt": "1+1", "ground_truth": "2"}\n' for _ in range(400)))
    base = ["recipe=grpo_tiny", f"data.train_files=[{rows}]", "data.train_batch_size=32"]
    cfg = compose_config([*base, "trainer.total_epochs=3", "trainer.total_training_steps=null"])
    plan = validate(cfg, before_bootstrap=True)
    assert plan.config.trainer.total_training_steps == 12 * 3  # ⌊400 / 32⌋ per epoch, the last partial batch dropped
    cfg = compose_config([*base, "trainer.total_epochs=3", "trainer.total_training_steps=5"])
    assert validate(cfg, before_bootstrap=True).config.trainer.total_training_steps == 5  # set: it wins
    with pytest.raises(ConfigError, match="trainer.total_epochs=0"):
        validate(compose_config([*base, "trainer.total_epochs=0", "trainer.total_training_steps=null"]),
                 before_bootstrap=True)
