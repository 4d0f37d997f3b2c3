"""The RL loop. Every rank runs this same code; data movement lives in the components.

    rollout (generate → reward, submitted) → old / ref / teacher log-probs (+ values) → scores → advantages
    → (critic update →) actor update → weight sync → eval, log

The step's samples come from a :class:`~hybridrl.interfaces.Rollout` (single-turn, dynamic sampling, …): the
loop does not know which.

With a critic (PPO with ``gae``) the order is verl's: the critic's values before the advantages, its update
before the actor's (both train on the batch as scored, so the order does not change either update).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hybridrl import preemption
from hybridrl.algorithms.kl import kl_penalty
from hybridrl.algorithms.masked import masked_mean
from hybridrl.batch import RolloutBatch
from hybridrl.checkpoint.rl import checkpoint_root
from hybridrl.guards import SkipCounter, agree, non_finite, update_skip_cause
from hybridrl.interfaces import RewardOutput, SamplingParams
from hybridrl.metrics import DPMeans, Timer, rollout_metrics
from hybridrl.seeds import eval_seed, step_seed, update_seed
from hybridrl.tracking import say
from hybridrl.trainers import rollout_dump
from hybridrl.trainers.components import Components
from hybridrl.trainers.eval_metrics import add_sampled_accuracy
from hybridrl.trainers.profiling import StepProfiler


def fit(c: Components) -> dict[str, float]:
    t = c.cfg.trainer
    if t.val_before_train and c.val_dataset is not None and c.resume_step == 0:
        c.tracker.log(evaluate(c), step=0)
    metrics, skips = {}, SkipCounter(limit=t.max_consecutive_skipped_steps)
    profiler = StepProfiler(t.profile_steps, t.output_dir)
    # timing/step: the wall time between consecutive steps (evaluation, saving included); timing_cpu/step this
    # process's CPU seconds over the same span (all its threads; an engine's own processes are not counted)
    last, last_cpu = time.perf_counter(), time.process_time()
    saved = c.resume_step
    for step in range(c.resume_step + 1, t.total_training_steps + 1):
        if stop_if_preempted(c, done=step - 1, saved=saved):
            return metrics
        timer = Timer()
        with profiler.step(step), timer("work"):
            rolled = c.rollout.step(seed=step_seed(t.seed, step), timer=timer)
            batch = rolled.batch
            warmup = step < t.critic_warmup  # verl's: the critic alone trains until step critic_warmup
            old_pass = old_log_prob_pass_needed(c) or warmup
            entropy_BT = log_prob_passes(c, batch, timer, old_pass=old_pass)
            with timer("reward"):
                scores_B, reward_errors = score(batch, *c.reward.training_scores(batch, rolled.scores))
            with timer("adv"):
                adv_metrics = compute_advantages(c, batch)
            if (cause := skip_cause(c, batch)) is not None:  # decided on every rank together: no update, no sync
                skips.record(cause)
                say(f"step {step} skipped: {cause}")
                c.tracker.log({"training/skipped_steps": skips.total}, step=step)
                continue
            update = update_and_sync(c, batch, timer, seed=update_seed(t.seed, step), warmup=warmup,
                                     old_pass=old_pass)
            if not warmup:  # (the critic alone trains in its warmup: no actor update to count)
                skips.record(update_skip_cause(update.actor))
        metrics = step_metrics(c, step, batch, timer, rolled.metrics | adv_metrics, update,
                               entropy_BT=entropy_BT if old_pass else update.entropy_BT, scores_B=scores_B,
                               reward_errors=reward_errors, old_pass=old_pass, skipped=skips.total)
        now, now_cpu = time.perf_counter(), time.process_time()
        metrics |= timer.times | {"timing/step": now - last, "timing_cpu/step": now_cpu - last_cpu}
        last, last_cpu = now, now_cpu
        c.tracker.log(metrics, step=step)
        if t.rollout_data_dir is not None:
            rollout_dump.dump(t.rollout_data_dir, step, batch, scores_B, c.tokenizer)
        if t.save_freq > 0 and (step % t.save_freq == 0 or step == t.total_training_steps):
            c.save(step)
            saved = step
    stop_if_preempted(c, done=t.total_training_steps, saved=saved)  # a signal during the last step
    return metrics


def log_prob_passes(c: Components, batch: RolloutBatch, timer: Timer, *, old_pass: bool) -> torch.Tensor | None:
    """Fill the batch's old (actor, when ``old_pass``), ref and teacher log-probs and the critic's values, each
    role that the run has; the actor's entropy ``[B, T]`` when it ran (else the update gives it)."""
    hybrid, entropy_BT = c.hybrid, None
    if old_pass:
        with timer("old_log_prob"):
            entropy_BT = hybrid.compute_log_probs(batch)
    if hybrid.ref is not None:
        with timer("ref"):
            hybrid.compute_ref_log_probs(batch)
    if hybrid.has_teacher:
        with timer("teacher"):
            hybrid.compute_teacher_log_probs(batch)
    if hybrid.critic is not None:
        with timer("values"):
            hybrid.compute_values(batch)
    return entropy_BT


