"""How a role spreads over ranks: its TP/PP/CP/DP layout, and contiguous shares of a batch."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.megatron.config import (
    MegatronConfig,
)
from hybridrl.megatron.stages import PipelineSplit, stage_sizes

AOR = "actor_rollout_ref"


def shares(total: int, parts: int) -> list[range]:
    """``range(total)`` cut into ``parts`` contiguous shares whose sizes differ by at most one."""
    base, extra = divmod(total, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleLayout:
    """A Megatron role's parallel sizes. Megatron's default rank order is tp-cp-ep-dp-pp (tp fastest)."""

    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int | None = None  # model chunks per PP rank (interleaved 1F1B); None: one
    ep: int = 1  # MoE experts split over this many of the DP×CP ranks (and the TP ranks when etp < tp)
    etp: int | None = None  # each expert's matrices split over this many ranks; None: tp
    first: int | None = None  # layers on the first / last pipeline stage (override_transformer_config); None: even
    last: int | None = None

    @classmethod
    def of(cls, m: MegatronConfig, world_size: int) -> RoleLayout:
        tp, pp, cp = (max(v, 1) for v in (m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                                           m.context_parallel_size))
        first, last = stage_sizes(m.override_transformer_config)
        return cls(tp=tp, pp=pp, cp=cp, dp=max(world_size // (tp * pp * cp), 1),
                   vpp=m.virtual_pipeline_model_parallel_size, ep=max(m.expert_model_parallel_size, 1),
                   etp=m.expert_tensor_parallel_size, first=first, last=last)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def split(self, num_layers: int) -> PipelineSplit:
        """How a model of ``num_layers`` layers spreads over this layout's stages."""
        return PipelineSplit(num_layers=num_layers, pp=self.pp, vpp=self.vpp, first=self.first, last=self.last)

    def layers(self, pp_rank: int, num_layers: int) -> list[range]:
        """The layers of each model chunk on ``pp_rank`` (:class:`~hybridrl.megatron.stages.PipelineSplit`: chunk v
        holds block ``v·PP + pp_rank`` of ``PP·VPP`` equal blocks; or uneven end stages without VPP)."""
        return self.split(num_layers).layers(pp_rank)

    def coords(self, rank: int) -> dict[str, int]:
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def __str__(self) -> str:
        vpp = f" VPP={self.vpp}" if self.vpp else ""
        ep = f" EP={self.ep}" if self.ep > 1 else ""
        ep += f" ETP={self.etp}" if self.etp is not None and self.etp != self.tp else ""
        return f"TP={self.tp} PP={self.pp}{vpp} CP={self.cp} DP={self.dp}{ep}"
