"""A verl user's command line runs here (issues 25, 42): verl's keys with verl's meaning, every unknown key in one
error, the verl key table in agreement with the schema and docs/verl.md.

The ``tests/fixtures/verl/*.args`` files are the overrides of verl's own Megatron example scripts (GRPO, PPO with a
critic, DAPO; verl b178a3cd), ``tests/fixtures/verl/current/*.args`` those of its current tree (verl 1dda039b: GRPO
and PPO on Qwen3-8B, DAPO, a Qwen3-30B-A3B MoE, GSPO, LoRA, one-step-off, on-policy distillation, two multi-turn
tool scripts, an FSDP script); the source script and commit in each file's header; ``tests/fixtures/verl/tool_config``
the tool YAMLs two of them name. Each runs with
``recipe=ppo_megatron_trainer`` (verl's defaults) in place of verl's launcher line.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from itertools import takewhile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.memory import GB
from hybridrl.config.overrides import key_problem, schema_keys
from hybridrl.config.schema import RLConfig
from hybridrl.config.validate import validate
from hybridrl.config.verl_keys import VERL_KEYS, markdown_table
from hybridrl.registry import Registry

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "verl"
OLD = sorted(FIXTURES.glob("*.args"))
CURRENT = sorted((FIXTURES / "current").glob("*.args"))
MODELS = REPO / "recipes" / "model_configs"
QWEN7B = MODELS / "qwen2.5-7b.json"
AOR = "actor_rollout_ref"
# current scripts that do not validate as written for want of a capability, and which (GSPO's TP2 × EP8 × ETP1 and
# LoRA's TP2 × PP2 × EP4 × ETP1 on 8 GPUs validate: Megatron's own expert grid, expert_tensor_parallel_size)
MISSING: dict[str, str] = {}
# current scripts refused as written: the keys the one error names
REFUSED = {
    "grpo_qwen3_8b_fsdp": {"model_engine"},  # verl's FSDP engine, one line
    "retool_gpt_oss_ppo_sglang_multiturn": {  # FSDP, and verl's dataset/reward/tool classes of the recipe's own
        "model_engine", "data.custom_cls.path", "data.custom_cls.name", "custom_reward_function.path",
        "custom_reward_function.name", "data.apply_chat_template_kwargs.reasoning_effort",
        f"{AOR}.rollout.multi_turn.tool_config_path"},
    # TP4 × PP2 × EP2 on 8 GPUs: Megatron's expert grid (ETP = TP when unset, as verl leaves it) is 4 × 2 × 2 = 16
    # ranks; Megatron refuses it too (parallel_state: world size not divisible by ETP × EP × PP)
    "grpo_qwen3_30b_a3b_megatron": {f"{AOR}.actor.megatron.expert_model_parallel_size"},
}


# the tool YAMLs the scripts name (their paths from the script's cwd, $HOME/verl), as verl's files read: gsm8k's
# from verl 9cd35420 (examples/sglang_multiturn/config/tool_config/), retool's from verl-recipe c2333399 (retool/)
TOOL_YAMLS = {
    "examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml": "gsm8k_tool_config.yaml",
    "recipe/retool/sandbox_fusion_tool_config.yaml": "retool_sandbox_fusion_tool_config.yaml",
}
# what the refusal of a script's tool YAML names
TOOL_REFUSALS = {
    "retool_gpt_oss_ppo_sglang_multiturn": ("recipe.retool.retool.CustomSandboxFusionTool", "calculator"),
}


def verl_checkout(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripts' cwd, ``$HOME/verl``, with their tool YAMLs in it."""
    for path, name in TOOL_YAMLS.items():
        (home / "verl" / path).parent.mkdir(parents=True, exist_ok=True)
        (home / "verl" / path).write_text((FIXTURES / "tool_config" / name).read_text())
    monkeypatch.chdir(home / "verl")


def model_config(script: Path) -> Path:
    """The architecture a script trains (Qwen2.5-7B for the 7B scripts)."""
    for name, config in (("30b_a3b", "qwen3-30b-a3b"), ("qwen3_vl_8b", "qwen3-vl-8b"), ("qwen3_8b", "qwen3-8b")):
        if name in script.stem:
            return MODELS / f"{config}.json"
    return QWEN7B


