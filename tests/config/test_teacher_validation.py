"""The distillation teacher (``actor_rollout_ref.teacher``) is checked before any model is built: present exactly when
the estimator distills, readable, in the actor's layout, with the student's tokenizer; the plan shows its pass and
counts its weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from config.test_validate import base, issues  # noqa: F401  (base is a fixture)

from hybridrl.config.compose import compose_config
from hybridrl.config.validate import validate
from hybridrl.models.bpe_tokenizer import train_bpe_tokenizer
from hybridrl.models.tiny import make_tiny_model

T = "actor_rollout_ref.teacher"


@pytest.fixture(scope="module")
def teachers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("teachers")
    bpe = train_bpe_tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)], vocab_size=300,
                              model_max_length=512)
    return {"bigger": make_tiny_model(tmp / "bigger", hidden=64, layers=6, heads=4, kv_heads=2, max_positions=512),
            "three_heads": make_tiny_model(tmp / "three", hidden=48, layers=4, heads=3, kv_heads=1, max_positions=512),
            "other_tokenizer": make_tiny_model(tmp / "bpe", hidden=32, layers=4, heads=4, kv_heads=2,
                                               max_positions=512, tokenizer=bpe)}


def test_a_distillation_estimator_without_a_teacher_names_the_key(base: list[str]) -> None:  # noqa: F811
    for estimator in ("opd", "grpo_opd"):
        found = issues(base, f"algorithm.adv_estimator={estimator}")
        assert found == [f"{T}.model.path: algorithm.adv_estimator={estimator!r} distills from a teacher: set it "
                         "to the teacher's HF checkpoint (its tokenizer must be the student's)"], found


def test_a_teacher_no_estimator_uses_is_refused(base: list[str], teachers: dict[str, Path]) -> None:  # noqa: F811
    found = issues(base, f"{T}.model.path={teachers['bigger']}")
    assert found == [f"{T}.model.path='{teachers['bigger']}': algorithm.adv_estimator='grpo' does not use a teacher "
                     f"and {T}.loss.loss_mode is null: it would be built for nothing; set it to null, or use a "
                     "distillation estimator (opd, grpo_opd) or a distillation loss (loss.loss_mode: forward_kl_topk, "
                     "k1, k3, ...)"]


def test_a_distillation_loss_uses_the_teacher(base: list[str], teachers: dict[str, Path]) -> None:  # noqa: F811
    """A supervised distillation term (``teacher.loss``) is a use of the teacher beside any estimator, and one without
    a teacher names the key; with ``use_task_rewards=false`` the estimator's advantage is not trained, so GRPO's
    group of samples is not needed (verl's distillation script samples once per prompt)."""
    assert issues(base, f"{T}.model.path={teachers['bigger']}", f"{T}.loss.loss_mode=forward_kl_topk") == []
    assert issues(base, f"{T}.model.path={teachers['bigger']}", f"{T}.loss.loss_mode=k3",
                  f"{T}.loss.use_task_rewards=false", "actor_rollout_ref.rollout.n=1") == []
    assert issues(base, f"{T}.model.path={teachers['bigger']}", f"{T}.loss.loss_mode=k3",
                  "actor_rollout_ref.rollout.n=1")[0].startswith("actor_rollout_ref.rollout.n=1: ")
    assert issues(base, f"{T}.loss.loss_mode=k1") == [
        f"{T}.model.path: {T}.loss.loss_mode=k1 distills from a teacher: set it to the teacher's HF checkpoint (its "
        "tokenizer must be the student's)"]


def test_a_bad_distillation_loss_names_each_field(base: list[str], teachers: dict[str, Path]) -> None:  # noqa: F811
    found = issues(base, f"{T}.model.path={teachers['bigger']}", f"{T}.loss.loss_mode=forward_kl", f"{T}.loss.topk=0",
                   f"{T}.loss.distillation_loss_coef=0", f"{T}.loss.loss_max_clamp=-1",
                   f"{T}.loss.log_prob_min_clamp=2")
    assert [f.split(":")[0] for f in found] == [
        f"{T}.loss.loss_mode='forward_kl'", f"{T}.loss.topk=0", f"{T}.loss.distillation_loss_coef=0.0",
        f"{T}.loss.loss_max_clamp=-1.0", f"{T}.loss.log_prob_min_clamp=2.0"], found
    assert "forward_kl_topk, k1, kl, k2, mse, k3, low_var_kl, abs" in found[0]
    vocab = issues(base, f"{T}.model.path={teachers['bigger']}", f"{T}.loss.loss_mode=forward_kl_topk",
                   f"{T}.loss.topk=100000")
    assert len(vocab) == 1 and vocab[0].startswith(f"{T}.loss.topk=100000: at most the teacher's vocabulary ("), vocab


def test_a_missing_teacher_checkpoint_names_its_key(base: list[str], tmp_path: Path) -> None:  # noqa: F811
    found = issues(base, "algorithm.adv_estimator=opd", f"{T}.model.path={tmp_path / 'nowhere'}")
    assert len(found) == 1 and found[0].startswith(f"{T}.model.path='{tmp_path / 'nowhere'}': directory "), found


def test_a_teacher_with_another_tokenizer_is_refused(base: list[str], teachers: dict[str, Path]) -> None:  # noqa: F811
    found = issues(base, "algorithm.adv_estimator=opd", f"{T}.model.path={teachers['other_tokenizer']}")
    assert len(found) == 1, found
    assert found[0].startswith(f"{T}.model.path='{teachers['other_tokenizer']}': its tokenizer is not the student's")
    assert "the teacher must score the student's token ids" in found[0]
    with_path = issues(base, "algorithm.adv_estimator=opd", f"{T}.model.path={teachers['bigger']}",
                       f"+{T}.model.tokenizer_path={teachers['other_tokenizer']}")
    assert len(with_path) == 1 and with_path[0].startswith(f"{T}.model.tokenizer_path="), with_path


def test_the_teacher_runs_in_the_actors_layout(base: list[str], teachers: dict[str, Path]) -> None:  # noqa: F811
    found = issues(base, "algorithm.adv_estimator=opd", f"{T}.model.path={teachers['bigger']}",
                   f"{T}.megatron.tensor_model_parallel_size=2")
    assert found == [f"{T}.megatron.tensor_model_parallel_size=2: must equal actor_rollout_ref.actor.megatron."
                     "tensor_model_parallel_size=1 (the teacher shares the actor's Megatron process groups); leave it "
                     "null to follow the actor"], found
    found = issues(base, "algorithm.adv_estimator=opd", f"{T}.model.path={teachers['three_heads']}",
                   "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", world=2)
    assert found and all(f.startswith("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2: "
                                      f"{T}.model.path: ") for f in found), found


def test_a_valid_teacher_is_planned_with_its_pass_and_its_weights(base: list[str],  # noqa: F811
                                                                  teachers: dict[str, Path]) -> None:
    overrides = [*base, "algorithm.adv_estimator=opd", f"{T}.model.path={teachers['bigger']}",
                 f"{T}.log_prob_micro_batch_size_per_gpu=2"]
    plan = validate(compose_config(overrides), world_size=1)
    assert "teacher" in plan.roles and plan.batch.teacher_log_prob is not None
    assert plan.batch.teacher_log_prob.micro_batch_size == 2
    assert "; teacher: micro-batches of 2" in plan.render()
    assert "\nteacher qwen2: 6 layers, hidden 64, heads 4 (kv 2)" in plan.render()
    without = validate(compose_config(base), world_size=1)
    assert plan.memory is not None and without.memory is not None and without.memory.teacher == 0
    # 6 layers of hidden 64 (+ a tied embedding): the teacher's fp32 weights in the estimate, resident when training
    assert 6 * 4 * 64 * 64 * 4 < plan.memory.teacher < 4 * plan.memory.params * 8
    assert plan.memory.train - without.memory.train == pytest.approx(plan.memory.teacher)


def test_a_teacher_on_engine_ranks_of_its_own_is_checked_and_planned(base: list[str],  # noqa: F811
                                                                     teachers: dict[str, Path]) -> None:
    """``teacher.inference.name`` puts the teacher on an engine of the last ``num_ranks`` ranks: an engine that can
    score, TP that its plugin has and that splits its ranks and the teacher's heads, ranks left to train; the plan
    places it there and the trainer's layout spans the rest."""
    use = [f"{T}.model.path={teachers['three_heads']}", f"{T}.loss.loss_mode=forward_kl_topk"]
    plan = validate(compose_config([*base, *use, f"{T}.inference.name=hf", f"{T}.inference.num_ranks=1"]),
                    world_size=3)
    assert (plan.trainer_world_size, plan.num_teacher_ranks, plan.roles["actor"].dp) == (2, 1, 2)
    assert [e.ranks for e in plan.teacher_engines] == [(2,)] and "teacher" not in plan.roles
    assert plan.is_teacher_rank(2) and not plan.is_engine_rank(2) and not plan.is_teacher_rank(1)
    assert "rank 2: cpu teacher(engine 0, leader) only" in plan.render()
    # the Megatron teacher would have to split its 3 heads over TP = 2; on its own engine it does not
    assert issues(base, *use, f"{T}.inference.name=hf", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                  "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2", world=3) == []
    assert issues(base, *use, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                  "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2", world=2) != []
    found = issues(base, *use, f"{T}.inference.name=hf", f"{T}.inference.num_ranks=2",
                   f"{T}.inference.tensor_model_parallel_size=2", world=2)
    assert any(f.startswith(f"{T}.inference.num_ranks=2: must be 1..1") for f in found), found
    assert any(f.startswith(f"{T}.inference.tensor_model_parallel_size=2: the hf engine has no tensor parallel")
               for f in found), found
    assert any("must divide the teacher's 3 attention heads" in f for f in found), found
    unknown = issues(base, *use, f"{T}.inference.name=nope", world=2)
    assert len(unknown) == 1 and unknown[0].startswith(f"{T}.inference.name='nope'"), unknown
    bad_kwargs = issues(base, *use, f"{T}.inference.name=hf", f"+{T}.inference.engine_kwargs.dtyp=float32", world=2)
    assert len(bad_kwargs) == 1 and "dtyp" in bad_kwargs[0] and f"{T}.inference.engine_kwargs" in bad_kwargs[0]
