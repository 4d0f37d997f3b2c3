"""Static validation: the whole config is checked before any model or engine is built.

Every rule appends ``ConfigIssue``s instead of raising, so one run reports all violations at once.
Reads only config files, the checkpoint's ``config.json`` and plugin classes (which import torch,
never Megatron or an engine).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.model_info import ModelInfo, inspect_model_dir
from hybridrl.config.schema import MegatronConfig, OptimConfig, RLConfig
from hybridrl.config.sft_schema import SFTConfig
from hybridrl.config.topology import RoleLayout, Topology, ref_needed, world_size_of
from hybridrl.megatron.dynamic_batch import VPP_DYNAMIC_UNSUPPORTED
from hybridrl.registry import PluginError, Registry

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl", "abs")
OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
LOGGERS = ("console", "jsonl", "wandb", "tensorboard")
DEVICES = ("auto", "cpu", "cuda")
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")

AOR = "actor_rollout_ref"


class _Issues(list[ConfigIssue]):
    def add(self, key: str, value: object, message: str) -> None:
        self.append(ConfigIssue(key=key, value=value, message=message))

    def positive(self, key: str, value: int | float) -> None:
        if value < 1:
            self.add(key, value, "must be ≥ 1")


def validate(cfg: RLConfig, *, world_size: int | None = None, before_bootstrap: bool = False,
             model_config: Path | None = None) -> Topology:
    """Check ``cfg`` for a run on ``world_size`` ranks; return its topology or raise ConfigError.

    ``before_bootstrap``: a model or data file that the config builds when missing
    (``build_if_missing``) may not exist yet; the checks that need it are skipped.
    ``model_config``: plan a run on another machine: take the architecture from this config.json
    instead of the model directory, and skip every check of local files (weights, tokenizer, data).
    """
    issues = _Issues()
    world = world_size if world_size is not None else world_size_of(cfg)
    if world < 1:
        issues.add("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node, "world size must be ≥ 1")
        world = 1
    aor = cfg.actor_rollout_ref
    m = aor.model
    pending_model = before_bootstrap and m.build_if_missing is not None and not Path(m.path).exists()
    if model_config is not None:
        model = ModelInfo.from_config_json(model_config)
    else:
        model = None if pending_model else _check_model(cfg, issues)

    roles = {"actor": (f"{AOR}.actor.megatron", aor.actor.megatron)}
    if ref_needed(cfg):
        roles["ref"] = (f"{AOR}.ref.megatron", aor.ref.megatron)
    if cfg.critic.enable:
        roles["critic"] = ("critic.megatron", cfg.critic.megatron)
        issues.add("critic.enable", True, "the critic (value model for PPO/GAE) is not implemented in this "
                                          "version; use a critic-free estimator (grpo, rloo, reinforce_pp)")
    layouts = {name: _check_parallel(key, m, world, model, issues) for name, (key, m) in roles.items()}
    for name, (key, m) in roles.items():  # one Megatron parallel_state per process: same layout
        for size in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "virtual_pipeline_model_parallel_size", "context_parallel_size"):
            if name != "actor" and getattr(m, size) != getattr(aor.actor.megatron, size):
                issues.add(f"{key}.{size}", getattr(m, size),
                           f"must equal {AOR}.actor.megatron.{size}={getattr(aor.actor.megatron, size)} "
                           f"(the {name} shares the actor's Megatron process groups)")
    _check_rollout(cfg, world, model, issues)
    steps = cfg.trainer.total_training_steps * aor.actor.ppo_epochs * max(
        cfg.data.train_batch_size // max(aor.actor.ppo_mini_batch_size, 1), 1)
    _check_optim(f"{AOR}.actor.optim", aor.actor.optim, aor.actor.megatron, issues, optimizer_steps=steps)
    if cfg.critic.enable:
        _check_optim("critic.optim", cfg.critic.optim, cfg.critic.megatron, issues, optimizer_steps=steps)
    batch = _check_batches(cfg, layouts, issues)
    _check_algorithm(cfg, issues)
    _check_plugins(cfg, issues)
    _check_lengths(cfg, model, issues)
    _check_data(cfg, issues, pending=model_config is not None or (
        before_bootstrap and cfg.data.build_if_missing is not None))
    _check_trainer(cfg, issues, planning=model_config is not None)
    if issues:
        raise ConfigError(list(issues))
    return Topology(world_size=world, roles=layouts, rollout_tp=aor.rollout.tensor_model_parallel_size,
                    model=model, **batch)


def _check_model(cfg: RLConfig, issues: _Issues) -> ModelInfo | None:
    m = cfg.actor_rollout_ref.model
    info, problems = inspect_model_dir(m.path, tokenizer_path=m.tokenizer_path)
    for p in problems:
        key = f"{AOR}.model.tokenizer_path" if m.tokenizer_path and "tokenizer" in p else f"{AOR}.model.path"
        issues.add(key, m.tokenizer_path if key.endswith("tokenizer_path") else m.path, p)
    if cfg.critic.enable and cfg.critic.model_path:
        _, critic_problems = inspect_model_dir(cfg.critic.model_path)
        for p in critic_problems:
            issues.add("critic.model_path", cfg.critic.model_path, p)
    return info


def _check_parallel(key: str, m: MegatronConfig, world: int, model: ModelInfo | None,
                    issues: _Issues) -> RoleLayout:
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    for name, v in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                    ("context_parallel_size", cp)):
        issues.positive(f"{key}.{name}", v)
    tp, pp, cp = max(tp, 1), max(pp, 1), max(cp, 1)
    if world % (tp * pp * cp):
        valid_tp = _divisors(world // (pp * cp)) if world % (pp * cp) == 0 else []
        issues.add(f"{key}.tensor_model_parallel_size", tp,
                   f"TP×PP×CP = {tp}×{pp}×{cp} = {tp * pp * cp} must divide the world size {world} "
                   f"(valid TP for PP={pp}, CP={cp}: {valid_tp})")
    if model is not None:
        if model.num_heads % tp:
            issues.add(f"{key}.tensor_model_parallel_size", tp,
                       f"must divide the model's {model.num_heads} attention heads "
                       f"(valid: {_divisors(model.num_heads)})")
        if model.num_kv_heads % tp:
            issues.add(f"{key}.tensor_model_parallel_size", tp,
                       f"must divide the model's {model.num_kv_heads} KV heads (GQA groups) "
                       f"(valid: {_divisors(model.num_kv_heads)})")
        if model.num_layers % pp:
            issues.add(f"{key}.pipeline_model_parallel_size", pp,
                       f"must divide the model's {model.num_layers} layers (valid: {_divisors(model.num_layers)})")
    _check_virtual_pipeline(key, m, model, issues)
    if m.sequence_parallel and tp == 1:
        issues.add(f"{key}.sequence_parallel", True, "needs tensor_model_parallel_size > 1")
    if m.sequence_parallel and importlib.util.find_spec("transformer_engine") is None:
        issues.add(f"{key}.sequence_parallel", True,
                   "needs Transformer Engine (Megatron's torch-norm fallback does not support it); set false")
    return RoleLayout.of(m, world)


def _check_virtual_pipeline(key: str, m: MegatronConfig, model: ModelInfo | None, issues: _Issues) -> None:
    """Megatron's rules for the interleaved schedule (parallel_state, TransformerConfig)."""
    vpp, pp = m.virtual_pipeline_model_parallel_size, max(m.pipeline_model_parallel_size, 1)
    if vpp is None:
        return
    if vpp < 2:
        issues.add(f"{key}.virtual_pipeline_model_parallel_size", vpp,
                   "must be null (one model chunk per stage, plain 1F1B) or ≥ 2 chunks per stage")
    if pp < 2:
        issues.add(f"{key}.virtual_pipeline_model_parallel_size", vpp,
                   f"the interleaved schedule needs pipeline_model_parallel_size ≥ 2 (it is {pp}); "
                   "set null or raise PP")
    if model is not None and vpp >= 1 and model.num_layers % (pp * vpp):
        per_stage = model.num_layers // pp if model.num_layers % pp == 0 else 0
        valid = [v for v in _divisors(per_stage) if v >= 2]
        issues.add(f"{key}.virtual_pipeline_model_parallel_size", vpp,
                   f"PP×VPP = {pp}×{vpp} = {pp * vpp} must divide the model's {model.num_layers} layers "
                   f"(each chunk holds equal layers); valid at PP={pp}: null or {valid or 'none'}")


