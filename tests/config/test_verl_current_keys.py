"""verl's keys of today (issue 42) with today's meaning: each works as in verl, or is refused in one line naming
what to use; what is refused or unknown is reported in one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate, validate_sft

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "recipes" / "model_configs"
AOR = "actor_rollout_ref"
BASE = ["recipe=ppo_megatron_trainer", f"{AOR}.model.path=/models/Qwen3-8B", f"{AOR}.rollout.name=vllm",
        f"{AOR}.actor.megatron.tensor_model_parallel_size=2", f"{AOR}.actor.megatron.pipeline_model_parallel_size=2",
        "algorithm.adv_estimator=grpo", f"{AOR}.rollout.n=4"]


def refused(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        compose_config([*BASE, *overrides])
    return {i.key: str(i) for i in e.value.issues}


def plan(*overrides: str, model: str = "qwen3-8b", **kw: object):  # type: ignore[no-untyped-def]
    cfg = compose_config([*BASE, *overrides])
    t = cfg.trainer
    return validate(cfg, model_config=MODELS / f"{model}.json", world_size=t.nnodes * t.n_gpus_per_node, **kw)


def plan_refused(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        plan(*overrides)
    return {i.key: str(i) for i in e.value.issues}


def test_model_engine_and_strategy_take_megatron_and_refuse_fsdp_in_one_line(capsys: pytest.CaptureFixture[str]
                                                                           ) -> None:
    compose_config([*BASE, "model_engine=megatron", f"{AOR}.actor.strategy=megatron", "critic.strategy=megatron",
                    "ray_kwargs.ray_init.runtime_env.py_executable=uv run python3", "ray_kwargs.ray_init.num_cpus=8"])
    out = capsys.readouterr().out
    assert "verl's model_engine has no effect in hybridrl: hybridrl trains with Megatron" in out
    assert "verl's ray_kwargs.ray_init.num_cpus has no effect in hybridrl: runs are launched by torchrun" in out
    issues = refused("model_engine=fsdp", f"{AOR}.actor.strategy=fsdp2", f"{AOR}.actor.fsdp_config.param_offload=True",
                     f"{AOR}.actor.ulysses_sequence_parallel_size=2", "data.max_promt_length=3")
    assert set(issues) == {"model_engine", "data.max_promt_length"}  # the typo too, in the same run
    assert issues["model_engine"].startswith(
        f"model_engine: model_engine=fsdp, {AOR}.actor.strategy=fsdp2, {AOR}.actor.fsdp_config.param_offload, "
        f"{AOR}.actor.ulysses_sequence_parallel_size: verl's FSDP engine; hybridrl trains with Megatron only")


def test_lora_block_is_hybridrl_lora_with_verls_alpha(capsys: pytest.CaptureFixture[str]) -> None:
    m = compose_config([*BASE, f"{AOR}.model.lora.rank=32",
                        f"{AOR}.model.lora.lora_A_init_method=kaiming"]).actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha) == (32, 32)  # the lora block's alpha (32), not the legacy key's 16
    assert "lora.lora_A_init_method has no effect in hybridrl" in capsys.readouterr().out
    m = compose_config([*BASE, f"{AOR}.model.lora.rank=32", f"{AOR}.model.lora.alpha=64",
                        f"{AOR}.model.lora.target_modules=[linear_qkv,linear_proj]"]).actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, list(m.target_modules)) == (32, 64, ["linear_qkv", "linear_proj"])
    issues = refused(f"{AOR}.model.lora.lora_B_init_method=gaussian", f"{AOR}.model.lora.type=dora")
    assert "B starts at zero" in issues[f"{AOR}.model.lora.lora_B_init_method"]
    assert "no DoRA" in issues[f"{AOR}.model.lora.type"]
    assert "disagrees" in refused(f"{AOR}.model.lora.alpha=64", f"{AOR}.model.lora_alpha=16")[
        f"{AOR}.model.lora.alpha"]


def test_policy_loss_mode_is_the_policy_loss_plugin() -> None:
    alg = compose_config([*BASE, f"{AOR}.actor.policy_loss.loss_mode=vanilla"]).algorithm
    assert alg.policy_loss == "dual_clip"  # verl's vanilla loss clips negative advantages at clip_ratio_c
    gspo = plan(f"{AOR}.actor.policy_loss.loss_mode=gspo", f"{AOR}.actor.clip_ratio_low=3e-4",
                f"{AOR}.actor.clip_ratio_high=4e-4", f"{AOR}.actor.clip_ratio_c=10.0").config.algorithm
    assert gspo.policy_loss == "gspo" and gspo.policy_loss_kwargs["clip_ratio_c"] == 10.0  # accepted, as verl's gspo
    grpo7b = compose_config(["recipe=grpo_qwen7b", f"{AOR}.actor.policy_loss.loss_mode=gspo",
                             f"{AOR}.actor.clip_ratio_c=10.0"]).algorithm
    assert grpo7b.policy_loss == "gspo"  # the loss the command line picks wins over clip_ratio_c's dual_clip
    # SAPO with verl's temperature keys; the recipe's flat clip keys are accepted and unused, as in verl
    sapo = plan(f"{AOR}.actor.policy_loss.loss_mode=sapo", f"{AOR}.actor.tau_pos=0.8").config.algorithm
    assert sapo.policy_loss == "sapo" and sapo.policy_loss_kwargs["tau_pos"] == 0.8
    assert "tau_neg" not in sapo.policy_loss_kwargs  # the plugin's default, verl's 1.05
    with pytest.raises(ConfigError, match="algorithm.policy_loss='clip_cov'"):
        plan(f"{AOR}.actor.policy_loss.loss_mode=clip_cov")  # not installed: the error names the installed losses


def test_rollout_lengths_follow_the_data_lengths_and_must_agree_with_them() -> None:
    d = compose_config([*BASE, f"{AOR}.rollout.prompt_length=2048", f"{AOR}.rollout.response_length=8192",
                        "data.max_prompt_length=2048"]).data
    assert (d.max_prompt_length, d.max_response_length) == (2048, 8192)
    issues = refused("data.max_response_length=4096", f"{AOR}.rollout.response_length=8192")
    assert "disagrees with" in issues["data.max_response_length"] or "disagrees with" in issues[
        f"{AOR}.rollout.response_length"]


def test_checkpoint_engine_bucket_and_new_reward_layout() -> None:
    cfg = compose_config([*BASE, f"{AOR}.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
                          f"{AOR}.rollout.checkpoint_engine.backend=nccl", "reward.reward_manager.name=dapo",
                          "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
                          "+reward.reward_kwargs.overlong_buffer_cfg.len=512",
                          "+reward.reward_kwargs.max_resp_len=512"])
    assert cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes == 4096
    assert cfg.reward.overlong_buffer.enable and cfg.reward.overlong_buffer.len == 512 and cfg.reward.name == "math"
    issues = refused("reward.reward_manager.name=prime", "reward.custom_reward_function.path=/x.py")
    assert "reward.name" in issues["reward.reward_manager.name"]
    assert "reward.name=function" in issues["reward.custom_reward_function.path"]


def test_gae_keys_are_the_estimators_kwargs() -> None:
    alg = plan("algorithm.adv_estimator=gae", "algorithm.gamma=0.99", "algorithm.lam=0.95").config.algorithm
    assert alg.adv_estimator_kwargs == {"gamma": 0.99, "lam": 0.95}  # gae's, as the run reads them
    alg = plan("algorithm.gamma=0.99", "algorithm.norm_adv_by_std_in_grpo=False").config.algorithm
    assert alg.adv_estimator_kwargs == {"norm_adv_by_std_in_grpo": False}  # grpo's; gamma is not grpo's (as in verl)
    assert compose_config([*BASE, "algorithm.adv_estimator=reinforce_plus_plus"]).algorithm.adv_estimator == \
        "reinforce_pp"


def test_critic_and_ref_take_the_actors_keys(capsys: pytest.CaptureFixture[str]) -> None:
    plan(f"{AOR}.ref.megatron.use_mbridge=True", f"{AOR}.actor.megatron.vanilla_mbridge=False",
         f"{AOR}.actor.megatron.seed=42", f"{AOR}.ref.megatron.seed=42", "critic.model.use_remove_padding=True",
         "critic.model.enable_gradient_checkpointing=True", "critic.megatron.use_mbridge=True",
         f"{AOR}.ref.megatron.sequence_parallel=True", "critic.megatron.sequence_parallel=True",
         "algorithm.adv_estimator=gae", f"{AOR}.rollout.n=1")
    out = capsys.readouterr().out
    for key in (f"{AOR}.ref.megatron.use_mbridge", "critic.model.enable_gradient_checkpointing",
                f"{AOR}.actor.megatron.seed"):
        assert f"verl's {key} has no effect in hybridrl" in out, key
    assert "critic.model.use_remove_padding has no effect" not in out  # the critic's packed rows (its own switch)


def test_one_step_off_placement_is_the_disaggregated_one(capsys: pytest.CaptureFixture[str]) -> None:
    """verl's trainer GPUs plus the rollout's own: one world, its last rollout.nnodes × n_gpus_per_node ranks the
    engines'."""
    cfg = compose_config([*BASE, f"{AOR}.hybrid_engine=False", "trainer.nnodes=2", "trainer.n_gpus_per_node=6",
                          "rollout.nnodes=2", "rollout.n_gpus_per_node=2"])
    r, t = cfg.actor_rollout_ref.rollout, cfg.trainer
    assert (r.placement, r.num_ranks, t.nnodes, t.n_gpus_per_node) == ("disaggregated", 4, 2, 8)
    assert "the last 4 run the engines, the first 12 train" in capsys.readouterr().out
    cfg = compose_config([*BASE, "trainer.nnodes=1", "rollout.nnodes=1", "rollout.n_gpus_per_node=8"])
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.actor_rollout_ref.rollout.num_ranks) == (1, 16, 8)
    assert "rollout.nnodes" in refused("trainer.nnodes=2", "rollout.nnodes=1", "rollout.n_gpus_per_node=4")
    assert compose_config([*BASE, f"{AOR}.hybrid_engine=True"]).actor_rollout_ref.rollout.placement == "colocated"


