"""On-policy distillation (``algorithm.adv_estimator=opd``) on 2 ranks at TP=2 equals the same run on one rank.

The student is test_train_layouts' chatty random tiny model with multi-turn episodes (tool and feedback tokens under
``loss_mask`` 0); the teacher is another random tiny Qwen2 of its own shape (3 layers, another seed) with the same
char tokenizer, following the actor's layout as the ref does. Two steps each: step 2 samples with the weights step 1
synced, so the teacher's log-probs, the advantages they make and the update they drive all enter the comparison.
Time: ~35 s on 2 cores (two torchrun launches).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from parallel.test_train_layouts import dumps, overrides, run  # noqa: F401  (run is a fixture)
from support.e2e import TRAIN, read_metrics, tiny  # noqa: F401  (a fixture)

from hybridrl.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def distill(run: dict[str, Path]) -> list[str]:  # noqa: F811
    teacher = make_tiny_model(run["tmp"] / "teacher", hidden=64, layers=3, heads=4, kv_heads=2, max_positions=128,
                              seed=7)
    return ["algorithm.adv_estimator=opd", "+algorithm.adv_estimator_kwargs.distill_coef=0.5",
            f"actor_rollout_ref.teacher.model.path={teacher}",
            "actor_rollout_ref.teacher.log_prob_micro_batch_size_per_gpu=8"]


@pytest.mark.distributed
def test_distillation_at_tp2_equals_tp1(torchrun, run: dict[str, Path], distill: list[str]) -> None:  # noqa: F811
    outs = {tp: run["tmp"] / f"distill_tp{tp}" for tp in (1, 2)}
    torchrun([TRAIN, *overrides(run, outs[1], *distill)], nproc=1, timeout=300)
    torchrun([TRAIN, *overrides(run, outs[2], *distill, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2")], nproc=2, timeout=300)
    tp1, tp2 = read_metrics(outs[1]), read_metrics(outs[2])
    assert dumps(outs[2]) == dumps(outs[1])  # the same samples, token for token, both steps
    for r, ref in zip(tp2, tp1, strict=True):
        assert all(math.isfinite(v) for v in r.values()), r
        assert "timing/teacher" in r and r["distill/teacher_logprob_mean"] < 0
        # a random teacher disagrees with the student: a reverse KL well above 0 drives the update
        assert r["distill/reverse_kl"] > 0.1 and r["actor/grad_norm"] > 0, r
        for key in ("distill/reverse_kl", "distill/teacher_logprob_mean", "distill/student_logprob_mean",
                    "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert r[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (r["step"], key, r[key], ref[key])
        assert abs(r["actor/ppo_kl_first_mb"]) <= 1e-6, r


def _topk_loss(teacher: Path | str, *extra: str) -> list[str]:
    """verl's forward_kl_topk as the actor's only trained term (use_task_rewards=false), GRPO's advantage unused."""
    return ["actor_rollout_ref.teacher.loss.loss_mode=forward_kl_topk", "actor_rollout_ref.teacher.loss.topk=8",
            "actor_rollout_ref.teacher.loss.use_task_rewards=false", f"actor_rollout_ref.teacher.model.path={teacher}",
            "actor_rollout_ref.teacher.log_prob_micro_batch_size_per_gpu=8", *extra]


TP2 = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
       "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"]
TOPK_KEYS = ("actor/distill_loss", "actor/distill_student_mass", "actor/distill_teacher_mass", "actor/grad_norm",
             "actor/entropy", "distill/teacher_logprob_mean")


@pytest.fixture(scope="module")
def topk_teacher(run: dict[str, Path]) -> Path:  # noqa: F811
    return make_tiny_model(run["tmp"] / "topk_teacher", hidden=64, layers=3, heads=4, kv_heads=2, max_positions=128,
                           seed=11)


@pytest.fixture(scope="module")
def topk_tp1(torchrun, run: dict[str, Path], topk_teacher: Path) -> Path:  # noqa: F811
    """The top-k distillation run on one rank: the reference of the split layouts."""
    out = run["tmp"] / "topk_tp1"
    torchrun([TRAIN, *overrides(run, out, *_topk_loss(topk_teacher))], nproc=1, timeout=300)
    return out