def _check_interleaved_micro_batches(key: str, micro: int, samples: int, lay: RoleLayout,
                                     issues: _Issues) -> None:
    """Megatron's interleaved schedule (0.16.1, ``forward_backward_pipelining_with_interleaving``) runs
    micro-batches in groups of ``microbatch_group_size_per_vp_stage`` (default PP) and refuses a count
    that is not a multiple of it. Log-prob passes are padded by the policy; optimizer steps can't be."""
    if not lay.vpp or lay.pp < 2:
        return
    n_micro = samples // (micro * lay.dp)
    if n_micro % lay.pp:
        valid = [v for v in _divisors(samples) if samples % (v * lay.dp * lay.pp) == 0]
        issues.add(key, micro,
                   f"the interleaved pipeline schedule (virtual_pipeline_model_parallel_size={lay.vpp}) needs a "
                   f"multiple of PP={lay.pp} micro-batches per optimizer step; {samples} samples over DP={lay.dp} "
                   f"in micro-batches of {micro} make {n_micro}; valid: {valid or 'none at this DP and PP'}")


def _check_rollout(cfg: RLConfig, world: int, model: ModelInfo | None, issues: _Issues) -> None:
    r, key = cfg.actor_rollout_ref.rollout, f"{AOR}.rollout"
    issues.positive(f"{key}.n", r.n)
    issues.positive(f"{key}.tensor_model_parallel_size", r.tensor_model_parallel_size)
    issues.positive(f"{key}.update_weights_bucket_megabytes", r.update_weights_bucket_megabytes)
    tp = max(r.tensor_model_parallel_size, 1)
    if world % tp:
        issues.add(f"{key}.tensor_model_parallel_size", tp,
                   f"must divide the world size {world} (engines are colocated; valid: {_divisors(world)})")
    if model is not None and model.num_heads % tp:
        issues.add(f"{key}.tensor_model_parallel_size", tp,
                   f"must divide the model's {model.num_heads} attention heads (valid: {_divisors(model.num_heads)})")
    for sub, t, p, k in (("", r.temperature, r.top_p, r.top_k),
                         (".val_kwargs", r.val_kwargs.temperature, r.val_kwargs.top_p, r.val_kwargs.top_k)):
        if t < 0:
            issues.add(f"{key}{sub}.temperature", t, "must be ≥ 0 (0 = greedy)")
        if not 0 < p <= 1:
            issues.add(f"{key}{sub}.top_p", p, "must be in (0, 1]")
        if k == 0 or k < -1:
            issues.add(f"{key}{sub}.top_k", k, "must be -1 (off) or ≥ 1")
    issues.positive(f"{key}.val_kwargs.n", r.val_kwargs.n)