def test_override_config_sets_the_models_length_and_the_engines_get_it(tmp_path: Path) -> None:
    """Qwen2.5-Math-7B's config.json says 4096 positions; verl's one-step-off DAPO script raises it to 32768 for its
    10240-token sequences."""
    short = tmp_path / "config.json"
    short.write_text(json.dumps({**json.loads((MODELS / "qwen2.5-7b.json").read_text()),
                                 "max_position_embeddings": 4096}))
    long = ["data.max_prompt_length=2048", "data.max_response_length=8192"]
    cfg = compose_config([*BASE, *long])
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings 4096"):
        validate(cfg, model_config=short)
    override = f"+{AOR}.model.override_config.max_position_embeddings=32768"
    p = validate(compose_config([*BASE, *long, override]), model_config=short)
    assert p.config.actor_rollout_ref.rollout.engine_kwargs["engine_args"]["hf_overrides"] == {
        "max_position_embeddings": 32768}
    sgl = validate(compose_config([*BASE, *long, override, f"{AOR}.rollout.name=sglang"]), model_config=short)
    assert json.loads(sgl.config.actor_rollout_ref.rollout.engine_kwargs["server_args"]["json_model_override_args"]
                      ) == {"max_position_embeddings": 32768}
    with pytest.raises(ConfigError, match="only max_position_embeddings is"):
        validate(compose_config([*BASE, f"+{AOR}.model.override_config.rope_theta=5e5"]), model_config=short)
    with pytest.raises(ConfigError, match="model.override_config.rope_theta=3: not applied"):  # SFT and DPO: the same
        validate_sft(compose_config(["recipe=sft_tiny", "+model.override_config.rope_theta=3"], config_name="sft"),
                     before_bootstrap=True)


