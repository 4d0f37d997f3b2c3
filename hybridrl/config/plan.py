"""The run's plan: who does what, where, and in which batch sizes — computed once, before anything heavy.

``Plan.build(cfg, world_size=...)`` derives from the config and the world size (and the checkpoint's
architecture, when known):

- **roles**: each Megatron role's layout (actor; the ref and the critic, which share the actor's
  process groups) and every rank's coordinates in it (Megatron's rank order, tp fastest, then cp, dp, pp;
  :mod:`hybridrl.config.layout`);
- **placement** of the colocated rollout engines and the devices each owns;
- **batches**: each DP rank's share of a step's prompts, mini-batches and optimizer steps per RL step
  (and over the run), micro-batches of the update and of the two log-prob passes (fixed sizes or
  token budgets; :mod:`hybridrl.config.batch_plan`).

Static validation builds it and reports its problems with every other one; ``hybridrl validate`` and
the start-up banner print it (:meth:`Plan.render`); the runtime reads it — the rollout places
and feeds the engines, the policy cuts micro-batches, the LR scheduler counts optimizer steps — so
what is printed is what runs.

**Placement rule.** One engine per ``rollout.tensor_model_parallel_size`` (rollout TP) consecutive
ranks, colocated on those ranks' devices (``cuda:<local rank>``; ``cpu`` on a CPU machine); the
group's first rank starts it, and it spans the group's devices (SGLang's ``tp_size`` from a base
device). Every rank belongs to exactly one engine, so every device generates — whatever the actor's
layout (verl's rule: rollout DP = world / rollout TP, independent of the trainer's parallelism).
Rollout TP must therefore divide the world size and the ranks per node (an engine's devices are on
one node). A step's prompts are split over the engines in contiguous, nearly equal shares; each rank
then trains on its DP rank's contiguous share of the samples, whichever engine made them. Sampling
is seeded per prompt, so the samples do not depend on this split (the same rollouts at any layout).

**Disaggregated** (``rollout.placement=disaggregated``, ``rollout.num_ranks`` = k): the last k ranks of the
launched world run the engines (one per rollout-TP group of them) and nothing else; the first W − k ranks
train, and the trainer's layout (TP/PP/CP/DP) spans only those. Prompts and samples travel between the two
groups over a bridge group (:mod:`hybridrl.rollout.disaggregated`).

**Teacher engines** (``actor_rollout_ref.teacher.inference.name`` set, ``inference.num_ranks`` = m): the last m
ranks of the launch (after a disaggregated rollout's) serve the distillation teacher with that engine, one per
``inference.tensor_model_parallel_size`` of them, and nothing else; the rollout and the trainer are placed over the
first W − m ranks as above (:mod:`hybridrl.rollout.teacher_service`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridrl.config.batch_plan import BatchPlan, batch_plan
from hybridrl.config.errors import ConfigIssue
from hybridrl.config.layout import AOR, RoleLayout, shares
from hybridrl.config.memory import BYTES, GB, MemoryEstimate, engine_weight_bytes
from hybridrl.config.memory import estimate as estimate_memory
from hybridrl.config.schema import RLConfig
from hybridrl.hf.arch import HFArch
from hybridrl.hf.vlm import vision_parameters
from hybridrl.interfaces import EngineMemory
from hybridrl.lora.config import resolve_targets
from hybridrl.megatron.config import (
    divisors,
)
from hybridrl.megatron.optimizer_overrides import host_fraction, precision_aware


@dataclass(frozen=True, slots=True, kw_only=True)
class EnginePlacement:
    index: int
    ranks: tuple[int, ...]  # consecutive; the first (the leader) starts the engine
    devices: tuple[str, ...]  # the ranks' devices, which the engine owns while it generates

    @property
    def leader(self) -> int:
        return self.ranks[0]

    def __str__(self) -> str:
        return f"engine {self.index}: ranks {list(self.ranks)} devices [{', '.join(self.devices)}]"


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    config: RLConfig = field(repr=False, compare=False)  # validate()'s derived copy: what the run uses
    world_size: int
    ranks_per_node: int
    device_type: str  # cpu | cuda
    roles: dict[str, RoleLayout]  # actor, ref and critic (when built)
    rollout_tp: int
    engines: tuple[EnginePlacement, ...]
    batch: BatchPlan
    model: HFArch | None = None
    memory: MemoryEstimate | None = None  # the largest trainer rank's device memory (needs the model)
    notes: list[str] = field(default_factory=list)
    placement: str = "colocated"  # actor_rollout_ref.rollout.placement
    num_engine_ranks: int = 0  # disaggregated: the last ranks of the world, which run the engines only
    num_teacher_ranks: int = 0  # a teacher on engines of its own: the very last ranks (teacher.inference)
    teacher_engines: tuple[EnginePlacement, ...] = ()
    teacher_model: HFArch | None = None  # the distillation teacher's architecture (actor_rollout_ref.teacher)
    waits_for_build: bool = False  # validate(before_bootstrap=True): a file the run builds first was not checked

    @property
    def trainer_world_size(self) -> int:
        """The ranks that train (Megatron's world): all of them when colocated."""
        return self.world_size - self.num_engine_ranks - self.num_teacher_ranks

    def is_engine_rank(self, rank: int) -> bool:
        """Whether ``rank`` (of the launched world) runs a rollout engine only (disaggregated placement)."""
        return self.trainer_world_size <= rank < self.world_size - self.num_teacher_ranks

    def is_teacher_rank(self, rank: int) -> bool:
        """Whether ``rank`` serves the distillation teacher only (``teacher.inference.name`` set)."""
        return rank >= self.world_size - self.num_teacher_ranks

    def teacher_engine_of(self, rank: int) -> EnginePlacement:
        return next(e for e in self.teacher_engines if rank in e.ranks)

    @classmethod
    def build(cls, cfg: RLConfig, *, world_size: int, device_type: str, model: HFArch | None = None,
              ranks_per_node: int | None = None,
              teacher_model: HFArch | None = None) -> tuple[Plan, list[ConfigIssue]]:
        """The plan and every problem with it (layouts it cannot place, batch sizes that do not split);
        ``teacher_model``: the distillation teacher's architecture, for the memory estimate."""
        issues: list[ConfigIssue] = []
        aor, world = cfg.actor_rollout_ref, max(world_size, 1)
        per_node = ranks_per_node or max(world // max(cfg.trainer.nnodes, 1), 1)
        teacher_ranks = teacher_engine_ranks(cfg, world)
        world_size, world = world, world - teacher_ranks  # the rollout and the trainer share the first ranks
        engine_ranks = disaggregated_ranks(cfg, world)
        trainers = world - engine_ranks
        roles = {"actor": RoleLayout.of(aor.actor.megatron, trainers)}
        if ref_needed(cfg):
            roles["ref"] = roles["actor"]  # one Megatron parallel_state per process: the actor's
        if critic_needed(cfg):
            roles["critic"] = roles["actor"]  # likewise
        if aor.teacher.enabled and not aor.teacher.inference.on_engine:
            roles["teacher"] = roles["actor"]  # likewise
        rtp = max(aor.rollout.tensor_model_parallel_size, 1)
        issues += _placement_problems(cfg, world=world, per_node=per_node, model=model)
        first, span = (trainers, engine_ranks) if engine_ranks else (0, world)
        engines = tuple(
            EnginePlacement(index=e, ranks=tuple(first + r for r in ranks),
                            devices=tuple(_device(device_type, first + r, per_node) for r in ranks))
            for e, ranks in enumerate(shares(span, span // rtp)) if span % rtp == 0)
        ttp = max(aor.teacher.inference.tensor_model_parallel_size, 1)
        teacher_engines = tuple(
            EnginePlacement(index=e, ranks=tuple(world + r for r in ranks),
                            devices=tuple(_device(device_type, world + r, per_node) for r in ranks))
            for e, ranks in enumerate(shares(teacher_ranks, teacher_ranks // ttp)
                                      if teacher_ranks and teacher_ranks % ttp == 0 else []))
        batch = batch_plan(cfg, roles, issues, device_type=device_type, mla=model is not None and model.mla is not None,
                           vlm=model is not None and model.vision is not None)
        memory, engine_note = None, ""
        if model is not None:
            memory = _memory(cfg, roles, batch, model, rtp, len(engines), device_type, teacher_model)
            if engine_ranks:  # a trainer rank holds no engine; an engine rank nothing else
                engine_note = (f"an engine rank holds its engine only, estimated: weights "
                               f"{memory.engine_weights / GB:.1f} GB + KV {memory.engine_kv / GB:.1f} GB")
                memory = replace(memory, engine_weights=0.0, engine_kv=0.0, engine_kept=0.0, pooled=False)
        plan = cls(config=cfg, world_size=world_size, ranks_per_node=per_node, device_type=device_type, roles=roles,
                   rollout_tp=rtp, engines=engines, batch=batch, model=model, memory=memory,
                   placement="disaggregated" if engine_ranks else "colocated", num_engine_ranks=engine_ranks,
                   teacher_model=teacher_model if aor.teacher.enabled else None,
                   num_teacher_ranks=teacher_ranks, teacher_engines=teacher_engines)
        if engine_ranks and model is not None:
            plan.notes.append(engine_note)
        if teacher_ranks and teacher_model is not None:
            plan.notes.append(teacher_engine_note(cfg, teacher_model, ttp))
        if model is not None and model.fp8_blocks is not None:
            plan.notes.append(fp8_engine_note(model, rtp))
        return plan, issues

    # ---- what the runtime reads ----
    def device_of(self, rank: int) -> str:
        return _device(self.device_type, rank, self.ranks_per_node)

    def dp_rank_of(self, rank: int) -> int:
        return self.roles["actor"].coords(rank)["dp"]

    def engine_of(self, rank: int) -> EnginePlacement:
        """The engine ``rank`` belongs to (disaggregated: engine ranks only)."""
        first = self.trainer_world_size if self.num_engine_ranks else 0
        if rank < first:
            raise ValueError(f"rank {rank} trains; the engines run on ranks {first}..{self.world_size - 1}")
        return self.engines[(rank - first) // self.rollout_tp]

    def engine_prompts(self, engine: int, num_prompts: int) -> range:
        """The positions of a batch of ``num_prompts`` prompts that engine ``engine`` generates."""
        return shares(num_prompts, len(self.engines))[engine]

    # ---- what is printed ----
    def render(self) -> str:
        b = self.batch
        lines = [f"world_size: {self.world_size} ({self.ranks_per_node} per node, {self.device_type})"]
        lines += [f"{role:<7} {lay}" for role, lay in self.roles.items()]
        if self.num_engine_ranks:
            t = self.trainer_world_size
            lines.append(f"rollout {len(self.engines)} engine(s) × TP={self.rollout_tp}, disaggregated: ranks "
                         f"{t}..{self.world_size - 1} run engines only, ranks 0..{t - 1} train (the layout above "
                         f"spans those {t}); samples and weights cross over a gloo bridge")
        else:
            lines.append(f"rollout {len(self.engines)} engine(s) × TP={self.rollout_tp}, colocated: each takes "
                         f"{self.rollout_tp} consecutive rank(s) and their devices; its first rank starts it")
        lines += [f"  {e}" for e in self.engines]
        if self.teacher_engines:
            i = self.config.actor_rollout_ref.teacher.inference
            lines.append(f"teacher {len(self.teacher_engines)} {i.name} engine(s) × TP={i.tensor_model_parallel_size} "
                         f"on ranks {self.world_size - self.num_teacher_ranks}..{self.world_size - 1} of their own: "
                         "they score each step's samples (token ids over a gloo bridge)")
            lines += [f"  {e}" for e in self.teacher_engines]
        for what, m in (("model  ", self.model), ("teacher", self.teacher_model)):
            if m is not None:
                lines.append(f"{what} {m.family}: {m.num_layers} layers, hidden {m.hidden_size}, heads "
                             f"{m.num_attention_heads} (kv {m.num_query_groups}), vocab {m.vocab_size}, max positions "
                             f"{m.max_position_embeddings}, tied embeddings: {m.tie_word_embeddings}")
        if self.model is not None:
            m = self.model
            if m.moe is not None:
                ep = self.roles["actor"].ep if "actor" in self.roles else 1
                shared = f", a shared expert of {m.moe.shared_ffn_hidden_size}" if m.moe.shared_ffn_hidden_size else ""
                lines.append(f"experts {m.moe.num_experts} per MoE layer ({sum(m.moe.sparse_layers)} of "
                             f"{m.num_layers} layers), top-{m.moe.top_k}, {m.moe.ffn_hidden_size} wide{shared}; "
                             f"EP={ep}: {m.moe.num_experts // max(ep, 1)} experts per rank")
        lay = self.roles.get("actor")
        if self.model is not None and lay is not None and lay.split(self.model.num_layers).uneven:
            lines.append(f"stages  {lay.split(self.model.num_layers)} (override_transformer_config: "
                         f"num_layers_in_first_pipeline_stage={lay.first}, "
                         f"num_layers_in_last_pipeline_stage={lay.last})")
        if self.model is not None and (v := self.model.vision) is not None:
            frozen = self.config.actor_rollout_ref.actor.freeze_vision_tower
            n = vision_parameters(v.config, v.family)
            size = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
            lines.append(f"vision  tower of {size} parameters ({v.config['depth']} "
                         f"blocks, hidden {v.config['hidden_size']}, merge {v.spatial_merge_size}×"
                         f"{v.spatial_merge_size}), replicated on every first-stage rank, "
                         + ("frozen" if frozen else "trained") + " (actor_rollout_ref.actor.freeze_vision_tower)")
        if self.memory is not None:
            who = "trainer rank" if self.num_engine_ranks else "rank"
            lines.append(f"memory  largest {who}, estimated: {self.memory}")
        micro = (f"{b.micro_batches_per_optimizer_step} micro-batch(es) of {b.update}"
                 if b.micro_batches_per_optimizer_step else f"micro-batches of {b.update} (use_dynamic_bsz)")
        lines += [
            f"batch   {b.prompts_per_step} prompts → {b.samples_per_step} samples per step; "
            f"{'-'.join(str(n) for n in sorted({len(b.dp_prompts(r)) for r in range(b.dp)}))} prompts per DP rank; "
            f"each engine generates "
            f"{sorted({len(self.engine_prompts(e.index, b.prompts_per_generation)) for e in self.engines})} prompts"
            + (f" per round of {b.prompts_per_generation}, rounds until {b.prompts_per_step} groups with signal "
               "(algorithm.filter_groups)" if b.filter_groups else ""),
            f"update  {b.mini_batches_per_epoch} mini-batch(es) of {b.samples_per_mini_batch} samples per PPO epoch "
            f"× {b.ppo_epochs} epoch(s) = {b.optimizer_steps_per_rl_step} optimizer step(s) per RL step, "
            f"{b.total_optimizer_steps} in the run; {micro} per optimizer step per DP rank",
            f"logprob old: micro-batches of {b.old_log_prob}" + (
                f"; ref: micro-batches of {b.ref_log_prob}" if "ref" in self.roles else "") + (
                f"; teacher: micro-batches of {b.teacher_log_prob}" if b.teacher_log_prob is not None else ""),
        ]
        if (cb := b.critic) is not None:
            lines.append(f"critic  values and {cb.mini_batches_per_epoch} mini-batch(es) of "
                         f"{cb.mini_batch_samples_per_dp_rank} samples per DP rank × {cb.ppo_epochs} epoch(s) = "
                         f"{cb.optimizer_steps_per_rl_step} optimizer step(s) per RL step; "
                         f"micro-batches of {cb.update}")
        lines.append("ranks:")
        for rank in range(self.world_size):
            parts = []
            if self.is_teacher_rank(rank):
                e = self.teacher_engine_of(rank)
                lines.append(f"  rank {rank}: {self.device_of(rank)} "
                             f"teacher(engine {e.index}{', leader' if e.leader == rank else ''}) only")
                continue
            if self.is_engine_rank(rank):
                e = self.engine_of(rank)
                lines.append(f"  rank {rank}: {self.device_of(rank)} "
                             f"rollout(engine {e.index}{', leader' if e.leader == rank else ''}) only")
                continue
            for role, lay in self.roles.items():
                c = lay.coords(rank)
                layers = self._chunk_layers(lay, c["pp"])
                parts.append(f"{role}(tp{c['tp']} pp{c['pp']} cp{c['cp']} dp{c['dp']}{layers})")
            if self.engines and not self.num_engine_ranks:
                e = self.engine_of(rank)
                parts.append(f"rollout(engine {e.index}{', leader' if e.leader == rank else ''})")
            lines.append(f"  rank {rank}: {self.device_of(rank)} " + " ".join(parts))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _chunk_layers(self, lay: RoleLayout, pp_rank: int) -> str:
        """`` layers 0 + 2`` under VPP (where interleaving puts this stage's layers, one block per chunk), or
        `` layers 0-15`` with uneven end stages."""
        if not (lay.vpp or lay.first or lay.last) or self.model is None:
            return ""
        blocks = lay.layers(pp_rank, self.model.num_layers)
        return " layers " + " + ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in blocks)


def _memory(cfg: RLConfig, roles: dict[str, RoleLayout], batch: BatchPlan, model: HFArch, rollout_tp: int,
            n_engines: int, device_type: str, teacher: HFArch | None) -> MemoryEstimate:
    a, d, mo = cfg.actor_rollout_ref.actor, cfg.data, cfg.actor_rollout_ref.model
    m, lay, cm = a.megatron, roles["actor"], cfg.critic.megatron
    seq = d.max_prompt_length + d.max_response_length
    engine_prompts = -(-batch.prompts_per_generation // max(n_engines, 1))
    return estimate_memory(
        model, tp=lay.tp, pp=lay.pp, dp=lay.dp, dtype=m.dtype if m.dtype in BYTES else "float32",
        distributed_optimizer=m.use_distributed_optimizer, optimizer=a.optim.optimizer, ref="ref" in roles,
        micro_tokens=batch.update.max_tokens or batch.update.micro_batch_size * seq,
        recompute=m.override_transformer_config.get("recompute_granularity") == "full",
        offload={"param": m.param_offload, "grad": m.grad_offload, "optimizer": m.optimizer_offload,
                 "ref_param": cfg.actor_rollout_ref.ref.megatron.param_offload},
        rollout_tp=rollout_tp, engine_tokens=engine_prompts * batch.n * seq, critic="critic" in roles, ep=lay.ep,
        etp=lay.etp, split=lay.split(model.num_layers), engine_weight_bytes=engine_weight_bytes(model),
        critic_offload={"param": cm.param_offload, "grad": cm.grad_offload, "optimizer": cm.optimizer_offload},
        engine=engine_memory(cfg, device_type), device_bytes=device_memory_gb(cfg) * GB, seq_len=seq,
        teacher=teacher if "teacher" in roles else None,
        teacher_offload=cfg.actor_rollout_ref.teacher.megatron.param_offload, lora_rank=max(mo.lora_rank, 0),
        lora_projections=_projections(mo.target_modules) if mo.lora_rank > 0 else (),
        vision_params=vision_parameters(model.vision.config, model.vision.family) if model.vision is not None else 0,
        vision_trained=not a.freeze_vision_tower, host_fraction=host_fraction(a.optim.override_optimizer_config),
        precision_aware=precision_aware(a.optim.override_optimizer_config))


def _projections(target_modules: object) -> tuple[str, ...]:
    """The HF projections LoRA adapts (none when the names are bad: validation says so)."""
    try:
        return resolve_targets(target_modules)  # type: ignore[arg-type]
    except ValueError:
        return ()


def device_memory_gb(cfg: RLConfig) -> float:
    """``trainer.device_memory_gb``; null: the visible GPU's, or 80 when planning without one."""
    if cfg.trainer.device_memory_gb is not None:
        return cfg.trainer.device_memory_gb
    import torch

    return torch.cuda.get_device_properties(0).total_memory / GB if torch.cuda.is_available() else 80.0


def engine_memory(cfg: RLConfig, device_type: str) -> EngineMemory | None:
    """The rollout engine plugin's own memory plan (its optional ``memory_budget``); None: it has none, or its
    config is invalid (validation reports that)."""
    from hybridrl.registry import PluginError, Registry

    r = cfg.actor_rollout_ref.rollout
    try:
        registry = Registry("rollout_engines")
        budget = getattr(registry.load(r.name), "memory_budget", None)
        if budget is None:
            return None
        config = registry.make_config(r.name, r.engine_kwargs, key=f"{AOR}.rollout.engine_kwargs")
    except PluginError:
        return None
    return budget(config, device_type=device_type, gpu_memory_utilization=r.gpu_memory_utilization)


def critic_needed(cfg: RLConfig) -> bool:
    """The critic is built when asked for, or (``critic.enable=null``) when the advantage estimator needs values.
    An estimator that is not installed needs none here (validation reports its name)."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    from hybridrl.registry import PluginError, Registry  # plugin classes import torch only, never a backend

    try:
        return bool(Registry("advantage_estimators").load(cfg.algorithm.adv_estimator).needs_critic)
    except PluginError:
        return False


def ref_needed(cfg: RLConfig) -> bool:
    """The reference model is built when asked for, or (``ref.enable=null``) when a KL term needs it."""
    ref = cfg.actor_rollout_ref.ref
    if ref.enable is not None:
        return ref.enable
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def disaggregated_ranks(cfg: RLConfig, world: int) -> int:
    """How many (last) ranks run only engines: ``rollout.num_ranks`` under ``placement=disaggregated`` when it
    leaves at least one rank to train; 0 otherwise (colocated, or invalid: validation reports it)."""
    r = cfg.actor_rollout_ref.rollout
    if r.placement != "disaggregated" or r.num_ranks is None or not 1 <= r.num_ranks < world:
        return 0
    return r.num_ranks


def teacher_engine_ranks(cfg: RLConfig, world: int) -> int:
    """How many (last) ranks serve the teacher only: ``teacher.inference.num_ranks`` when the teacher runs on an
    engine and that leaves a rank to train; 0 otherwise (Megatron's teacher, or invalid: validation reports it)."""
    t = cfg.actor_rollout_ref.teacher
    if not t.enabled or not t.inference.on_engine or not 1 <= t.inference.num_ranks < world:
        return 0
    return t.inference.num_ranks


def teacher_engine_note(cfg: RLConfig, teacher: HFArch, tp: int) -> str:
    from hybridrl.config.memory import parameter_count

    layer, embedding, output = parameter_count(teacher)
    gb = (layer * teacher.num_layers + embedding + output) * 2 / tp / GB
    return (f"a teacher rank holds its {cfg.actor_rollout_ref.teacher.inference.name} engine only, estimated: "
            f"weights {gb:.1f} GB (bf16, 1/{tp} of the teacher) + its KV cache")


def fp8_engine_note(model: HFArch, rollout_tp: int) -> str:
    """What the plan counts for a checkpoint in block-wise FP8 (:mod:`hybridrl.hf.fp8`), and what a run still lacks."""
    fp8, bf16 = engine_weight_bytes(model), engine_weight_bytes(replace(model, fp8_blocks=None))
    a, b = model.fp8_blocks or (0, 0)
    return (f"the checkpoint's weights are FP8 (config.json quantization_config: e4m3, one scale per {a}×{b} block): "
            f"the engines are counted serving them as shipped, {fp8 / rollout_tp / GB:.1f} GB a GPU at rollout "
            f"TP={rollout_tp} (bf16 would be {bf16 / rollout_tp / GB:.1f} GB). The trainer loads it dequantised (each "
            "e4m3 block × its scale, into bf16/fp32; hybridrl.hf.tensors) and exports bf16. NOT RUNNABLE YET with an "
            "FP8 engine: the weight sync streams bf16 tensors, which an engine serving FP8 weights cannot take in "
            "place (slime quantises each weight to e4m3 blocks on the fly before update_weights_from_tensor; hybridrl "
            "does not yet), so a run on GPUs is refused (docs/tasks.md)")


def _device(device_type: str, rank: int, per_node: int) -> str:
    return f"cuda:{rank % per_node}" if device_type == "cuda" else device_type


def _placement_problems(cfg: RLConfig, *, world: int, per_node: int, model: HFArch | None) -> list[ConfigIssue]:
    r, key = cfg.actor_rollout_ref.rollout, f"{AOR}.rollout.tensor_model_parallel_size"
    rtp, out = r.tensor_model_parallel_size, []
    if rtp < 1:
        return [ConfigIssue(key=key, value=rtp, message="must be ≥ 1")]
    if engine_ranks := disaggregated_ranks(cfg, world):  # num_ranks % rtp: async_training.config_problems
        first = world - engine_ranks
        crossing = [g for g in range(first, world - rtp + 1, rtp) if g // per_node != (g + rtp - 1) // per_node]
        if crossing and not engine_ranks % rtp:
            out.append(ConfigIssue(key=f"{AOR}.rollout.num_ranks", value=engine_ranks, message=(
                f"puts the engine of ranks {crossing[0]}..{crossing[0] + rtp - 1} on two nodes ({per_node} ranks "
                f"per node): an engine's devices are on one node; pick num_ranks so that every {rtp} engine ranks "
                f"(from rank {first} on) share a node")))
    elif world % rtp:
        out.append(ConfigIssue(key=key, value=rtp, message=(
            f"must divide the world size {world}: each engine takes {rtp} consecutive ranks' devices "
            f"(colocated); valid: {divisors(world)}")))
    elif per_node % rtp:
        out.append(ConfigIssue(key=key, value=rtp, message=(
            f"must divide the {per_node} ranks per node (trainer.n_gpus_per_node): an engine's devices are on "
            f"one node; valid: {divisors(per_node)}")))
    if model is not None and model.num_attention_heads % rtp:
        out.append(ConfigIssue(key=key, value=rtp, message=(
            f"must divide the model's {model.num_attention_heads} attention heads "
            f"(valid: {divisors(model.num_attention_heads)})")))
    return out