@dataclass(slots=True, kw_only=True)
class Update:
    """What a step's updates gave: the critic's metrics (means over its optimizer steps), the actor's per optimizer
    step (none while the critic warms up), the MB of the weight sync, and the entropy of an on-policy update (no
    old-log-prob pass)."""

    critic: dict[str, float] = field(default_factory=dict)
    actor: list[dict[str, float]] = field(default_factory=list)
    sync_mb: float = 0.0
    entropy_BT: torch.Tensor | None = None


def update_and_sync(c: Components, batch: RolloutBatch, timer: Timer, *, seed: int, warmup: bool,
                    old_pass: bool) -> Update:
    """The critic's update, then (after ``trainer.critic_warmup``) the actor's and the weight sync into the engines.
    Without the old-log-prob pass π_old is the update's own detached log-probs, filled into the batch afterwards."""
    hybrid, out = c.hybrid, Update()
    if hybrid.critic is not None:
        with timer("update_critic"):
            out.critic = critic_metrics(hybrid.update_critic(batch, seed=seed), batch)
    if warmup:
        return out
    with timer("update_actor"):
        if old_pass:
            out.actor = hybrid.update_actor(batch, seed=seed)
        else:
            out.actor, out.entropy_BT = hybrid.update_actor_on_policy(batch, seed=seed)
    with timer("sync_weights"):
        out.sync_mb = c.rollout.sync_weights()
    return out


def step_metrics(c: Components, step: int, batch: RolloutBatch, timer: Timer, extra: dict[str, float],
                 update: Update, *, entropy_BT: torch.Tensor | None, scores_B: torch.Tensor, reward_errors: int,
                 old_pass: bool, skipped: int) -> dict[str, float]:
    """The step's logged metrics (but ``timing/*``): the batch's (DP-reduced), ``extra`` (the rollout's and the
    advantages'), the updates', routing and distillation ones, throughput, and evaluation when it is due."""
    t = c.cfg.trainer
    assert entropy_BT is not None
    m = rollout_metrics(batch, scores_B, entropy_BT)
    m.total("reward/errors", reward_errors)
    work = timer.times.pop("timing/work")  # generate … weight sync: what perf/tokens_per_s counts
    timer.times.pop("timing_cpu/work")
    metrics = (m.reduce() | extra | (actor_metrics(update.actor) if update.actor else {}) | update.critic
               | c.hybrid.take_routing_metrics() | c.hybrid.take_padding_metrics() | distill_metrics(batch))
    metrics["actor/old_logprob_pass"] = float(old_pass)
    metrics["training/skipped_steps"] = skipped
    metrics |= {"perf/tokens_per_s": metrics.pop("perf/tokens") / work, "perf/weight_sync_mb": update.sync_mb}
    if step == 1:  # data/prompts_{total,kept,dropped}: the length filter's counts, once a run (not on resume)
        metrics |= c.loader.dataset.filter_metrics
    if c.val_dataset is not None and t.test_freq and (step % t.test_freq == 0 or step == t.total_training_steps):
        with timer("eval"):
            metrics |= evaluate(c)
    return metrics


