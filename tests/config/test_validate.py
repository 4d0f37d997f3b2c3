"""Static validation: each rule names its key; all violations come in one error, before any model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridrl.cli import main
from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate
from hybridrl.models.tiny import make_tiny_model

AOR = "actor_rollout_ref"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Overrides of a valid 1-rank run on a tiny model (4 heads, 2 KV heads, 4 layers, 512 positions)."""
    tmp = tmp_path_factory.mktemp("validate")
    model = make_tiny_model(tmp / "model", hidden=32, layers=4, heads=4, kv_heads=2, max_positions=512)
    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    return [f"{AOR}.model.path={model}", f"data.train_files=[{data}]", f"{AOR}.rollout.n=4",
            "data.train_batch_size=8", f"{AOR}.actor.ppo_mini_batch_size=4",
            f"{AOR}.actor.ppo_micro_batch_size_per_gpu=4", "data.max_prompt_length=32",
            "data.max_response_length=16", "trainer.total_training_steps=100"]  # one row: no whole epoch


def issues(base: list[str], *overrides: str, world: int | None = None) -> list[str]:
    try:
        validate(compose_config([*base, *overrides]), world_size=world)
    except ConfigError as e:
        return [str(i) for i in e.issues]
    return []


def only(base: list[str], *overrides: str, world: int | None = None) -> str:
    found = issues(base, *overrides, world=world)
    assert len(found) == 1, found
    return found[0]


def test_valid_config_gives_its_plan(base: list[str]) -> None:
    plan = validate(compose_config([*base, f"{AOR}.actor.megatron.tensor_model_parallel_size=2"]), world_size=4)
    assert (plan.roles["actor"].tp, plan.roles["actor"].dp) == (2, 2)
    assert "ref" not in plan.roles  # no KL term: no reference model
    b = plan.batch
    assert (b.samples_per_step, b.mini_batches_per_epoch, b.samples_per_mini_batch) == (32, 2, 16)
    assert b.micro_batches_per_optimizer_step == 2  # 16 samples / (4 per micro × DP 2)
    assert (b.optimizer_steps_per_rl_step, b.total_optimizer_steps) == (2, 200)  # 100 steps (schema default)
    assert [b.dp_prompts(d) for d in (0, 1)] == [range(0, 4), range(4, 8)]
    text = plan.render()
    assert "rank 3: cpu actor(tp1 pp0 cp0 dp1) rollout(engine 3, leader)" in text
    assert "rollout 4 engine(s) × TP=1" in text and "engine 3: ranks [3] devices [cpu]" in text


def test_parallel_sizes_must_divide_world(base: list[str]) -> None:
    msg = only(base, f"{AOR}.actor.megatron.tensor_model_parallel_size=2",
               f"{AOR}.actor.megatron.pipeline_model_parallel_size=2", world=6)
    assert msg.startswith(f"{AOR}.actor.megatron.tensor_model_parallel_size=2")
    assert "must divide the world size 6" in msg


def test_tp_must_divide_kv_heads(base: list[str]) -> None:
    msg = only(base, f"{AOR}.actor.megatron.tensor_model_parallel_size=4", world=4)
    assert msg.startswith(f"{AOR}.actor.megatron.tensor_model_parallel_size=4")
    assert "2 KV heads" in msg and "valid: [1, 2]" in msg


def test_tp_must_divide_heads(base: list[str]) -> None:
    found = issues(base, f"{AOR}.actor.megatron.tensor_model_parallel_size=8", world=8)
    assert any("4 attention heads" in m for m in found) and any("KV heads" in m for m in found)


def test_pp_must_divide_layers(base: list[str]) -> None:
    msg = only(base, f"{AOR}.actor.megatron.pipeline_model_parallel_size=3", "data.train_batch_size=8", world=3)
    assert msg.startswith(f"{AOR}.actor.megatron.pipeline_model_parallel_size=3") and "4 layers" in msg


VPP = f"{AOR}.actor.megatron.virtual_pipeline_model_parallel_size"
PP2 = f"{AOR}.actor.megatron.pipeline_model_parallel_size=2"


def test_virtual_pipeline_follows_megatrons_rules(base: list[str]) -> None:
    msg = only(base, f"{VPP}=2")  # parallel_state: the interleaved schedule needs PP > 1
    assert msg.startswith(f"{VPP}=2") and "needs pipeline_model_parallel_size ≥ 2 (it is 1)" in msg
    msg = only(base, PP2, f"{VPP}=4", world=2)  # 4 layers in 2 stages × 4 chunks
    assert msg.startswith(f"{VPP}=4") and "PP×VPP = 2×4 = 8 must divide the model's 4 layers" in msg
    assert "valid at PP=2: null or [2]" in msg
    assert only(base, PP2, f"{VPP}=1", world=2).startswith(f"{VPP}=1: must be null")
    assert issues(base, PP2, f"{VPP}=2", world=2) == []