def script_overrides(path: Path, data: Path, home: Path) -> list[str]:
    """The script's overrides after what its ``--config-name`` yaml adds to ppo_megatron_trainer (the header's
    ``#   key=value`` lines under "adds on top of ppo_megatron_trainer:"), as verl composes them."""
    text = path.read_text().splitlines()
    start = next((i + 1 for i, x in enumerate(text) if x.endswith("adds on top of ppo_megatron_trainer:")), len(text))
    base = [kv for x in takewhile(lambda x: x.startswith("#   "), text[start:]) for kv in x[1:].split()]
    lines = [*base, *(x for x in text if x and not x.startswith("#"))]
    return [x.replace("$DATA", str(data)).replace("$HOME", str(home)) for x in lines]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Parquet files at every path the scripts name (7473 GSM8K-sized rows for a train split, 30 for a test one)."""
    root = tmp_path_factory.mktemp("verl_data")
    named = {m for p in [*OLD, *CURRENT] for m in re.findall(r"\$DATA/([^'\],\s]+\.parquet)", p.read_text())}
    for name in named:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = 30 if re.search(r"test|aime", name, flags=re.I) else 7473
        pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "1+1?"}]] * rows,
                                 "ground_truth": ["2"] * rows}), path)
    return root


def _params(scripts: list[Path]) -> list[object]:
    return [pytest.param(p, id=p.stem, marks=pytest.mark.xfail(strict=True, raises=ConfigError, reason=MISSING[p.stem]))
            if p.stem in MISSING else pytest.param(p, id=p.stem) for p in scripts if p.stem not in REFUSED
            or p.stem in MISSING]


@pytest.mark.parametrize("script", _params([*OLD, *CURRENT]))
def test_verl_example_scripts_validate_for_their_gpus(script: Path, data_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each script's overrides, exactly as written, after ``recipe=ppo_megatron_trainer``, validate on 80 GB GPUs for
    the nodes it names (planned with its model's config.json: no weights, no GPU here): the model state fits, a peak
    over the device is a note naming what would help, and the run lasts what verl would make of total_epochs."""
    verl_checkout(tmp_path, monkeypatch)
    overrides = script_overrides(script, data_dir, tmp_path)
    cfg = compose_config(["recipe=ppo_megatron_trainer", *overrides, "trainer.device_memory_gb=80"])
    t = cfg.trainer
    plan = validate(cfg, model_config=model_config(script), world_size=t.nnodes * t.n_gpus_per_node)
    assert plan.memory is not None and plan.memory.state <= 80 * GB
    assert (plan.memory.peak > 80 * GB) == any(n.startswith("memory: the largest rank may need") for n in plan.notes)
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in cfg.data.train_files)
    steps = t.total_training_steps or rows // cfg.data.train_batch_size * t.total_epochs  # verl's
    assert plan.config.trainer.total_training_steps == steps
    assert t.total_training_steps is None or t.total_training_steps == steps  # the config validated is left as it was


@pytest.mark.parametrize("script", [p for p in CURRENT if p.stem in REFUSED], ids=lambda p: p.stem)
def test_verl_scripts_hybridrl_cannot_run_are_refused_naming_each_key(script: Path, data_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused in one run, each key on one line that says what to use; verl's FSDP engine in one line; a tool YAML
    (read where the script reads it) for the tool it names."""
    verl_checkout(tmp_path, monkeypatch)
    with pytest.raises(ConfigError) as e:
        cfg = compose_config(["recipe=ppo_megatron_trainer", *script_overrides(script, data_dir, tmp_path)])
        t = cfg.trainer
        validate(cfg, model_config=model_config(script), world_size=t.nnodes * t.n_gpus_per_node)
    assert {i.key for i in e.value.issues} == REFUSED[script.stem], str(e.value)
    assert all("\n" not in i.message for i in e.value.issues)
    fsdp = [i.message for i in e.value.issues if i.key == "model_engine"]
    assert all("verl's FSDP engine" in m and "megatron.param_offload" in m for m in fsdp)
    tools = [i.message for i in e.value.issues if i.key == f"{AOR}.rollout.multi_turn.tool_config_path"]
    assert all(all(w in m for w in TOOL_REFUSALS[script.stem]) for m in tools), tools


def test_verls_qwen3_vl_script_offloads_the_optimizer_update_and_notes_its_moe_keys_once(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its override_optimizer_config (Megatron's CPU offload of the whole update, precision-aware) is planned in host
    memory; its DeepEP dispatcher keys, on a dense model, are one note."""
    script = next(p for p in CURRENT if p.stem == "grpo_qwen3_vl_8b_megatron")
    verl_checkout(tmp_path, monkeypatch)
    cfg = compose_config(["recipe=ppo_megatron_trainer", *script_overrides(script, data_dir, tmp_path)])
    plan = validate(cfg, model_config=model_config(script), world_size=8)
    assert plan.config.actor_rollout_ref.actor.optim.override_optimizer_config["optimizer_offload_fraction"] == 1
    assert plan.memory is not None and plan.memory.optimizer == 0 and plan.memory.optimizer_host > 0
    assert "in host memory, not counted" in plan.render()
    moe = [n for n in plan.notes if "moe_token_dispatcher_type" in n]
    assert moe == [f"{AOR}.actor.megatron.override_transformer_config: moe_token_dispatcher_type=flex, "
                   "moe_enable_deepep=True do nothing: the model is dense (no MoE layer to dispatch tokens to)"]


def test_verl_meanings_land_on_hybridrl_keys(data_dir: Path, tmp_path: Path) -> None:
    cfg = compose_config(["recipe=grpo_qwen7b", *script_overrides(OLD[0], data_dir, tmp_path)])
    for path in OLD:
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
                        "custom_reward_function.path=/x/reward.py", "reward_model.reward_manager=prime"])
    keys = {i.key: i.message for i in e.value.issues}
    assert len(keys) == 3
    assert "model.path" in keys[f"{AOR}.actor.megatron.use_dist_checkpointing"]
    assert "reward.name=function" in keys["custom_reward_function.path"]
    cfg = compose_config(["recipe=grpo_tiny", f"{AOR}.actor.megatron.use_dist_checkpointing=False",
                          "reward_model.reward_manager=dapo", f"{AOR}.actor.megatron.expert_tensor_parallel_size=1",
                          f"{AOR}.actor.megatron.expert_model_parallel_size=1"])  # EP and ETP: the actor's own keys
    assert cfg.actor_rollout_ref.actor.megatron.expert_tensor_parallel_size == 1


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
        elif not e.key.startswith("actor_rollout_ref.rollout.engine_kwargs."):  # verl's per-engine sub-dict of the
            # free-form engine_kwargs (engine_kwargs.vllm.*): translated before the schema is asked, as every entry is
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