def _check_optim(key: str, o: OptimConfig, m: MegatronConfig, issues: _Issues, *, optimizer_steps: int) -> None:
    if o.lr_warmup_steps < 0 or (o.lr_warmup_steps and o.lr_warmup_steps >= optimizer_steps):
        issues.add(f"{key}.lr_warmup_steps", o.lr_warmup_steps,
                   f"must be ≥ 0 and below the run's {optimizer_steps} optimizer steps")
    if o.optimizer not in OPTIMIZERS:
        issues.add(f"{key}.optimizer", o.optimizer, f"valid: {', '.join(OPTIMIZERS)}")
    if o.lr < 0:
        issues.add(f"{key}.lr", o.lr, "must be ≥ 0")
    if o.clip_grad < 0:
        issues.add(f"{key}.clip_grad", o.clip_grad, "must be ≥ 0 (0 disables clipping)")
    if o.lr_decay_style not in LR_DECAY_STYLES:
        issues.add(f"{key}.lr_decay_style", o.lr_decay_style, f"valid: {', '.join(LR_DECAY_STYLES)}")
    if m.use_distributed_optimizer and o.optimizer != "adam":
        issues.add(f"{key}.optimizer", o.optimizer,
                   "Megatron's distributed optimizer supports adam only "
                   "(or set megatron.use_distributed_optimizer=false)")