def _same_run(out: Path, ref_out: Path) -> None:
    assert dumps(out) == dumps(ref_out)
    for r, ref in zip(read_metrics(out), read_metrics(ref_out), strict=True):
        assert r["actor/distill_loss"] > 0.01 and r["actor/grad_norm"] > 0, r  # a random teacher: a real signal
        for key in TOPK_KEYS:
            assert r[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (r["step"], key, r[key], ref[key])


@pytest.mark.distributed
def test_topk_distillation_loss_at_tp2_equals_tp1(torchrun, run: dict[str, Path], topk_teacher: Path,  # noqa: F811
                                                   topk_tp1: Path) -> None:
    """The top-k forward-KL distillation loss (``actor_rollout_ref.teacher.loss``): at TP = 2 (each rank holds half the
    vocabulary: the teacher's top-k and the student's log-probs at those ids cross the shards) the same as one rank,
    over multi-turn episodes; and with the student as its own teacher the loss is 0 before the first update (the
    teacher's ids line up with the student's positions: a shifted or misrouted id would read another distribution).
    Time: ~50 s (three torchrun launches, the reference's included)."""
    self_out = run["tmp"] / "topk_self"  # one optimizer step per RL step: step 1's loss is read before any update
    one_update = "actor_rollout_ref.actor.ppo_mini_batch_size=4"
    torchrun([TRAIN, *overrides(run, self_out, *_topk_loss(run["model"], one_update, *TP2))], nproc=2, timeout=300)
    first = read_metrics(self_out)[0]
    assert 0 <= first["actor/distill_loss"] < 1e-5, first
    assert first["actor/distill_student_mass"] == pytest.approx(first["actor/distill_teacher_mass"], abs=1e-5)
    assert 0 < first["actor/distill_teacher_mass"] <= 1 + 1e-6, first
    out = run["tmp"] / "topk_tp2"
    torchrun([TRAIN, *overrides(run, out, *_topk_loss(topk_teacher), *TP2)], nproc=2, timeout=300)
    _same_run(out, topk_tp1)


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "nproc", "layout"), [
    ("cp2", 2, ["actor_rollout_ref.actor.megatron.context_parallel_size=2",
                "actor_rollout_ref.ref.megatron.context_parallel_size=2"]),
    ("prefix_grouper", 1, ["actor_rollout_ref.actor.use_prefix_grouper=true"])])
def test_topk_distillation_loss_in_other_layouts(torchrun, run: dict[str, Path], topk_teacher: Path,  # noqa: F811
                                                 topk_tp1: Path, name: str, nproc: int, layout: list[str]) -> None:
    """The teacher's top-k ids reach the student's positions through the other two ways positions are laid out: split
    over CP ranks (each holds some positions of every row), and a prompt's samples sharing one row (prefix grouper,
    where positions are selected, not gathered). Time: ~20 s each."""
    out = run["tmp"] / f"topk_{name}"
    torchrun([TRAIN, *overrides(run, out, *_topk_loss(topk_teacher), *layout)], nproc=nproc, timeout=300)
    _same_run(out, topk_tp1)


TEACHER_ENGINE = ["actor_rollout_ref.teacher.inference.name=hf", "actor_rollout_ref.teacher.inference.num_ranks=1"]


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "nproc"), [("engine", 2), ("engine_dp2", 3)])
def test_topk_distillation_with_the_teacher_on_its_own_engine_rank(torchrun, run: dict[str, Path],  # noqa: F811
                                                                   topk_teacher: Path, topk_tp1: Path, name: str,
                                                                   nproc: int) -> None:
    """The teacher served by the hf engine on a rank of its own (``teacher.inference``, verl's teacher on its own
    GPUs), scoring the samples of one trainer rank and of two DP ranks (each sends its own share, each gets its own
    scores back), trains as the Megatron teacher in the actor's layout does: the same samples, the same top-k loss,
    masses and gradient norms. Time: ~25 s each."""
    out = run["tmp"] / f"topk_{name}"
    proc = torchrun([TRAIN, *overrides(run, out, *_topk_loss(topk_teacher), *TEACHER_ENGINE)], nproc=nproc,
                    timeout=300)
    assert f"rank {nproc - 1}: teacher engine 0: ranks [{nproc - 1}]" in proc.stdout + proc.stderr
    _same_run(out, topk_tp1)
    assert all("timing/teacher" in r for r in read_metrics(out))
