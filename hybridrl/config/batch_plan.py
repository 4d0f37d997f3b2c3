"""The batch arithmetic of a run: samples per step, mini- and micro-batches per pass, optimizer steps; each
problem named by its key (the plan's part that ``data.*`` and ``*.ppo_*`` sizes decide)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from hybridrl.config.errors import ConfigIssue
from hybridrl.config.layout import AOR, RoleLayout, shares
from hybridrl.config.schema import RLConfig
from hybridrl.megatron.config import (
    MicroBatching,
    divisors,
    interleaved_micro_batches_problem,
)
from hybridrl.megatron.dynamic_batch import VPP_DYNAMIC_UNSUPPORTED


@dataclass(frozen=True, slots=True, kw_only=True)
class CriticBatchPlan:
    """The critic's updates (its own mini-batches and epochs over the step's samples) and values pass."""

    ppo_epochs: int
    mini_batches_per_epoch: int
    mini_batch_samples_per_dp_rank: int
    update: MicroBatching  # also the values pass's micro-batches
    total_steps: int  # RL steps of the run

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        return self.ppo_epochs * self.mini_batches_per_epoch

    @property
    def total_optimizer_steps(self) -> int:
        return self.total_steps * self.optimizer_steps_per_rl_step


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchPlan:
    """A step's batch arithmetic (verl's units: prompts for batch sizes, samples per DP rank for micro)."""

    n: int  # samples per prompt
    prompts_per_step: int
    # prompts per generation round: prompts_per_step, or data.gen_batch_size under algorithm.filter_groups
    # (rounds repeat until prompts_per_step groups with signal are kept: hybridrl/rollout/dynamic_sampling.py)
    prompts_per_generation: int
    filter_groups: bool  # algorithm.filter_groups.enable
    dp: int
    ppo_epochs: int
    prompts_per_mini_batch: int
    total_steps: int  # RL steps of the run
    update: MicroBatching
    old_log_prob: MicroBatching
    ref_log_prob: MicroBatching
    critic: CriticBatchPlan | None = None  # when a critic is built
    teacher_log_prob: MicroBatching | None = None  # when a distillation teacher is built

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.n

    @property
    def mini_batches_per_epoch(self) -> int:
        return max(self.prompts_per_step // self.prompts_per_mini_batch, 1)

    @property
    def samples_per_mini_batch(self) -> int:
        return self.prompts_per_mini_batch * self.n

    @property
    def mini_batch_samples_per_dp_rank(self) -> int:
        return self.samples_per_mini_batch // self.dp

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        return self.ppo_epochs * self.mini_batches_per_epoch

    @property
    def total_optimizer_steps(self) -> int:
        """What the LR schedule counts (warmup and decay are in optimizer steps)."""
        return self.total_steps * self.optimizer_steps_per_rl_step

    @property
    def micro_batches_per_optimizer_step(self) -> int | None:
        """Fixed micro-batches per optimizer step on one DP rank (None with a token budget: by length)."""
        if self.update.max_tokens:
            return None
        return max(self.mini_batch_samples_per_dp_rank // self.update.micro_batch_size, 1)

    def dp_prompts(self, dp_rank: int, num_prompts: int | None = None) -> range:
        """DP rank ``dp_rank``'s contiguous share of a batch of ``num_prompts`` (default: a step's)."""
        return shares(self.prompts_per_step if num_prompts is None else num_prompts, self.dp)[dp_rank]


def shared_prompt_rows(cfg: RLConfig, actor: RoleLayout, *, mla: bool) -> bool:
    """``actor.use_prefix_grouper`` as set, or, null, on wherever shared-prompt rows run and pay: packed rows, several
    samples per prompt, Megatron's local attention (no Transformer Engine), CP = 1, no VPP, no sequence parallelism,
    EP = 1, no router replay, no fused LM head, no multi-latent attention (``mla``). The loss and gradients are the
    same either way (tests/parallel); each prompt is encoded once for its samples instead of once per sample."""
    a = cfg.actor_rollout_ref.actor
    if a.use_prefix_grouper is not None:
        return a.use_prefix_grouper
    m = a.megatron
    return (m.use_remove_padding and cfg.actor_rollout_ref.rollout.n > 1 and actor.cp == 1 and actor.vpp is None
            and not m.sequence_parallel and m.expert_model_parallel_size == 1 and a.router_replay.mode == "disabled"
            and not m.fused_lm_head and not mla and importlib.util.find_spec("transformer_engine") is None)


def batch_plan(cfg: RLConfig, roles: dict[str, RoleLayout], issues: list[ConfigIssue], *,
               device_type: str = "cpu", mla: bool = False, vlm: bool = False) -> BatchPlan:
    d, aor = cfg.data, cfg.actor_rollout_ref
    a, n = aor.actor, max(aor.rollout.n, 1)

    def add(key: str, value: object, message: str) -> None:
        issues.append(ConfigIssue(key=key, value=value, message=message))

    def positive(key: str, value: int) -> None:
        if value < 1:
            add(key, value, "must be ≥ 1")

    positive("data.train_batch_size", d.train_batch_size)
    positive(f"{AOR}.rollout.n", aor.rollout.n)
    sections = [("actor", f"{AOR}.actor", a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.ppo_epochs,
                 a.use_dynamic_bsz)]
    cr = cfg.critic
    if "critic" in roles:  # the actor's rules, on the critic's own sizes
        sections.append(("critic", "critic", cr.ppo_mini_batch_size, cr.ppo_micro_batch_size_per_gpu, cr.ppo_epochs,
                         cr.use_dynamic_bsz))
    for role, key, mini, micro, epochs, dynamic in sections:
        positive(f"{key}.ppo_mini_batch_size", mini)
        positive(f"{key}.ppo_micro_batch_size_per_gpu", micro)
        positive(f"{key}.ppo_epochs", epochs)
        if min(mini, micro, d.train_batch_size, aor.rollout.n) < 1:  # said above; no arithmetic on a stand-in value
            continue
        lay = roles[role]
        if d.train_batch_size % mini:
            add(f"{key}.ppo_mini_batch_size", mini, f"must divide data.train_batch_size={d.train_batch_size} (both "
                f"count prompts; valid: {divisors(d.train_batch_size)})")
        if dynamic:
            if (mini * n) % lay.dp:
                add(f"{key}.ppo_mini_batch_size", mini, f"a mini-batch of {mini} prompts × rollout.n={n} samples is "
                    f"sharded over DP={lay.dp} ranks; {mini * n} must be a multiple of {lay.dp}")
        elif (mini * n) % (micro * lay.dp):
            valid = [v for v in divisors(mini * n) if (mini * n) % (v * lay.dp) == 0]
            add(f"{key}.ppo_micro_batch_size_per_gpu", micro, f"a mini-batch of {mini} prompts × rollout.n={n} = "
                f"{mini * n} samples must split into micro-batches of {micro} on each of DP={lay.dp} ranks; "
                f"valid: {valid or 'none at this DP'}")
        elif lay.vpp and lay.pp > 1 and (mini * n // (micro * lay.dp)) % lay.pp:
            n_micro = mini * n // (micro * lay.dp)
            valid = [v for v in divisors(mini * n) if (mini * n) % (v * lay.dp * lay.pp) == 0]
            add(f"{key}.ppo_micro_batch_size_per_gpu", micro, interleaved_micro_batches_problem(lay.pp, lay.vpp)
                + f"; {mini * n} samples over DP={lay.dp} in micro-batches of {micro} make {n_micro}; "
                f"valid: {valid or 'none at this DP and PP'}")
    # prompts are generated in near-equal shares per DP rank (sizes differing by one where DP does not divide
    # data.train_batch_size); the update splits each mini-batch's samples over DP (distributed/dp_batches), as verl
    dp = roles["actor"].dp
    # a vision-language model runs padded rows (multimodal positions do not fit packed rows' one table per sequence)
    packed = a.megatron.use_remove_padding and not vlm
    shared = shared_prompt_rows(cfg, roles["actor"], mla=mla) and not vlm
    update = MicroBatching(micro_batch_size=max(a.ppo_micro_batch_size_per_gpu, 1),
                           max_tokens=a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None,
                           shared_prompts=shared, packed=packed)
    passes = {}
    subs = [("rollout", aor.rollout), ("ref", aor.ref)] + ([("teacher", aor.teacher)] if "teacher" in roles else [])
    for role, sub in subs:
        positive(f"{AOR}.{role}.log_prob_micro_batch_size_per_gpu", sub.log_prob_micro_batch_size_per_gpu)
        dynamic = a.use_dynamic_bsz if sub.log_prob_use_dynamic_bsz is None else sub.log_prob_use_dynamic_bsz
        own = None if role == "rollout" else sub.megatron.use_remove_padding  # the ref's or teacher's own layout
        passes[role] = MicroBatching(micro_batch_size=max(sub.log_prob_micro_batch_size_per_gpu, 1),
                                     max_tokens=(sub.log_prob_max_token_len_per_gpu or a.ppo_max_token_len_per_gpu)
                                     if dynamic else None, shared_prompts=shared,
                                     packed=packed if own is None else own and not vlm)
    critic = None
    if "critic" in roles:
        critic_update = MicroBatching(micro_batch_size=max(cr.ppo_micro_batch_size_per_gpu, 1),
                                      max_tokens=cr.ppo_max_token_len_per_gpu if cr.use_dynamic_bsz else None,
                                      packed=packed if cr.megatron.use_remove_padding is None
                                      else cr.megatron.use_remove_padding)
        passes["critic"] = critic_update
        mini = max(cr.ppo_mini_batch_size, 1)
        critic = CriticBatchPlan(ppo_epochs=max(cr.ppo_epochs, 1),
                                 mini_batches_per_epoch=max(d.train_batch_size // mini, 1),
                                 mini_batch_samples_per_dp_rank=mini * n // dp, update=critic_update,
                                 total_steps=max(cfg.trainer.total_training_steps or 1, 1))
    _token_budget_problems(cfg, roles["actor"], {"actor": update, **passes}, add, device_type=device_type)
    _prefix_grouper_problems(cfg, roles["actor"], add)
    _fused_lm_head_problems(cfg, add)
    filter_groups = cfg.algorithm.filter_groups.enable
    per_round = d.gen_batch_size if filter_groups and d.gen_batch_size is not None else d.train_batch_size
    return BatchPlan(n=n, prompts_per_step=max(d.train_batch_size, 1), prompts_per_generation=max(per_round, 1),
                     filter_groups=filter_groups, dp=dp, ppo_epochs=max(a.ppo_epochs, 1),
                     prompts_per_mini_batch=max(a.ppo_mini_batch_size, 1),
                     total_steps=max(cfg.trainer.total_training_steps or 1, 1), update=update,
                     old_log_prob=passes["rollout"], ref_log_prob=passes["ref"], critic=critic,
                     teacher_log_prob=passes.get("teacher"))


def _prefix_grouper_problems(cfg: RLConfig, actor: RoleLayout, add) -> None:  # type: ignore[no-untyped-def]
    """Shared-prompt rows (megatron/prefix_grouper.py) pass an explicit mask and positions per row."""
    if not cfg.actor_rollout_ref.actor.use_prefix_grouper:
        return
    key, m = f"{AOR}.actor.use_prefix_grouper", cfg.actor_rollout_ref.actor.megatron
    if actor.cp > 1:
        add(key, True, f"shared-prompt rows need whole sequences on each rank; with "
                       f"{AOR}.actor.megatron.context_parallel_size={actor.cp} set it to false (or CP to 1)")
    if actor.vpp is not None:
        add(key, True, f"shared-prompt rows differ in shape between micro-batches, which the interleaved schedule "
                       f"does not take on gloo ({AOR}.actor.megatron.virtual_pipeline_model_parallel_size="
                       f"{actor.vpp}); set it to false or the VPP size to null")
    if importlib.util.find_spec("transformer_engine") is not None:
        add(key, True, "shared-prompt rows need an explicit attention mask, which Transformer Engine's fused "
                       "attention (installed here, so Megatron uses it) does not take; set it to false")
    if m.sequence_parallel:
        add(key, True, f"not combined with {AOR}.actor.megatron.sequence_parallel=true yet; set one to false")


def _fused_lm_head_problems(cfg: RLConfig, add) -> None:  # type: ignore[no-untyped-def]
    """The fused LM head is one of the fused kernels, and reads whole sequences of hidden states."""
    m = cfg.actor_rollout_ref.actor.megatron
    if not m.fused_lm_head:
        return
    key = f"{AOR}.actor.megatron.fused_lm_head"
    if m.use_fused_kernels is False:
        add(key, True, f"it is one of the fused kernels, which {AOR}.actor.megatron.use_fused_kernels=false turns "
                       f"off; set that to null or true, or this to false")
    if m.sequence_parallel:
        add(key, True, f"not combined with {AOR}.actor.megatron.sequence_parallel=true yet (the head would need "
                       f"the sequence gathered); set one to false")


def _token_budget_problems(cfg: RLConfig, actor: RoleLayout, passes: dict[str, MicroBatching], add,  # type: ignore[no-untyped-def]
                           *, device_type: str) -> None:
    """Token budgets must hold the longest sample (prompt + response), or its micro-batch has no room."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    keys = {"actor": f"{AOR}.actor.ppo_max_token_len_per_gpu",
            "rollout": f"{AOR}.rollout.log_prob_max_token_len_per_gpu",
            "ref": f"{AOR}.ref.log_prob_max_token_len_per_gpu", "critic": "critic.ppo_max_token_len_per_gpu",
            "teacher": f"{AOR}.teacher.log_prob_max_token_len_per_gpu"}
    dynamic = [role for role, p in passes.items() if p.max_tokens]
    padded = [role for role in dynamic if not passes[role].packed]  # packed rows: one length per pass on gloo
    if actor.vpp is not None and padded and device_type == "cpu":
        add(f"{AOR}.actor.megatron.virtual_pipeline_model_parallel_size", actor.vpp,
            f"padded token-budget micro-batches (use_dynamic_bsz, on for: {', '.join(padded)}; use_remove_padding "
            f"off) with the interleaved pipeline schedule are {VPP_DYNAMIC_UNSUPPORTED}")
    for role in dynamic:
        budget = passes[role].max_tokens
        if budget is not None and budget < longest:
            add(keys[role], budget, f"the token budget per micro-batch must hold the longest sample: "
                                    f"data.max_prompt_length + data.max_response_length = {longest} or more")