def _check_batches(cfg: RLConfig, layouts: dict[str, RoleLayout], issues: _Issues) -> dict[str, int]:
    d, a, n = cfg.data, cfg.actor_rollout_ref.actor, max(cfg.actor_rollout_ref.rollout.n, 1)
    issues.positive("data.train_batch_size", d.train_batch_size)
    issues.positive("data.val_batch_size", d.val_batch_size)
    roles = [("actor", f"{AOR}.actor", a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.ppo_epochs)]
    if cfg.critic.enable:
        c = cfg.critic
        roles.append(("critic", "critic", c.ppo_mini_batch_size, c.ppo_micro_batch_size_per_gpu, c.ppo_epochs))
    for role, key, mini, micro, epochs in roles:
        issues.positive(f"{key}.ppo_mini_batch_size", mini)
        issues.positive(f"{key}.ppo_micro_batch_size_per_gpu", micro)
        issues.positive(f"{key}.ppo_epochs", epochs)
        if min(mini, micro, d.train_batch_size) < 1:
            continue
        dp = layouts[role].dp
        if d.train_batch_size % mini:
            issues.add(f"{key}.ppo_mini_batch_size", mini,
                       f"must divide data.train_batch_size={d.train_batch_size} (both count prompts; "
                       f"valid: {_divisors(d.train_batch_size)})")
        if role == "actor" and a.use_dynamic_bsz:
            if (mini * n) % dp:
                issues.add(f"{key}.ppo_mini_batch_size", mini,
                           f"a mini-batch of {mini} prompts × rollout.n={n} samples is sharded over DP={dp} "
                           f"ranks; {mini * n} must be a multiple of {dp}")
        elif (mini * n) % (micro * dp):
            issues.add(f"{key}.ppo_micro_batch_size_per_gpu", micro,
                       f"a mini-batch of {mini} prompts × rollout.n={n} = {mini * n} samples must split into "
                       f"micro-batches of {micro} on each of DP={dp} ranks; valid: "
                       f"{[v for v in _divisors(mini * n) if (mini * n) % (v * dp) == 0] or 'none at this DP'}")
        else:
            _check_interleaved_micro_batches(f"{key}.ppo_micro_batch_size_per_gpu", micro, mini * n,
                                             layouts[role], issues)
    dp_actor = layouts["actor"].dp
    if d.train_batch_size >= 1 and d.train_batch_size % dp_actor:
        issues.add("data.train_batch_size", d.train_batch_size,
                   f"prompts are sharded over the actor's DP={dp_actor} ranks; must be a multiple of {dp_actor}")
    issues.positive(f"{AOR}.ref.log_prob_micro_batch_size_per_gpu",
                    cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu)
    issues.positive(f"{AOR}.rollout.log_prob_micro_batch_size_per_gpu",
                    cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu)
    _check_dynamic_bsz(cfg, issues)
    mini = max(a.ppo_mini_batch_size, 1)
    micro = max(a.ppo_micro_batch_size_per_gpu, 1)
    return {
        "prompts_per_step": d.train_batch_size,
        "samples_per_step": d.train_batch_size * n,
        "mini_batches_per_epoch": max(d.train_batch_size // mini, 1),
        "samples_per_mini_batch": mini * n,
        "grad_accum_steps": max(mini * n // (micro * dp_actor), 1),
        "micro_batch_token_budget": a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None,
    }


def _check_dynamic_bsz(cfg: RLConfig, issues: _Issues) -> None:
    """Token budgets must hold the longest sample (prompt + response), or its micro-batch has no room."""
    aor, longest = cfg.actor_rollout_ref, cfg.data.max_prompt_length + cfg.data.max_response_length
    budgets = [(f"{AOR}.actor.ppo_max_token_len_per_gpu", aor.actor.use_dynamic_bsz,
                aor.actor.ppo_max_token_len_per_gpu)]
    for role, sub in (("rollout", aor.rollout), ("ref", aor.ref)):
        budgets.append((f"{AOR}.{role}.log_prob_max_token_len_per_gpu",
                        aor.actor.use_dynamic_bsz if sub.log_prob_use_dynamic_bsz is None
                        else sub.log_prob_use_dynamic_bsz,
                        sub.log_prob_max_token_len_per_gpu or aor.actor.ppo_max_token_len_per_gpu))
    vpp = aor.actor.megatron.virtual_pipeline_model_parallel_size
    dynamic = [key.rsplit(".", 2)[1] for key, enabled, _ in budgets if enabled]
    if vpp is not None and dynamic:
        issues.add(f"{AOR}.actor.megatron.virtual_pipeline_model_parallel_size", vpp,
                   f"token-budget micro-batches (use_dynamic_bsz, on for: {', '.join(dynamic)}) with the "
                   f"interleaved pipeline schedule are {VPP_DYNAMIC_UNSUPPORTED}")
    for key, enabled, budget in budgets:
        if enabled and budget < longest:
            issues.add(key, budget, f"the token budget per micro-batch must hold the longest sample: "
                                    f"data.max_prompt_length + data.max_response_length = {longest} or more")


def _check_algorithm(cfg: RLConfig, issues: _Issues) -> None:
    a, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    if a.loss_agg_mode not in LOSS_AGG_MODES:
        issues.add(f"{AOR}.actor.loss_agg_mode", a.loss_agg_mode, f"valid: {', '.join(LOSS_AGG_MODES)}")
    if a.kl_loss_type not in KL_TYPES:
        issues.add(f"{AOR}.actor.kl_loss_type", a.kl_loss_type, f"valid: {', '.join(KL_TYPES)}")
    if alg.kl_penalty not in KL_TYPES:
        issues.add("algorithm.kl_penalty", alg.kl_penalty, f"valid: {', '.join(KL_TYPES)}")
    if a.kl_loss_coef < 0:
        issues.add(f"{AOR}.actor.kl_loss_coef", a.kl_loss_coef, "must be ≥ 0")
    if alg.kl_coef < 0:
        issues.add("algorithm.kl_coef", alg.kl_coef, "must be ≥ 0")
    if cfg.actor_rollout_ref.ref.enable is False:
        kl_terms = ((f"{AOR}.actor.use_kl_loss", a.use_kl_loss), ("algorithm.use_kl_in_reward", alg.use_kl_in_reward))
        for key, on in kl_terms:
            if on:
                issues.add(key, True, f"a KL term needs the reference model, but {AOR}.ref.enable=false; "
                                      f"enable the ref (or leave it null) or turn the KL term off")


def _check_plugins(cfg: RLConfig, issues: _Issues) -> None:
    r, alg = cfg.actor_rollout_ref.rollout, cfg.algorithm
    chosen = [
        ("rollout_engines", f"{AOR}.rollout.name", r.name, f"{AOR}.rollout.engine_kwargs", r.engine_kwargs),
        ("reward_managers", "reward.name", cfg.reward.name, "reward.kwargs", cfg.reward.kwargs),
        ("advantage_estimators", "algorithm.adv_estimator", alg.adv_estimator,
         "algorithm.adv_estimator_kwargs", alg.adv_estimator_kwargs),
        ("policy_losses", "algorithm.policy_loss", alg.policy_loss,
         "algorithm.policy_loss_kwargs", alg.policy_loss_kwargs),
    ]
    for group, name_key, name, kwargs_key, kwargs in chosen:
        reg = Registry(group)
        try:
            cls = reg.load(name, key=name_key)
        except PluginError as e:
            issues.add(name_key, name, str(e).removeprefix(f"{name_key}={name!r}: "))
            continue
        try:
            reg.make_config(name, kwargs, key=kwargs_key)
        except PluginError as e:
            issues.add(kwargs_key, dict(kwargs), str(e))
        if group == "rollout_engines" and r.tensor_model_parallel_size > 1 and not getattr(
                cls, "supports_tensor_parallel", True):
            issues.add(f"{AOR}.rollout.tensor_model_parallel_size", r.tensor_model_parallel_size,
                       f"rollout engine {name!r} runs one engine per rank; use 1 (or an engine with TP, e.g. sglang)")
        if group == "advantage_estimators":
            if getattr(cls, "needs_group", False) and r.n < 2:
                issues.add(f"{AOR}.rollout.n", r.n,
                           f"advantage estimator {name!r} compares samples of one prompt: needs rollout.n ≥ 2")
            if getattr(cls, "needs_critic", False) and not cfg.critic.enable:
                issues.add("critic.enable", False,
                           f"advantage estimator {name!r} needs a critic: set critic.enable=true")


def _check_lengths(cfg: RLConfig, model: ModelInfo | None, issues: _Issues) -> None:
    d = cfg.data
    issues.positive("data.max_prompt_length", d.max_prompt_length)
    issues.positive("data.max_response_length", d.max_response_length)
    if model is not None and d.max_prompt_length + d.max_response_length > model.max_position_embeddings:
        issues.add("data.max_response_length", d.max_response_length,
                   f"data.max_prompt_length + data.max_response_length = "
                   f"{d.max_prompt_length + d.max_response_length} exceeds the model's max_position_embeddings "
                   f"{model.max_position_embeddings}; at most {model.max_position_embeddings - d.max_prompt_length}")


def _check_data(cfg: RLConfig, issues: _Issues, *, pending: bool = False) -> None:
    d = cfg.data
    check_files(issues, "data", d.train_files, d.val_files, pending=pending)


def check_files(issues: _Issues, prefix: str, train_files: list[str], val_files: list[str], *,
                pending: bool) -> None:
    if not train_files:
        issues.add(f"{prefix}.train_files", list(train_files), "needs at least one parquet or jsonl file")
    for key, files in ((f"{prefix}.train_files", train_files), (f"{prefix}.val_files", val_files)):
        for f in files:
            if not Path(f).is_file() and not pending:
                issues.add(key, f, "file does not exist")
            elif Path(f).suffix not in DATA_SUFFIXES:
                issues.add(key, f, f"unsupported file type; valid: {', '.join(DATA_SUFFIXES)}")


def _check_trainer(cfg: RLConfig, issues: _Issues, *, planning: bool = False) -> None:
    t = cfg.trainer
    issues.positive("trainer.total_training_steps", t.total_training_steps)
    issues.positive("trainer.nnodes", t.nnodes)
    issues.positive("trainer.n_gpus_per_node", t.n_gpus_per_node)
    if t.test_freq < 0:
        issues.add("trainer.test_freq", t.test_freq, "must be ≥ 0 (0 = never)")
    if t.save_every < 0:
        issues.add("trainer.save_every", t.save_every, "must be ≥ 0 (0 = never)")
    if t.max_checkpoints_to_keep < 0:
        issues.add("trainer.max_checkpoints_to_keep", t.max_checkpoints_to_keep, "must be ≥ 0 (0 = keep all)")
    if t.resume not in ("auto", "never") and not (Path(t.resume) / "trainer_state.pt").is_file():
        issues.add("trainer.resume", t.resume, "valid: auto, never, or a complete checkpoint dir "
                                               "(<output_dir>/checkpoints/step_<k>, holding trainer_state.pt)")
    bad = [lg for lg in t.loggers if lg not in LOGGERS]
    if bad:
        issues.add("trainer.loggers", list(t.loggers), f"unknown logger(s) {bad}; valid: {', '.join(LOGGERS)}")
    if t.device not in DEVICES:
        issues.add("trainer.device", t.device, f"valid: {', '.join(DEVICES)}")
    elif t.device == "cuda" and not planning:  # planning for another machine: its GPUs are not here
        import torch

        if not torch.cuda.is_available():
            issues.add("trainer.device", t.device, "no CUDA device is visible; use cpu or auto")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n >= 1 else []



def validate_sft(cfg: SFTConfig, *, world_size: int | None = None, before_bootstrap: bool = False) -> RoleLayout:
    """Static checks of an SFT run (the subset of ``validate`` that applies); returns its layout."""
    issues = _Issues()
    world = world_size if world_size is not None else cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    m = cfg.model
    model = None
    if not (before_bootstrap and m.build_if_missing is not None and not Path(m.path).exists()):
        model, problems = inspect_model_dir(m.path, tokenizer_path=m.tokenizer_path)
        for p in problems:
            issues.add("model.path", m.path, p)
    layout = _check_parallel("megatron", cfg.megatron, world, model, issues)
    _check_optim("optim", cfg.optim, cfg.megatron, issues, optimizer_steps=cfg.trainer.total_training_steps)
    d = cfg.data
    issues.positive("data.train_batch_size", d.train_batch_size)
    issues.positive("data.micro_batch_size_per_gpu", d.micro_batch_size_per_gpu)
    if min(d.train_batch_size, d.micro_batch_size_per_gpu) >= 1 and d.train_batch_size % (
            d.micro_batch_size_per_gpu * layout.dp):
        issues.add("data.micro_batch_size_per_gpu", d.micro_batch_size_per_gpu,
                   f"data.train_batch_size={d.train_batch_size} must split into micro-batches of this size on "
                   f"each of DP={layout.dp} ranks")
    elif min(d.train_batch_size, d.micro_batch_size_per_gpu) >= 1:
        _check_interleaved_micro_batches("data.micro_batch_size_per_gpu", d.micro_batch_size_per_gpu,
                                         d.train_batch_size, layout, issues)
    if model is not None and d.max_prompt_length + d.max_response_length > model.max_position_embeddings:
        issues.add("data.max_response_length", d.max_response_length,
                   f"prompt + response lengths exceed the model's {model.max_position_embeddings} positions")
    check_files(issues, "data", d.train_files, d.val_files,
                pending=before_bootstrap and d.build_if_missing is not None)
    issues.positive("trainer.total_training_steps", cfg.trainer.total_training_steps)
    if issues:
        raise ConfigError(list(issues))
    return layout