def stop_if_preempted(c: Components, *, done: int, saved: int) -> bool:
    """Collective, between steps: whether a rank got SIGTERM/SIGUSR1 (:mod:`hybridrl.preemption`); if so the last
    finished step ``done`` is saved (unless it was just saved) and the run ends."""
    stop = preemption.agreed_stop(preemption.current(), where=f"in step {done + 1}")
    if stop is None:
        return False
    if done > saved:
        preemption.current().where = f"saving step {done}"  # type: ignore[union-attr]
        c.save(done)
    say(f"preempted ({stop}): stopped after step {done}; its checkpoint is in {checkpoint_root(c.cfg)} "
        "(trainer.resume=auto continues from it)" if done else f"preempted ({stop}) before the first step")
    return True


def old_log_prob_pass_needed(c: Components) -> bool:
    """Whether the step runs the separate old-log-prob pass: unless the update is provably on-policy
    (``ActorRolloutRef.update_is_on_policy``: one epoch, one mini-batch), or π_old is read before the update
    (the in-reward KL penalty, ``algorithm.use_kl_in_reward``; a distillation estimator's log π_old − log π_teacher)."""
    return not c.hybrid.update_is_on_policy or c.cfg.algorithm.use_kl_in_reward or c.estimator.needs_teacher


def score(batch: RolloutBatch, scores_B: torch.Tensor, errors: int) -> tuple[torch.Tensor, int]:
    """Put each sample's sequence score (the reward runner's training scores, overlong penalty included) on its
    response's last trained token (``loss_mask``): ``batch.token_level_scores``. Returns ``scores_B`` and how many
    samples failed to score (0.0 each under ``reward.on_error=zero``; under ``raise`` the run has stopped)."""
    scores_BT = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
    scores_BT[torch.arange(len(batch)), last_trained_B(batch.loss_mask)] = scores_B
    batch.token_level_scores = scores_BT * batch.loss_mask
    return scores_B, errors


def last_trained_B(loss_mask_BT: torch.Tensor) -> torch.Tensor:
    """``[B]`` the index of each row's last 1 in ``loss_mask_BT`` (0 for a row without one)."""
    T = loss_mask_BT.shape[-1]
    return (T - 1 - loss_mask_BT.flip(-1).argmax(-1)) * loss_mask_BT.any(-1)


def reward(c: Components, batch: RolloutBatch) -> RewardOutput:
    """The reward manager's output, run as ``reward.*`` says (time limit, on_error, workers), scores checked."""
    return c.reward.score(batch).output


def skip_cause(c: Components, batch: RolloutBatch) -> str | None:
    """Why this step must not update the actor (a non-finite score or advantage on any rank), or None."""
    assert batch.token_level_scores is not None and batch.advantages is not None
    rows = batch.group_index.tolist()
    cause = (non_finite(f"scores from reward.name={c.cfg.reward.name!r}", batch.token_level_scores.sum(-1),
                        sample_ids=rows)
             or non_finite(f"advantages ({c.cfg.algorithm.adv_estimator})", batch.advantages, sample_ids=rows))
    return agree(cause)


def compute_advantages(c: Components, batch: RolloutBatch) -> dict[str, float]:
    """Token rewards (scores − β·KL when ``use_kl_in_reward``; β then follows ``kl_ctrl``) and advantages."""
    alg = c.cfg.algorithm
    metrics: dict[str, float] = {}
    assert batch.token_level_scores is not None
    rewards_BT = batch.token_level_scores
    if alg.use_kl_in_reward:  # PPO-style per-token penalty β·KL(π_old ‖ π_ref)
        assert batch.old_logprobs is not None and batch.ref_logprobs is not None
        kl_BT = kl_penalty(batch.old_logprobs, batch.ref_logprobs, alg.kl_penalty)
        rewards_BT = rewards_BT - c.kl_ctrl.value * kl_BT
        m = DPMeans()  # the step's KL: mean over all DP ranks' sequences of each one's token mean
        m.add("actor/reward_kl_penalty", masked_mean(kl_BT, batch.loss_mask, dim=-1).sum(), len(batch))
        m.total("samples", len(batch))
        step = m.reduce()
        metrics = {"actor/reward_kl_penalty": step["actor/reward_kl_penalty"],
                   "actor/reward_kl_penalty_coeff": c.kl_ctrl.value}
        c.kl_ctrl.update(step["actor/reward_kl_penalty"], n_samples=round(step["samples"]))
    batch.token_level_rewards = rewards_BT * batch.loss_mask
    extra = {}
    if c.estimator.needs_teacher:  # on-policy distillation (hybridrl/algorithms/advantages/opd.py)
        assert batch.old_logprobs is not None and batch.teacher_logprobs is not None
        extra = {"logprobs_BT": batch.old_logprobs, "teacher_logprobs_BT": batch.teacher_logprobs}
    batch.advantages, batch.returns = c.estimator(
        token_rewards_BT=batch.token_level_rewards, response_mask_BT=batch.loss_mask.float(),
        group_index_B=batch.group_index, values_BT=batch.values, **extra)
    return metrics