def test_distillation_is_the_teacher_and_the_distillation_estimators(capsys: pytest.CaptureFixture[str]) -> None:
    teacher = "distillation.teacher_models.teacher_model"
    pg = ["distillation.enabled=True", f"{teacher}.model_path=/models/Qwen3-32B", "distillation.n_gpus_per_node=4",
          f"{teacher}.inference.tensor_model_parallel_size=2", "distillation.distillation_loss.loss_mode=k1",
          "distillation.distillation_loss.use_policy_gradient=True"]
    cfg = compose_config([*BASE, *pg, "distillation.distillation_loss.distillation_loss_coef=0.5"])
    assert cfg.actor_rollout_ref.teacher.model.path == "/models/Qwen3-32B"
    assert cfg.algorithm.adv_estimator == "grpo_opd" and cfg.algorithm.adv_estimator_kwargs["distill_coef"] == 0.5
    assert cfg.actor_rollout_ref.teacher.inference.name is None  # distillation.nnodes=0 (verl's default): Megatron
    assert "teacher.inference" not in capsys.readouterr().out
    alone = compose_config([*BASE, *pg, "distillation.distillation_loss.use_task_rewards=False"]).algorithm
    assert (alone.adv_estimator, alone.adv_estimator_kwargs["distill_coef"]) == ("opd", 1.0)
    # verl's defaults: a supervised k3 loss beside the task's policy loss (use_policy_gradient=false)
    defaults = compose_config([*BASE, "distillation.enabled=True", f"{teacher}.model_path=/models/Qwen3-32B"])
    loss = defaults.actor_rollout_ref.teacher.loss
    assert (loss.loss_mode, loss.topk, loss.use_task_rewards, loss.distillation_loss_coef) == ("k3", 32, True, 1.0)
    assert defaults.algorithm.adv_estimator == "grpo" and defaults.actor_rollout_ref.teacher.model.path is not None
    topk = compose_config([*BASE, *pg[:2], "distillation.distillation_loss.loss_mode=forward_kl_topk",
                           "distillation.distillation_loss.topk=64",
                           "distillation.distillation_loss.use_task_rewards=False",
                           "distillation.distillation_loss.loss_max_clamp=10.0",
                           "distillation.distillation_loss.log_prob_min_clamp=-10.0"]).actor_rollout_ref.teacher.loss
    assert (topk.loss_mode, topk.topk, topk.use_task_rewards, topk.loss_max_clamp, topk.log_prob_min_clamp) == (
        "forward_kl_topk", 64, False, 10.0, -10.0)
    not_built = refused(*pg[:2], "distillation.distillation_loss.loss_mode=forward_kl_topk_tail")
    assert "forward_kl_topk_tail is not" in not_built["distillation.distillation_loss.loss_mode"]
    as_advantage = refused(*pg, "distillation.distillation_loss.loss_mode=k3")  # the advantage is k1's only
    assert "for a supervised k3 loss set use_policy_gradient=false" in as_advantage[
        "distillation.distillation_loss.loss_mode"]
    # the teacher counts in the plan, also for another machine: its own config.json, else the student's architecture
    with_32b = plan(*pg, "distillation.distillation_loss.use_task_rewards=False",
                    teacher_config=MODELS / "qwen3-32b.json")
    student = plan(*pg, "distillation.distillation_loss.use_task_rewards=False")
    assert with_32b.memory is not None and student.memory is not None
    assert with_32b.memory.teacher == pytest.approx(4 * student.memory.teacher, rel=0.05)  # 32.8 B vs 8.2 B
    assert any("teacher planned with the student's architecture" in n for n in student.notes)


