"""The run's layout derived from the config: parallel groups per role, rank roles, batch arithmetic."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.config.model_info import ModelInfo
from hybridrl.config.schema import MegatronConfig, RLConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleLayout:
    """A Megatron role's parallel sizes. Megatron's default rank order is tp-cp-ep-dp-pp (tp fastest)."""

    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int | None = None  # model chunks per PP rank (interleaved 1F1B); None: one

    @classmethod
    def of(cls, m: MegatronConfig, world_size: int) -> RoleLayout:
        model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        return cls(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                   cp=m.context_parallel_size, dp=max(world_size // max(model_parallel, 1), 1),
                   vpp=m.virtual_pipeline_model_parallel_size)

    def layers(self, pp_rank: int, num_layers: int) -> list[range]:
        """The layers of each model chunk on ``pp_rank``: chunk v holds block ``v·PP + pp_rank`` of
        ``PP·VPP`` equal blocks (Megatron's interleaved layer offsets)."""
        chunks = self.vpp or 1
        per = num_layers // (self.pp * chunks)
        return [range((v * self.pp + pp_rank) * per, (v * self.pp + pp_rank + 1) * per) for v in range(chunks)]

    def coords(self, rank: int) -> dict[str, int]:
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def __str__(self) -> str:
        vpp = f" VPP={self.vpp}" if self.vpp else ""
        return f"TP={self.tp} PP={self.pp}{vpp} CP={self.cp} DP={self.dp}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    world_size: int
    roles: dict[str, RoleLayout]  # actor, ref (when built), critic (when enabled)
    rollout_tp: int
    model: ModelInfo | None
    prompts_per_step: int
    samples_per_step: int
    mini_batches_per_epoch: int
    samples_per_mini_batch: int
    grad_accum_steps: int  # actor micro-batches per optimizer step on one DP rank
    micro_batch_token_budget: int | None = None  # use_dynamic_bsz: padded tokens per micro-batch instead
    notes: list[str] = field(default_factory=list)

    @property
    def n_engines(self) -> int:
        return self.world_size // self.rollout_tp

    def render(self) -> str:
        lines = [f"world_size: {self.world_size}"]
        for role, lay in self.roles.items():
            lines.append(f"{role:<7} {lay}")
        lines.append(f"rollout {self.n_engines} engine(s) × TP={self.rollout_tp} (colocated; started by "
                     f"the first rank of each group)")
        if self.model is not None:
            m = self.model
            lines.append(f"model   {m.model_type}: {m.num_layers} layers, hidden {m.hidden_size}, heads "
                         f"{m.num_heads} (kv {m.num_kv_heads}), vocab {m.vocab_size}, max positions "
                         f"{m.max_position_embeddings}, tied embeddings: {m.tie_word_embeddings}")
        lines.append(
            f"batch   {self.prompts_per_step} prompts → {self.samples_per_step} samples per step; "
            f"{self.mini_batches_per_epoch} mini-batch(es) of {self.samples_per_mini_batch} samples per PPO "
            f"epoch; " + (f"{self.grad_accum_steps} micro-batch(es)" if self.micro_batch_token_budget is None else
                          f"micro-batches of ≤ {self.micro_batch_token_budget} padded tokens (use_dynamic_bsz)")
            + " per optimizer step per DP rank"
        )
        lines.append("ranks:")
        for rank in range(self.world_size):
            parts = []
            for role, lay in self.roles.items():
                c = lay.coords(rank)
                layers = self._chunk_layers(lay, c["pp"])
                parts.append(f"{role}(tp{c['tp']} pp{c['pp']} cp{c['cp']} dp{c['dp']}{layers})")
            engine, local = divmod(rank, self.rollout_tp)
            parts.append(f"rollout(engine {engine}{', leader' if local == 0 else ''})")
            lines.append(f"  rank {rank}: " + " ".join(parts))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _chunk_layers(self, lay: RoleLayout, pp_rank: int) -> str:
        """`` layers 0 + 2`` under VPP: where interleaving puts this stage's layers (one block per chunk)."""
        if not lay.vpp or self.model is None:
            return ""
        blocks = lay.layers(pp_rank, self.model.num_layers)
        return " layers " + " + ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in blocks)


def ref_needed(cfg: RLConfig) -> bool:
    ref = cfg.actor_rollout_ref.ref
    if ref.enable is not None:
        return ref.enable
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def world_size_of(cfg: RLConfig) -> int:
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
