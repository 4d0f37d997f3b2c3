"""``recipe=ppo_megatron_trainer`` has verl's defaults: for every key of the verl table that hybridrl reads with verl's
meaning (``same``, ``alias``), the composed value is the one verl's generated ``ppo_megatron_trainer.yaml`` gives
(``tests/fixtures/verl/reference/``, verl 1dda039b), and a value verl takes from another key (its
``${oc.select:...}``) follows that key here too. The only exceptions are :data:`DIFFERENT`, each with its reason
(docs/verl.md lists them for users), and :data:`NOT_IN_VERL`: spellings of verl's scripts that its current config
file no longer has.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from hybridrl.cli import main
from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.schema import RLConfig
from hybridrl.config.verl_keys import AOR, VERL_KEYS, VerlKey

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "tests" / "fixtures" / "verl" / "reference" / "ppo_megatron_trainer.yaml"
RECIPE = REPO / "recipes" / "recipe" / "ppo_megatron_trainer.yaml"
REQUIRED = [f"{AOR}.model.path=/models/m", f"{AOR}.rollout.name=vllm"]  # ??? in verl and here

# verl keys whose default deliberately differs here, and why
DIFFERENT = {
    f"{AOR}.model.path": "required here (???): verl's ~/models/deepseek-llm-7b-chat is a placeholder",
    "critic.model.path": "null: the actor's model.path (verl's is the same placeholder path)",
    "data.train_files": "hybridrl's data directory: $HYBRIDRL_DATA_DIR/gsm8k/*.parquet (verl: ~/data/rlhf/gsm8k/)",
    "data.val_files": "as data.train_files",
    "data.val_batch_size": "verl's null scores the whole validation set in one batch; here a number of prompts per "
                           "evaluation batch (the scores do not depend on it)",
    f"{AOR}.actor.ppo_micro_batch_size_per_gpu": "verl's null must be set unless use_dynamic_bsz (verl stops); here "
                                                 "a number, unused with use_dynamic_bsz",
    f"{AOR}.ref.log_prob_micro_batch_size_per_gpu": "as the actor's",
    f"{AOR}.rollout.log_prob_micro_batch_size_per_gpu": "as the actor's",
    **{f"{AOR}.actor.{k}": "the sapo loss's own default (verl's, 1.0 / 1.05); the other losses take no temperature, "
                           "so the flat policy_loss_kwargs hold none" for k in ("tau_pos", "tau_neg")},
    "critic.ppo_micro_batch_size_per_gpu": "as the actor's",
    f"{AOR}.model.enable_gradient_checkpointing": "verl's true is never read by its Megatron engine (recompute comes "
                                                  "from override_transformer_config only); here it is full "
                                                  "recompute, so false trains as verl's Megatron trainer does",
    f"{AOR}.actor.megatron.override_transformer_config": "verl lists Megatron's own defaults (recompute off, "
                                                          "attention_backend flash); here {}: the same defaults",
    "algorithm.filter_groups.metric": "verl's null must be named when filter_groups is on; here acc (DAPO's)",
    f"{AOR}.rollout.multi_turn.max_assistant_turns": "verl's null: no bound but the response length; here 4",
    f"{AOR}.nccl_timeout": "verl's 600 s; hybridrl's collectives also wait out a step's scoring (reward.timeout_s="
                           "600 must be below it) and generation: 3600",
    f"{AOR}.model.lora.alpha": "one hybridrl key for verl's two LoRA blocks: the legacy lora_alpha's 16 (lora.rank "
                               "on the command line brings the lora block's 32 along)",
    f"{AOR}.model.lora.target_modules": "all-linear: the same projections as verl's [linear_qkv, linear_proj, "
                                        "linear_fc1, linear_fc2]",
}
# keys of verl's scripts that its current config file does not hold (older spellings, or added with +)
NOT_IN_VERL = {
    "reward_model.overlong_buffer.enable", "reward_model.overlong_buffer.len",
    "reward_model.overlong_buffer.penalty_factor", f"{AOR}.rollout.update_weights_bucket_megabytes",
    *(f"{p}.overlong_buffer_cfg.{k}" for p in ("reward_model.reward_kwargs", "reward.reward_kwargs")
      for k in ("enable", "len", "penalty_factor")),
}
# a null here takes this key's value, as verl's ${oc.select:...} does
FOLLOWS = {
    **{f"{AOR}.{role}.log_prob_use_dynamic_bsz": f"{AOR}.actor.use_dynamic_bsz" for role in ("ref", "rollout")},
    **{f"{AOR}.{role}.log_prob_max_token_len_per_gpu": f"{AOR}.actor.ppo_max_token_len_per_gpu"
       for role in ("ref", "rollout")},
    **{f"{AOR}.ref.megatron.{k}": f"{AOR}.actor.megatron.{k}" for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel")},
    **{f"critic.megatron.{k}": f"{AOR}.actor.megatron.{k}" for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel")},
    **{f"{role}.megatron.use_remove_padding": f"{AOR}.actor.megatron.use_remove_padding"
       for role in (f"{AOR}.ref", "critic")},
}
INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?([\w.]+)(?:,.*)?\}$")


def mapped() -> list[VerlKey]:
    return [e for e in VERL_KEYS.values() if e.status in ("same", "alias")]


@pytest.fixture(scope="module")
def ours() -> RLConfig:
    return compose_config(["recipe=ppo_megatron_trainer", *REQUIRED])


@pytest.fixture(scope="module")
def verl() -> tuple[Any, dict[str, Any]]:
    ref = OmegaConf.load(REFERENCE)
    return ref, OmegaConf.to_container(ref, resolve=False)  # type: ignore[return-value]


def raw(tree: dict[str, Any], key: str) -> Any:
    """The value as the file writes it (an interpolation unresolved); KeyError when the file lacks the key."""
    return functools.reduce(lambda d, k: d[k], key.split("."), tree)


def value(cfg: RLConfig, key: str) -> Any:
    out: Any = cfg
    for part in key.split("."):
        out = out.get(part) if isinstance(out, dict) else getattr(out, part)  # free-form kwargs: None if unset
    return value(cfg, FOLLOWS[key]) if out is None and key in FOLLOWS else out


@pytest.mark.parametrize("entry", mapped(), ids=lambda e: e.key)
def test_each_mapped_key_has_verls_default(entry: VerlKey, ours: RLConfig, verl: tuple[Any, dict[str, Any]]) -> None:
    ref, tree = verl
    try:
        written = raw(tree, entry.key)
    except KeyError:
        assert entry.key in NOT_IN_VERL, f"{entry.key}: not in verl's config; list it in NOT_IN_VERL"
        return
    assert entry.key not in NOT_IN_VERL, f"{entry.key}: verl's config has it now"
    if entry.key in DIFFERENT:
        return
    if written == "???":  # required in verl: required here (the test gives it on the command line)
        assert raw(yaml.safe_load(RECIPE.read_text()), entry.key) in ("???", "${hybridrl_required:}"), entry.key
        return
    theirs = OmegaConf.select(ref, entry.key)
    if entry.values and str(theirs) in entry.values:
        theirs = yaml.safe_load(entry.values[str(theirs)])
    for target in ([entry.key] if entry.status == "same" else [str(entry.target), *entry.also]):
        assert value(ours, target) == theirs, f"{entry.key}: verl {theirs!r}, hybridrl {target}={value(ours, target)!r}"
        if isinstance(written, str) and (m := INTERPOLATION.match(written)):  # verl takes it from another key
            if m.group(1) == target:  # verl's key follows the very key it is here
                continue
            follows = FOLLOWS.get(target)
            here = raw(yaml.safe_load(RECIPE.read_text()), target) if follows is None else None
            found = follows or (INTERPOLATION.match(here).group(1) if isinstance(here, str) else None)
            assert found == m.group(1), f"{target} should follow {m.group(1)} as verl's does (it follows {found})"


def test_the_exceptions_are_mapped_keys_that_do_differ(ours: RLConfig, verl: tuple[Any, dict[str, Any]]) -> None:
    """Every deliberate difference is a mapped key whose value does differ (a stale entry would hide a regression)."""
    ref, _ = verl
    keys = {e.key: e for e in mapped()}
    for key in DIFFERENT:
        assert key in keys, key
        e = keys[key]
        target = key if e.status == "same" else str(e.target)
        assert value(ours, target) != OmegaConf.select(ref, key), f"{key}: equal to verl's now; drop it from DIFFERENT"


def test_model_path_and_rollout_name_are_required_as_in_verl() -> None:
    with pytest.raises(ConfigError) as e:
        compose_config(["recipe=ppo_megatron_trainer"])
    assert {i.key for i in e.value.issues} == {f"{AOR}.model.path", f"{AOR}.rollout.name"}
    assert all("is required" in i.message for i in e.value.issues)


def test_the_deliberate_differences_are_listed_for_users() -> None:
    page = (REPO / "docs" / "verl.md").read_text()
    section = page.split("## Defaults that differ", 1)[1].split("\n## ", 1)[0]
    for key in DIFFERENT:
        assert f"`{key}`" in section, f"docs/verl.md's 'Defaults that differ' does not name {key}"


def test_validate_get_answers_for_verls_keys(capsys: pytest.CaptureFixture[str]) -> None:
    """``hybridrl validate --get`` takes verl's key names: the value of the hybridrl key each is, in verl's spelling."""
    args = ["validate", "recipe=ppo_megatron_trainer", "--model-config",
            str(REPO / "recipes" / "model_configs" / "qwen3-8b.json"), *REQUIRED,
            f"{AOR}.actor.megatron.tensor_model_parallel_size=4",
            f"{AOR}.actor.megatron.pipeline_model_parallel_size=2",
            f"{AOR}.actor.clip_ratio_low=0.25", "trainer.resume_mode=disable"]
    verl_keys = [f"{AOR}.actor.clip_ratio_low", f"{AOR}.actor.policy_loss.loss_mode", "trainer.resume_mode",
                 "algorithm.gamma", f"{AOR}.hybrid_engine", f"{AOR}.rollout.checkpoint_engine.update_weights_bucket_"
                 "megabytes", "trainer.max_actor_ckpt_to_keep", f"{AOR}.actor.clip_ratio_c"]
    assert main([*args, *(x for k in verl_keys for x in ("--get", k))]) == 0
    assert capsys.readouterr().out.split() == ["0.25", "vanilla", "disable", "1.0", "true", "2048", "null", "3.0"]
    ours = ["algorithm.policy_loss_kwargs.clip_ratio_low", "algorithm.policy_loss", "trainer.resume",
            "algorithm.adv_estimator_kwargs.gae.gamma"]
    assert main([*args, *(x for k in ours for x in ("--get", k))]) == 0
    assert capsys.readouterr().out.split() == ["0.25", "dual_clip", "never", "1.0"]
    assert main([*args, "--get", "ray_kwargs.ray_init.num_cpus"]) == 2  # accepted, no value here: it says why
    assert "ray_kwargs.ray_init.num_cpus has no effect in hybridrl" in capsys.readouterr().err
    assert main([*args, "algorithm.adv_estimator=grpo", f"{AOR}.rollout.n=4", "--get", "algorithm.lam"]) == 2
    assert "has no effect: algorithm.adv_estimator='grpo'" in capsys.readouterr().err


def test_the_ten_line_migrations_plan_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/verl.md's ``hybridrl validate`` of run_qwen3_8b_megatron.sh's overrides passes, and says what the page
    says it does."""
    page = (REPO / "docs" / "verl.md").read_text().split("## Ten-line migration", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", page, flags=re.S)
    args = shlex.split(os.path.expandvars(block.replace("\\\n", " ")))
    assert args[:2] == ["hybridrl", "validate"]
    assert main(args[1:]) == 0
    out = capsys.readouterr().out
    assert "actor   TP=2 PP=2 CP=1 DP=2" in out and "rollout 4 engine(s) × TP=2" in out and out.endswith("config OK\n")
    assert "its model state 36.9 GB fits" in out and "may need ~81.9 GB" in out  # the page's numbers