def test_interleaved_schedule_needs_a_multiple_of_pp_micro_batches(base: list[str]) -> None:
    # a mini-batch of 4 prompts × 4 samples in micro-batches of 16: 1 micro-batch per step, PP=2
    msg = only(base, PP2, f"{VPP}=2", f"{AOR}.actor.ppo_micro_batch_size_per_gpu=16", world=2)
    assert msg.startswith(f"{AOR}.actor.ppo_micro_batch_size_per_gpu=16")
    assert "multiple of PP=2 micro-batches per optimizer step" in msg and "make 1" in msg
    assert "valid: [1, 2, 4, 8]" in msg
    assert issues(base, PP2, f"{AOR}.actor.ppo_micro_batch_size_per_gpu=16", world=2) == []  # plain 1F1B: any


def test_ref_follows_the_actors_layout_unless_set_otherwise(base: list[str]) -> None:
    plan = validate(compose_config([*base, PP2, f"{VPP}=2", f"{AOR}.actor.use_kl_loss=true"]), world_size=2)
    assert plan.roles["ref"] == plan.roles["actor"]  # null sizes follow the actor (the README's example)
    assert issues(base, PP2, f"{VPP}=2", f"{AOR}.ref.megatron.pipeline_model_parallel_size=2",
                  f"{AOR}.actor.use_kl_loss=true", world=2) == []  # an equal explicit value is fine
    msg = only(base, PP2, f"{VPP}=2", f"{AOR}.ref.megatron.virtual_pipeline_model_parallel_size=4",
               f"{AOR}.actor.use_kl_loss=true", world=2)
    assert msg.startswith(f"{AOR}.ref.megatron.virtual_pipeline_model_parallel_size=4: must equal {VPP}=2")


def test_ref_layout_checked_only_when_ref_is_built(base: list[str]) -> None:
    bad_ref = f"{AOR}.ref.megatron.tensor_model_parallel_size=3"
    assert issues(base, bad_ref) == []
    found = issues(base, bad_ref, f"{AOR}.actor.use_kl_loss=true")
    assert found and all(m.startswith(f"{AOR}.ref.megatron.tensor_model_parallel_size=3") for m in found)
    assert any(f"must equal {AOR}.actor.megatron.tensor_model_parallel_size=1" in m for m in found)


def test_rollout_tp(base: list[str]) -> None:
    found = issues(base, f"{AOR}.rollout.tensor_model_parallel_size=3", world=4)
    assert all(m.startswith(f"{AOR}.rollout.tensor_model_parallel_size=3") for m in found), found
    assert any("world size 4" in m for m in found) and any("4 attention heads" in m for m in found)
    assert any("one engine per rank" in m for m in found)  # the hf engine has no TP


def test_an_engine_says_what_it_cannot_do_on_this_device(base: list[str], tmp_path: Path) -> None:
    """The engine's own ``plan_notes``: vllm on CPU runs its memory phases as no-ops (said once, with the plan), and
    refuses what the CPU cannot run; its ``model_problem`` refuses a checkpoint it cannot serve there, at
    ``rollout.name`` — all before anything is built (vLLM itself is not imported)."""
    found = issues(base, f"{AOR}.rollout.name=vllm", world=2)  # the base model's head_dim is 8
    assert found == [f"{AOR}.rollout.name='vllm': head_dim=8: vLLM's CPU attention supports head_dim 32, 64, 80, 96, "
                     "112, 128, 160, 192, 224, 256, 512 (it would start, then fail at the first generate); use another "
                     "engine (hf, sglang) for this model on CPU"], found
    wide = make_tiny_model(tmp_path / "head32", hidden=64, layers=2, heads=2, kv_heads=1, max_positions=512)
    served = [*base, f"{AOR}.model.path={wide}"]
    plan = validate(compose_config([*served, f"{AOR}.rollout.name=vllm"]), world_size=2)
    notes = [line for line in plan.render().splitlines() if line.startswith("note: rollout engine vllm")]
    assert len(notes) == 1 and "release/resume around the train phase are no-ops" in notes[0], notes
    assert "note:" not in validate(compose_config(base), world_size=2).render()  # hf says nothing
    found = issues(served, f"{AOR}.rollout.name=vllm", f"{AOR}.rollout.tensor_model_parallel_size=2", world=2)
    assert any(m.startswith(f"{AOR}.rollout.engine_kwargs") and "tensor_model_parallel_size=2 with vllm needs GPUs"
               in m for m in found), found
    found = issues(base, f"{AOR}.rollout.name=vllm", f"+{AOR}.rollout.engine_kwargs.enable_sleep_mode=true")
    assert any("enable_sleep_mode=true needs a GPU" in m for m in found), found


def test_mini_batch_must_divide_train_batch(base: list[str]) -> None:
    msg = only(base, f"{AOR}.actor.ppo_mini_batch_size=3", f"{AOR}.actor.ppo_micro_batch_size_per_gpu=2")
    assert msg.startswith(f"{AOR}.actor.ppo_mini_batch_size=3") and "data.train_batch_size=8" in msg


def test_micro_batch_times_dp_must_divide_mini_batch(base: list[str]) -> None:
    msg = only(base, f"{AOR}.actor.ppo_micro_batch_size_per_gpu=3")
    assert msg.startswith(f"{AOR}.actor.ppo_micro_batch_size_per_gpu=3") and "16 samples" in msg
    msg = only(base, f"{AOR}.actor.ppo_micro_batch_size_per_gpu=8", world=4)  # 16 samples, 8 × DP 4
    assert "DP=4" in msg and "valid: [1, 2, 4]" in msg