def distill_metrics(batch: RolloutBatch) -> dict[str, float]:
    """With a distillation teacher: ``distill/reverse_kl`` (log π_old − log π_teacher per sampled token, the mean over
    every DP rank's trained tokens: ``loss_mask``), ``distill/teacher_logprob_mean`` and the student's, alike."""
    if batch.teacher_logprobs is None or batch.old_logprobs is None:
        return {}
    mask_BT, m = batch.loss_mask.float(), DPMeans()
    teacher_BT, student_BT = batch.teacher_logprobs.float().cpu(), batch.old_logprobs.float().cpu()
    tokens = mask_BT.sum()
    m.add("distill/reverse_kl", ((student_BT - teacher_BT) * mask_BT).sum(), tokens)
    m.add("distill/teacher_logprob_mean", (teacher_BT * mask_BT).sum(), tokens)
    m.add("distill/student_logprob_mean", (student_BT * mask_BT).sum(), tokens)
    return m.reduce()


def actor_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
    """Means over the optimizer steps of this RL step; ``actor/ppo_kl_first_mb`` must be ~0."""
    out = {f"actor/{k}": sum(u[k] for u in updates) / len(updates) for k in updates[0]}
    out["actor/ppo_kl_first_mb"] = updates[0]["ppo_kl"]
    out["actor/grad_norm_max"] = max(u["grad_norm"] for u in updates)
    return out


def critic_metrics(updates: list[dict[str, float]], batch: RolloutBatch) -> dict[str, float]:
    """Means over the critic's optimizer steps, and ``critic/vf_explained_var`` = 1 − Var(R − V)/Var(R) of the
    values the advantages used, over the response tokens of all DP ranks (population variances)."""
    out = {f"critic/{k}": sum(u[k] for u in updates) / len(updates) for k in updates[0]}
    assert batch.values is not None and batch.returns is not None
    mask_BT = batch.loss_mask.float()
    r_BT, d_BT = batch.returns * mask_BT, (batch.returns - batch.values) * mask_BT
    m, tokens = DPMeans(), mask_BT.sum()
    for key, x_BT in (("r", r_BT), ("r2", r_BT.square()), ("d", d_BT), ("d2", d_BT.square())):
        m.add(key, x_BT.sum(), tokens)
    s = m.reduce()
    var_r, var_d = s["r2"] - s["r"] ** 2, s["d2"] - s["d"] ** 2
    out["critic/vf_explained_var"] = 1.0 - var_d / var_r if var_r > 0 else float("nan")
    return out


def evaluate(c: Components) -> dict[str, float]:
    """Accuracy over the whole validation split, sampled as ``rollout.val_kwargs`` says (greedy by default):
    overall, and mean@n / pass@k per data source (:mod:`hybridrl.trainers.eval_metrics`)."""
    v = c.cfg.actor_rollout_ref.rollout.val_kwargs
    params = SamplingParams(temperature=v.sampling_temperature, top_p=v.top_p, top_k=v.top_k, n=v.n,
                            max_new_tokens=c.cfg.data.max_response_length)
    m = DPMeans()
    for k, prompts in enumerate(c.val_batches()):
        batch = c.rollout.generate(prompts, params, seed=eval_seed(c.cfg.trainer.seed, k))
        out = reward(c, batch)
        correct_B = out.correct_B if out.correct_B is not None else out.scores_B > 0
        m.add("eval/accuracy", correct_B.sum(), len(batch))
        m.add("eval/reward_mean", out.scores_B.sum(), len(batch))
        m.add("eval/response_length_mean", batch.response_mask.sum(), len(batch))
        add_sampled_accuracy(m, batch, correct_B, n=v.n)
    return m.reduce()