def test_distillation_nodes_put_the_teacher_on_engine_ranks_of_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    """verl's teacher on GPUs of its own (on-policy distillation's script: distillation.nnodes=1 × n_gpus_per_node=4,
    a vLLM teacher at TP 2 beside 8 trainer GPUs) is ``teacher.inference``: 12 ranks, the last 4 two vLLM engines;
    the teacher is then not in the trainer ranks' memory."""
    teacher = "distillation.teacher_models.teacher_model"
    own = ["distillation.enabled=True", f"{teacher}.model_path=/models/Qwen3-32B", "distillation.nnodes=1",
           "distillation.n_gpus_per_node=4", f"{teacher}.inference.tensor_model_parallel_size=2",
           f"{teacher}.inference.name=vllm", f"{teacher}.inference.gpu_memory_utilization=0.4",
           f"{teacher}.inference.max_model_len=3073", "distillation.distillation_loss.loss_mode=forward_kl_topk",
           "distillation.distillation_loss.use_task_rewards=False"]
    p = plan(*own, teacher_config=MODELS / "qwen3-32b.json")
    i = p.config.actor_rollout_ref.teacher.inference
    assert (i.name, i.num_ranks, i.tensor_model_parallel_size, i.gpu_memory_utilization) == ("vllm", 4, 2, 0.4)
    assert (p.world_size, p.trainer_world_size, p.num_teacher_ranks) == (12, 8, 4)
    assert [e.ranks for e in p.teacher_engines] == [(8, 9), (10, 11)] and "teacher" not in p.roles
    assert p.memory is not None and p.memory.teacher == 0
    assert any("a teacher rank holds its vllm engine only" in n for n in p.notes)
    assert "rank 11: cuda:11 teacher(engine 1)" in p.render()
    assert "the last 4 serve the teacher" in capsys.readouterr().out
    # the rollout's engine by default; SGLang serves a teacher too
    default = plan(*[o for o in own if ".inference.name=" not in o]).config.actor_rollout_ref.teacher.inference
    assert default.name == plan().config.actor_rollout_ref.rollout.name
    assert plan(*own, f"{teacher}.inference.name=sglang").config.actor_rollout_ref.teacher.inference.name == "sglang"
    # vLLM's and SGLang's prompt log-probs are untempered: a tempered rollout's actor log-probs would not match
    for engine in ("vllm", "sglang"):
        tempered = plan_refused(*own, f"{teacher}.inference.name={engine}", f"{AOR}.rollout.temperature=0.7")
        assert "untempered softmax only" in tempered[f"{AOR}.rollout.temperature"]
    odd = refused(*own, "distillation.nnodes=2", "distillation.n_gpus_per_node=3")
    assert "the teacher's GPUs go on the trainer's nodes" in odd["distillation.nnodes"]