def test_prompts_need_not_divide_over_dp_but_each_mini_batch_s_samples_must(base: list[str]) -> None:
    """As verl: 6 prompts on DP=4 generate in shares of 1-2; the update splits samples (a mini-batch of 3 prompts ×
    4 = 12 samples: 3 per rank), which must fill whole micro-batches on every rank."""
    ok = ["data.train_batch_size=6", f"{AOR}.actor.ppo_mini_batch_size=3",
          f"{AOR}.actor.ppo_micro_batch_size_per_gpu=3"]
    assert issues(base, *ok, world=4) == []
    assert "1-2 prompts per DP rank" in validate(compose_config([*base, *ok]), world_size=4).render()
    msg = only(base, *ok[:2], f"{AOR}.actor.ppo_micro_batch_size_per_gpu=2", world=4)
    assert msg.startswith(f"{AOR}.actor.ppo_micro_batch_size_per_gpu=2") and "DP=4" in msg, msg


def test_group_estimator_needs_n_at_least_2(base: list[str]) -> None:
    msg = only(base, f"{AOR}.rollout.n=1", f"{AOR}.actor.ppo_micro_batch_size_per_gpu=2")
    assert msg.startswith(f"{AOR}.rollout.n=1") and "'grpo'" in msg


def test_gae_builds_a_critic_on_the_actor_layout(base: list[str]) -> None:
    plan = validate(compose_config([*base, "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8",
                                    "critic.ppo_micro_batch_size_per_gpu=2",
                                    f"{AOR}.actor.megatron.tensor_model_parallel_size=2"]), world_size=4)
    assert plan.roles["critic"] == plan.roles["actor"]  # critic.enable=null: on, because gae needs values
    c = plan.batch.critic
    assert c is not None and (c.mini_batches_per_epoch, c.mini_batch_samples_per_dp_rank) == (1, 16)
    assert c.total_optimizer_steps == 100 and "critic  values and 1 mini-batch(es) of 16 samples" in plan.render()
    assert "critic" not in validate(compose_config(base), world_size=1).roles  # grpo: no critic


def test_critic_rules_name_their_keys(base: list[str]) -> None:
    msg = only(base, "algorithm.adv_estimator=gae", "critic.enable=false")
    assert msg.startswith("critic.enable=False") and "gae" in msg
    assert only(base, "critic.enable=true").startswith("critic.enable=True")  # grpo would not read its values
    gae = ("algorithm.adv_estimator=gae",)
    assert only(base, *gae, "critic.megatron.tensor_model_parallel_size=2").startswith(
        "critic.megatron.tensor_model_parallel_size=2")
    assert only(base, *gae, "critic.ppo_micro_batch_size_per_gpu=3").startswith("critic.ppo_micro_batch_size_per_gpu")
    assert only(base, *gae, "critic.ppo_mini_batch_size=3").startswith("critic.ppo_mini_batch_size=3")
    assert only(base, *gae, "critic.cliprange_value=0").startswith("critic.cliprange_value=0")
    assert only(base, *gae, "critic.optim.optimizer=lion").startswith("critic.optim.optimizer")
    assert only(base, *gae, "critic.model.path=/nonexistent").startswith("critic.model.path")


def test_kl_needs_ref(base: list[str]) -> None:
    msg = only(base, f"{AOR}.actor.use_kl_loss=true", f"{AOR}.ref.enable=false")
    assert msg.startswith(f"{AOR}.actor.use_kl_loss=True") and f"{AOR}.ref.enable=false" in msg
    msg = only(base, "algorithm.use_kl_in_reward=true", f"{AOR}.ref.enable=false")
    assert msg.startswith("algorithm.use_kl_in_reward=True")


def test_lengths_fit_max_positions(base: list[str]) -> None:
    msg = only(base, "data.max_prompt_length=400", "data.max_response_length=200")
    assert msg.startswith("data.max_response_length=200") and "512" in msg and "at most 112" in msg


@pytest.mark.parametrize(("key", "value", "expect"), [
    ("reward.name", "nope", "installed: "),
    ("algorithm.adv_estimator", "grpoo", "grpo"),
    ("algorithm.policy_loss", "ppo", "ppo_clip"),
    (f"{AOR}.rollout.name", "vllmm", "vllm"),  # a near miss names the installed engine
])
def test_plugin_names(base: list[str], key: str, value: str, expect: str) -> None:
    msg = only(base, f"{key}={value}")
    assert msg.startswith(f"{key}='{value}'") and expect in msg


def test_plugin_config_keys(base: list[str]) -> None:
    msg = only(base, "+algorithm.policy_loss_kwargs.clip_ratio_hihg=0.3")
    assert msg.startswith("algorithm.policy_loss_kwargs=")
    assert "unknown key algorithm.policy_loss_kwargs.clip_ratio_hihg" in msg and "clip_ratio_high" in msg


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_model_dir_contents(base: list[str], tmp_path: Path, missing: str) -> None:
    model = Path(next(o for o in base if o.startswith(f"{AOR}.model.path=")).split("=", 1)[1])
    copy = tmp_path / "m"
    copy.mkdir()
    for f in model.iterdir():
        if f.name != missing and not (missing == "tokenizer.json" and f.name.startswith(("tokenizer", "vocab"))):
            (copy / f.name).write_bytes(f.read_bytes())
    found = issues(base, f"{AOR}.model.path={copy}")
    assert any(m.startswith(f"{AOR}.model.path=") and missing.split(".")[0] in m for m in found), found


def test_missing_model_dir(base: list[str]) -> None:
    msg = only(base, f"{AOR}.model.path=/does/not/exist")
    assert msg.startswith(f"{AOR}.model.path='/does/not/exist'") and "does not exist" in msg


def test_unknown_key_suggests_the_valid_one(base: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        compose_config([*base, f"{AOR}.actor.megatron.context_model_parallel_size=2"])
    assert f"did you mean {AOR}.actor.megatron.context_parallel_size" in str(e.value)
    assert "+" not in str(e.value)  # a typed node takes no new keys
    with pytest.raises(ConfigError, match=r"use \+reward.kwargs.bogus=1"):  # a plugin block does
        compose_config([*base, "reward.kwargs.bogus=1"])


def test_bad_type_names_key(base: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.seed='abc'"):
        compose_config([*base, "trainer.seed=abc"])


@pytest.mark.slow
def test_three_mistakes_one_error_before_any_model(base: list[str]) -> None:
    """Run in a fresh interpreter to prove nothing heavy (Megatron, transformers models) is imported."""
    overrides = [*base, f"{AOR}.actor.megatron.tensor_model_parallel_size=3", f"{AOR}.rollout.n=1",
                 "data.max_response_length=1000", f"{AOR}.actor.ppo_micro_batch_size_per_gpu=1"]
    code = textwrap.dedent(f"""
        import sys
        from hybridrl.config.compose import compose_config
        from hybridrl.config.errors import ConfigError
        from hybridrl.config.validate import validate
        try:
            validate(compose_config({overrides!r}), world_size=4)
        except ConfigError as e:
            print("\\n".join(i.key for i in e.issues))
        heavy = [m for m in ("megatron", "megatron.core", "transformers.models.qwen2.modeling_qwen2")
                 if m in sys.modules]
        print("HEAVY", heavy)
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    *keys, heavy = r.stdout.splitlines()
    # TP=3 breaks three rules (world size, heads, KV heads): each is reported, under the same key
    assert keys.count(f"{AOR}.actor.megatron.tensor_model_parallel_size") == 3
    assert sorted(set(keys)) == sorted([f"{AOR}.actor.megatron.tensor_model_parallel_size",
                                        f"{AOR}.rollout.n", "data.max_response_length"])
    assert heavy == "HEAVY []"


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``hybridrl validate ARGS`` in this process: (exit code, stdout, stderr). (A subprocess per call cost ~5 s.)"""
    capsys.readouterr()
    code = main(["validate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_validate_cli_prints_topology(base: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, *base, f"{AOR}.actor.megatron.pipeline_model_parallel_size=2", "--world-size", "2")
    assert code == 0, err
    assert "actor   TP=1 PP=2 CP=1 DP=1" in out and "rank 1: cpu actor(tp0 pp1 cp0 dp0)" in out
    assert out.strip().endswith("config OK")
    code, out, err = cli(capsys, *base, f"{AOR}.actor.megatron.pipeline_model_parallel_size=2", f"{VPP}=2",
                         "--world-size", "2")
    assert code == 0, err
    assert "actor   TP=1 PP=2 VPP=2 CP=1 DP=1" in out  # layer blocks interleave over the stages
    assert "rank 0: cpu actor(tp0 pp0 cp0 dp0 layers 0 + 2)" in out
    assert "rank 1: cpu actor(tp0 pp1 cp0 dp0 layers 1 + 3)" in out
    code, out, err = cli(capsys, *base, f"{AOR}.rollout.n=1", f"{AOR}.actor.ppo_micro_batch_size_per_gpu=2")
    assert code == 2 and f"{AOR}.rollout.n=1" in err


@pytest.mark.parametrize(("recipe", "world", "layout"), [
    ("grpo_qwen7b", 8, "actor   TP=4 PP=1 CP=1 DP=2"),
    ("grpo_qwen7b_2nodes", 16, "actor   TP=4 PP=2 CP=1 DP=2"),
])
def test_scale_recipes_plan_on_a_cpu_machine(recipe: str, world: int, layout: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The 7B recipes' topology arithmetic is checked here, with the real architecture, no weights."""
    qwen7b = str(Path(__file__).resolve().parents[2] / "recipes" / "model_configs" / "qwen2.5-7b.json")
    code, out, err = cli(capsys, f"recipe={recipe}", "--model-config", qwen7b)
    assert code == 0, err
    assert f"world_size: {world}" in out and layout in out
    assert "heads 28 (kv 4)" in out and out.strip().endswith("config OK")
    code, _, err = cli(capsys, f"recipe={recipe}", "--model-config", qwen7b,
                       f"{AOR}.actor.megatron.tensor_model_parallel_size=8")
    assert code == 2 and "must divide the model's 4 KV heads" in err


def test_the_moe_scale_recipe_plans_its_experts_and_fits_80_gb(capsys: pytest.CaptureFixture[str]) -> None:
    """grpo_qwen3_30b_a3b with Qwen3-30B-A3B's published config.json: TP=2 × EP=8 on 16 GPUs, 16 experts a rank,
    a per-rank estimate within 80 GB in both phases; EP=16 cannot split the 8 ranks of each TP replica."""
    a3b = str(Path(__file__).resolve().parents[2] / "recipes" / "model_configs" / "qwen3-30b-a3b.json")
    code, out, err = cli(capsys, "recipe=grpo_qwen3_30b_a3b", "--model-config", a3b)
    assert code == 0, err
    assert "actor   TP=2 PP=1 CP=1 DP=8 EP=8" in out and "EP=8: 16 experts per rank" in out
    memory = re.search(r"→ generate ([\d.]+) GB, train ([\d.]+) GB", out)
    assert memory and max(float(memory[1]), float(memory[2])) < 80, out
    code, _, err = cli(capsys, "recipe=grpo_qwen3_30b_a3b", "--model-config", a3b,
                       f"{AOR}.actor.megatron.expert_model_parallel_size=16")
    assert code == 2 and "expert_model_parallel_size" in err and "valid: [1, 2, 4, 8]" in err


def test_the_glm45_recipe_plans_355b_on_64_h200_and_not_on_80_gb(capsys: pytest.CaptureFixture[str]) -> None:
    """grpo_glm45 with GLM-4.5's architecture (recipes/model_configs/glm-4.5.json: 92 layers, 3 dense, 160 experts
    top-8 + a shared one): TP=8 × PP=4 × DP=2, EP=16 at expert TP 1 on 8 × 8 H200, within 141 GB in both phases;
    on 80 GB GPUs a node's TP=8 engine alone (355B bf16 / 8 = 88 GB a GPU) cannot fit, and the plan says what would."""
    glm = str(Path(__file__).resolve().parents[2] / "recipes" / "model_configs" / "glm-4.5.json")
    code, out, err = cli(capsys, "recipe=grpo_glm45", "--model-config", glm)
    assert code == 0, err
    assert "actor   TP=8 PP=4 CP=1 DP=2 EP=16 ETP=1" in out and "EP=16: 10 experts per rank" in out
    assert "89 of 92 layers" in out and "a shared expert of 1536" in out
    memory = re.search(r"→ generate ([\d.]+) GB, train ([\d.]+) GB", out)
    assert memory and max(float(memory[1]), float(memory[2])) < 141, out
    code, _, err = cli(capsys, "recipe=grpo_glm45", "--model-config", glm, "trainer.device_memory_gb=80")
    assert code == 2 and "engine weights 88.2" in err and "rollout.tensor_model_parallel_size" in err, err


def test_uneven_pipeline_stages_are_planned_and_bad_ones_name_their_key(base: list[str],
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``override_transformer_config.num_layers_in_first/last_pipeline_stage`` (Megatron's uneven split, verl's keys):
    the plan says which layers each stage holds; a split Megatron would refuse is refused here, naming the key and the
    valid values (hybridrl.megatron.stages), before any model is built."""
    pp, o = f"{AOR}.actor.megatron.pipeline_model_parallel_size", f"{AOR}.actor.megatron.override_transformer_config"
    code, out, err = cli(capsys, *base, f"{pp}=2", f"+{o}.num_layers_in_first_pipeline_stage=1", "--world-size", "2")
    assert code == 0, err
    assert "stages  1 + 3 layers over PP=2" in out and "rank 1: cpu actor(tp0 pp1 cp0 dp0 layers 1-3)" in out
    assert only(base, f"{pp}=2", f"+{o}.num_layers_in_last_pipeline_stage=4", world=2) == (
        f"{o}.num_layers_in_last_pipeline_stage=4: leaves 0 of the model's 4 layers for the 1 stage(s) between the "
        "ends at PP=2, which must hold equal, nonzero shares; valid: [1, 2, 3]")
    assert only(base, f"+{o}.num_layers_in_first_pipeline_stage=2").startswith(
        f"{o}.num_layers_in_first_pipeline_stage=2: needs pipeline_model_parallel_size ≥ 2")
    assert "must be an integer ≥ 1" in only(base, f"{pp}=2", f"+{o}.num_layers_in_first_pipeline_stage=x", world=2)
    assert "uneven end stages" in only(base, f"{pp}=3", world=3)  # 4 layers: the hint names the keys


def test_a_checkpoint_in_fp8_trains_but_its_engine_on_gpus_is_refused(base: list[str], tmp_path: Path) -> None:
    """DeepSeek-V3 ships FP8 weights (config.json quantization_config, hybridrl.hf.fp8): the Megatron model loads them
    dequantised (tests/megatron/test_fp8_checkpoint.py), so the run validates; on GPUs the engine would serve FP8 and
    the bf16 weight sync could not update it, so the rollout engine is refused there. Another quantization_config is
    refused."""
    from dataclasses import replace

    from hybridrl.config.check_rollout import FP8_SYNC_PROBLEM, check_plugins
    from hybridrl.config.errors import Issues

    model = Path(base[0].split("=", 1)[1])
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    for f in model.iterdir():
        (fp8 / f.name).write_bytes(f.read_bytes())
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(config))
    cfg = compose_config([*base, f"{AOR}.model.path={fp8}"])
    plan = validate(cfg, world_size=1)
    assert plan.model is not None and plan.model.fp8_blocks == (128, 128)
    found = Issues()
    check_plugins(cfg, replace(plan, device_type="cuda"), found)
    assert [(i.key, i.message) for i in found] == [(f"{AOR}.rollout.name", FP8_SYNC_PROBLEM)]
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (fp8 / "config.json").write_text(json.dumps(config))
    assert "quantization_config={'quant_method': 'awq', 'bits': 4} is not supported" in only(
        base, f"{AOR}.model.path={fp8}")


def test_the_deepseek_v3_recipe_plans_671b_on_128_h200_over_uneven_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """grpo_deepseek_v3 with DeepSeek-V3's config.json (recipes/model_configs/deepseek-v3.json: 61 layers, 3 dense,
    256 experts top-8 + a shared one, MLA, FP8 weights): TP=8 × PP=4 × DP=4, EP=32 at expert TP 1 on 16 × 8 H200, the
    layers 16 + 15 + 15 + 15 over the stages, within 141 GB in both phases with the engines serving FP8 (84 GB a GPU);
    the plan prints that the run cannot start yet (the bf16 weight sync into FP8 engines). PP=4 without the uneven
    split, an end that leaves unequal middle stages, and 80 GB GPUs are refused, each naming its key."""
    v3 = str(Path(__file__).resolve().parents[2] / "recipes" / "model_configs" / "deepseek-v3.json")
    code, out, err = cli(capsys, "recipe=grpo_deepseek_v3", "--model-config", v3)
    assert code == 0, err
    assert "actor   TP=8 PP=4 CP=1 DP=4 EP=32 ETP=1" in out and "EP=32: 8 experts per rank" in out
    assert "stages  16 + 15 + 15 + 15 layers over PP=4" in out and "58 of 61 layers" in out
    assert "rank 0: cuda:0 actor(tp0 pp0 cp0 dp0 layers 0-15)" in out
    assert "rank 127: cuda:7 actor(tp7 pp3 cp0 dp3 layers 46-60)" in out
    memory = re.search(r"engine weights ([\d.]+), .* → generate ([\d.]+) GB, train ([\d.]+) GB", out)
    assert memory and float(memory[1]) < 85 and max(float(memory[2]), float(memory[3])) < 141, out
    assert "FP8" in out and "bf16 would be 167.8 GB" in out and "NOT RUNNABLE YET" in out
    o = f"{AOR}.actor.megatron.override_transformer_config"
    code, _, err = cli(capsys, "recipe=grpo_deepseek_v3", "--model-config", v3,
                       f"{o}.num_layers_in_first_pipeline_stage=null", f"{o}.num_layers_in_last_pipeline_stage=null")
    assert code == 2 and "pipeline_model_parallel_size=4: must divide the model's 61 layers" in err, err
    code, _, err = cli(capsys, "recipe=grpo_deepseek_v3", "--model-config", v3,
                       f"{o}.num_layers_in_first_pipeline_stage=15", "trainer.device_memory_gb=80")
    assert code == 2 and f"{o}.num_layers_in_first_pipeline_stage=15: leaves 31 of the model's 61 layers" in err
    assert "trainer.device_memory_gb=80.0: the largest rank's model state" in err, err


def test_kimi_k2_reads_as_deepseek_v3_and_its_recipe_plans_on_256_h200(capsys: pytest.CaptureFixture[str]) -> None:
    """Kimi K2's config.json (recipes/model_configs/kimi-k2.json) says model_type kimi_k2 for DeepSeek-V3's
    architecture: read as deepseek_v3 (384 experts top-8 in one group, × 2.827, only layer 0 dense, 64 MLA heads, YaRN
    ×32, FP8 in 128×128 blocks), the same model as that config under deepseek_v3. grpo_kimi_k2 plans it on 32 × 8 H200
    within 141 GB (the FP8 engine at TP=8 is 128.6 GB a GPU); on grpo_deepseek_v3's 16 nodes it does not fit."""
    from hybridrl.hf.arch import HFArch

    k2 = Path(__file__).resolve().parents[2] / "recipes" / "model_configs" / "kimi-k2.json"
    config = json.loads(k2.read_text())
    arch = HFArch.from_hf(k2)
    assert arch.family == "deepseek_v3" and arch.moe is not None and arch.mla is not None
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.scaling_factor, arch.num_attention_heads) == (
        384, 8, 2.827, 64)
    assert arch.moe.sparse_layers == (False,) + (True,) * 60 and arch.fp8_blocks == (128, 128)
    assert arch.mla.yarn is not None and arch.mla.yarn[:2] == (32.0, 4096) and arch.rope_theta == 50000.0
    assert HFArch.from_hf({**config, "model_type": "deepseek_v3"}) == arch
    code, out, err = cli(capsys, "recipe=grpo_kimi_k2", "--model-config", str(k2))
    assert code == 0, err
    assert "actor   TP=8 PP=4 CP=1 DP=8 EP=64 ETP=1" in out and "EP=64: 6 experts per rank" in out
    memory = re.search(r"engine weights ([\d.]+), .* → generate ([\d.]+) GB, train ([\d.]+) GB", out)
    assert memory and float(memory[1]) == 128.6 and max(float(memory[2]), float(memory[3])) < 141, out
    assert "NOT RUNNABLE YET" in out
    code, _, err = cli(capsys, "recipe=grpo_deepseek_v3", "--model-config", str(k2))
    assert code == 2 and "holds no sequence" in err, err


def test_every_wait_is_below_the_collectives_timeout(base: list[str]) -> None:
    """A rank waits in a collective while its engine generates or its reward scores: those limits must fire
    first, with their own clear errors, not the process group's."""
    found = issues(base, "trainer.dist_timeout_s=100", f"{AOR}.rollout.name=sglang")
    assert sorted(m.split("=")[0] for m in found) == [f"{AOR}.rollout.engine_kwargs.request_timeout_s",
                                                     f"{AOR}.rollout.engine_kwargs.start_timeout_s",
                                                     "reward.timeout_s"], found
    assert all("must be below trainer.dist_timeout_s=100.0" in m for m in found)
    assert issues(base, "trainer.dist_timeout_s=100", "reward.timeout_s=30") == []
    assert only(base, "reward.timeout_s=null").startswith("reward.timeout_s: must be below")  # no limit: too long


def test_the_preemption_grace_is_positive_and_below_torchruns_shutdown_timeout(base: list[str],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun SIGKILLs its ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT s after forwarding a SIGTERM: a longer grace would
    never be reached. Outside torchrun (no TORCHELASTIC_RUN_ID) only the sign is checked."""
    assert only(base, "trainer.preempt_grace_s=0") == "trainer.preempt_grace_s=0.0: must be > 0 (seconds from a " \
                                                       "SIGTERM to the exit)"
    assert issues(base, "trainer.preempt_grace_s=45") == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert only(base, "trainer.preempt_grace_s=45").startswith(
        "trainer.preempt_grace_s=45.0: must be below torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "60")
    assert issues(base, "trainer.preempt_grace_s=45") == []


# ---- actor_rollout_ref.rollout.multi_turn ----
MT = f"{AOR}.rollout.multi_turn"


def test_multi_turn_settings_name_their_keys_and_the_installed_plugins(base: list[str]) -> None:
    found = issues(base, f"{MT}.enable=true", f"{MT}.tools=[calculator,calculatr,calculator]",
                   f"+{MT}.tool_kwargs.calculator.max_digit=3", f"+{MT}.tool_kwargs.pyton.timeout=1",
                   f"{MT}.environment=arith", f"{MT}.format=xml", f"{MT}.tool_timeout_s=0",
                   f"{MT}.max_assistant_turns=0", f"{MT}.max_tool_response_length=0", f"{MT}.environment_timeout_s=-1",
                   "data.apply_chat_template=false")
    text = "\n".join(found)
    assert f"{MT}.environment_timeout_s=-1" in text and "must be > 0 (seconds)" in text
    assert f"{MT}.max_assistant_turns=0: must be ≥ 1" in text and f"{MT}.tool_timeout_s=0" in text
    assert f"{MT}.max_tool_response_length=0" in text and f"{MT}.format='xml'" in text and "valid: hermes" in text
    assert f"{MT}.tool_kwargs=['pyton']: names tools that are not in" in text  # an installed tool's: dropped
    assert "'calculatr'" in text and "installed: calculator" in text  # an unknown tool lists the installed ones
    assert f"unknown key {MT}.tool_kwargs.calculator.max_digit" in text and "max_digits" in text
    assert "'calculator' is listed twice" in text
    assert f"{MT}.environment='arith'" in text and "arithmetic_feedback" in text
    assert "data.apply_chat_template=False" in text and "renders every turn with the tokenizer's chat" in text


def test_multi_turn_off_by_default_and_valid_settings_pass(base: list[str]) -> None:
    assert issues(base) == []
    assert issues(base, f"{MT}.enable=true", "data.apply_chat_template=true", f"{MT}.tools=[calculator,python]",
                  f"{MT}.environment=arithmetic_feedback", "reward.name=environment") == []


def test_router_replay_is_refused_where_it_cannot_run_naming_the_key(base: list[str],
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Before any model: a dense model has no router; R3 needs an engine that returns its routing (hf; vLLM's and
    SGLang's on GPU only); shared-prompt rows and activation recompute are not replayed."""
    key = f"{AOR}.actor.router_replay.mode"
    assert only(base, f"{key}=R4") == f"{key}='R4': valid: disabled, R2, R3"
    assert "is dense" in only(base, f"{key}=R3")
    a3b = str(Path(__file__).resolve().parents[2] / "recipes" / "model_configs" / "qwen3-30b-a3b.json")
    code, out, err = cli(capsys, "recipe=grpo_qwen3_30b_a3b", "--model-config", a3b, f"{key}=R2",
                         f"~{AOR}.actor.megatron.override_transformer_config.recompute_granularity",
                         f"~{AOR}.actor.megatron.override_transformer_config.recompute_method",
                         f"~{AOR}.actor.megatron.override_transformer_config.recompute_num_layers")
    assert code == 0, err
    code, _, err = cli(capsys, "recipe=grpo_qwen3_30b_a3b", "--model-config", a3b, f"{key}=R3",
                       f"{AOR}.rollout.name=sglang", f"{AOR}.actor.use_prefix_grouper=true")
    assert code == 2 and f"{AOR}.rollout.name=" not in err, err  # sglang records its routing (on GPU)
    assert f"{AOR}.actor.use_prefix_grouper=True" in err and "recompute_granularity='full'" in err, err
    # vllm records its routing on GPU (R3 turns its return_routed_experts on); on CPU its V2 model runner cannot run
    no_recompute = [f"~{AOR}.actor.megatron.override_transformer_config.{k}"
                    for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")]
    code, _, err = cli(capsys, "recipe=grpo_qwen3_30b_a3b", "--model-config", a3b, f"{key}=R3",
                       f"{AOR}.rollout.name=vllm", *no_recompute)
    assert code == 0, err
    code, _, err = cli(capsys, "recipe=grpo_moe_tiny", f"{AOR}.rollout.name=vllm")  # the recipe's R3, on CPU
    assert code == 2 and "return_routed_experts (R3 router replay) needs vLLM's V2 model runner" in err, err
    # expert parallelism: the EP ranks agree on one micro-batch count and shape, so token-budget micro-batches run
    code, _, err = cli(capsys, "recipe=grpo_qwen3_30b_a3b", "--model-config", a3b, f"{AOR}.actor.use_dynamic_bsz=true")
    assert code == 0, err
    # with the interleaved schedule too, on GPU (NCCL); on CPU (gloo) Megatron's shape exchange fails there
    vpp = (f"{AOR}.actor.use_dynamic_bsz=true", f"{AOR}.actor.megatron.pipeline_model_parallel_size=2",
           f"{AOR}.actor.megatron.virtual_pipeline_model_parallel_size=2",
           f"{AOR}.actor.megatron.expert_model_parallel_size=4")
    code, _, err = cli(capsys, "recipe=grpo_qwen3_30b_a3b", "--model-config", a3b, *vpp)
    assert code == 0, err
    code, _, err = cli(capsys, "recipe=grpo_qwen3_30b_a3b", "--model-config", a3b, "trainer.device=cpu", *vpp,
                       f"{AOR}.actor.megatron.use_remove_padding=false")  # packed rows run there (one length)
    assert code == 2 and "not supported on CPU (gloo)" in err, err


def test_the_moe_tiny_recipe_validates_before_its_warm_start_exists(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """grpo_moe_tiny (R3 on the hf engine) plans in an empty cache: its model and data are built on first use."""
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path))
    code, out, err = cli(capsys, "recipe=grpo_moe_tiny")
    assert code == 0, err
    assert "the run builds it first (build_if_missing=sft:sft_moe_tiny)" in out + err, out


def test_validation_leaves_the_config_as_it_was_and_plans_the_derived_one(base: list[str], tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """One pass that changes nothing it is given: the settings that follow from others (the run's length from
    total_epochs, verl's gradient-checkpointing flag, each plugin block as the chosen plugin's kwargs) are in the
    plan's copy, which is what the run uses; a run whose files all exist is checked once, one that builds a file
    first once more after the build (``plan.waits_for_build``)."""
    cfg = compose_config([*base, "trainer.total_training_steps=null", "trainer.total_epochs=3",
                          "data.train_batch_size=1", f"{AOR}.actor.ppo_mini_batch_size=1",
                          f"{AOR}.actor.ppo_micro_batch_size_per_gpu=1",
                          f"{AOR}.model.enable_gradient_checkpointing=true", "reward.name=arithmetic",
                          "+reward.kwargs.math.format_reward=0.1"])
    before = repr(cfg)
    plan = validate(cfg)
    assert repr(cfg) == before
    assert plan.config is not cfg and plan.config.trainer.total_training_steps == 3  # 1 row, batches of 1
    assert plan.config.actor_rollout_ref.actor.megatron.override_transformer_config["recompute_method"] == "uniform"
    assert "math" not in plan.config.reward.kwargs and "math" in cfg.reward.kwargs
    assert not validate(cfg, before_bootstrap=True).waits_for_build
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path))
    unbuilt = compose_config(["recipe=grpo_tiny"])  # model and data built on first use, in the (empty) cache
    assert validate(unbuilt, before_bootstrap=True).waits_for_build


def test_validate_get_answers_with_the_runs_derived_values(base: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", *base, "trainer.total_training_steps=null", "trainer.total_epochs=5",
                 "data.train_batch_size=1", f"{AOR}.actor.ppo_mini_batch_size=1",
                 f"{AOR}.actor.ppo_micro_batch_size_per_gpu=1", "--get", "trainer.total_training_steps"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == "5\n" and "config OK" in err