def test_moe_overrides_pass_to_megatron_and_grouped_gemm_is_noted() -> None:
    offload = [f"{AOR}.actor.megatron.{k}_offload=True" for k in ("param", "grad", "optimizer")]
    p = plan(f"{AOR}.actor.megatron.expert_model_parallel_size=4",
             f"{AOR}.actor.megatron.pipeline_model_parallel_size=1",
             *offload,
             f"+{AOR}.actor.megatron.override_transformer_config.moe_router_dtype=fp32",
             f"+{AOR}.actor.megatron.override_transformer_config.moe_permute_fusion=True",
             f"+{AOR}.actor.megatron.override_transformer_config.moe_grouped_gemm=True", model="qwen3-30b-a3b")
    passed = p.config.actor_rollout_ref.actor.megatron.override_transformer_config
    assert passed == {"moe_router_dtype": "fp32", "moe_permute_fusion": True}
    assert any("moe_grouped_gemm is not passed to Megatron" in n for n in p.notes)
    with pytest.raises(ConfigError, match="valid: null, fp32, fp64"):
        plan(f"+{AOR}.actor.megatron.override_transformer_config.moe_router_dtype=bf16")


def test_verls_none_spellings_read_as_verl_reads_them() -> None:
    """-1 warm-up steps and test_freq are none; sequence parallelism at TP = 1 is off (verl turns it off)."""
    p = plan(f"{AOR}.actor.megatron.tensor_model_parallel_size=1",
             f"{AOR}.actor.megatron.pipeline_model_parallel_size=4")
    c = p.config
    assert (c.actor_rollout_ref.actor.optim.lr_warmup_steps, c.critic.optim.lr_warmup_steps, c.trainer.test_freq) == (
        0, 0, 0)
    assert not c.actor_rollout_ref.actor.megatron.sequence_parallel and any("sequence parallelism off" in n
                                                                            for n in p.notes)
    assert plan().config.actor_rollout_ref.actor.megatron.sequence_parallel  # TP = 2: on, as verl's default
