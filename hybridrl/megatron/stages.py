"""Which transformer layers each pipeline stage (and each of its model chunks) holds: Megatron's rule, stated once.

Megatron-core 0.16.1 splits ``num_layers`` over ``PP`` stages in equal blocks, or unevenly when the
TransformerConfig sets ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` (verl's
DeepSeek-V3 and Qwen3-MoE scripts set them through ``override_transformer_config``): those stages hold that many
layers and the stages between share the rest equally (``transformer_block.get_num_layers_to_build``,
``transformer_layer.get_transformer_layer_offset``). Under the interleaved schedule (VPP) chunk v of stage r holds
block ``v·PP + r`` of ``PP·VPP`` equal blocks.

:class:`PipelineSplit` computes the same ranges without torch or Megatron, so static validation says which layers
each stage holds and refuses a bad split naming the key before any model is built; the memory plan counts each
stage's own layers; the model builder raises the same problems. The runtime takes its layers from Megatron itself
(each layer's global ``layer_number``, which the weight converters read), and tests/megatron/test_stages.py checks
that the two agree.

With VPP each stage's layers split into VPP equal chunks, uneven end stages included (then every stage's count must
be a multiple of VPP, and PP=2 with both ends set is refused: Megatron 0.16.1's offset divides by the zero stages
between the ends there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridrl.megatron.config import divisors

FIRST = "num_layers_in_first_pipeline_stage"
LAST = "num_layers_in_last_pipeline_stage"

_PP, _VPP = "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"
_OKEY = "override_transformer_config"

Problem = tuple[str, int, str]  # (key under a role's megatron config, value, what is wrong and what is valid)


def stage_sizes(overrides: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(first, last)``: the layer counts ``override_transformer_config`` gives the end stages (None: even)."""
    first, last = overrides.get(FIRST), overrides.get(LAST)
    return (first if isinstance(first, int) else None), (last if isinstance(last, int) else None)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSplit:
    """``num_layers`` over ``pp`` stages (× ``vpp`` chunks), the first/last holding ``first``/``last`` when set."""

    num_layers: int
    pp: int = 1
    vpp: int | None = None
    first: int | None = None
    last: int | None = None

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None

    def problems(self) -> list[Problem]:
        """Every way this split fails, as ``(key under megatron, value, message)``; the message reads after
        ``<key>=<value>: ``. Sizes < 1 and VPP without PP are the caller's (:func:`layout_problems`)."""
        layers, pp, vpp = self.num_layers, self.pp, self.vpp
        if pp < 1:
            return []
        if not self.uneven:
            out: list[Problem] = []
            if layers % pp:
                out.append((_PP, pp, f"must divide the model's {layers} layers (valid: {divisors(layers)}), or "
                                     f"set {_OKEY}.{FIRST} / {LAST} (uneven end stages)"))
            if vpp is not None and vpp >= 1 and layers % (pp * vpp):
                valid = [v for v in divisors(layers // pp if layers % pp == 0 else 0) if v >= 2]
                out.append((_VPP, vpp, f"PP×VPP = {pp}×{vpp} = {pp * vpp} must divide the model's {layers} layers "
                                       f"(each chunk holds equal layers); valid at PP={pp}: null or {valid or 'none'}"))
            return out
        return self._uneven_problems()

    def _uneven_problems(self) -> list[Problem]:
        ends = {k: v for k, v in ((FIRST, self.first), (LAST, self.last)) if v is not None}
        bad = [(f"{_OKEY}.{k}", v, "must be an integer ≥ 1 (or null: an even split)") for k, v in ends.items()
               if isinstance(v, bool) or v < 1]
        if bad:
            return bad
        key = FIRST if self.first is not None else LAST
        value = ends[key]
        if self.pp < 2:
            return [(f"{_OKEY}.{key}", value, f"needs pipeline_model_parallel_size ≥ 2 (it is {self.pp}); remove it")]
        if not self._fits():
            middle_stages, valid = self.pp - len(ends), self._valid(key) or "none at this PP"
            if not middle_stages:
                return [(f"{_OKEY}.{key}", value, f"the two stages at PP=2 hold all {self.num_layers} layers: "
                                                  f"{self.first} + {self.last} must equal it; valid: {valid}")]
            other = f" (with {LAST}={self.last})" if len(ends) == 2 else ""
            return [(f"{_OKEY}.{key}", value,
                     f"leaves {max(self.num_layers - sum(ends.values()), 0)} of the model's {self.num_layers} layers "
                     f"for the {middle_stages} stage(s) between the ends at PP={self.pp}, which must hold equal, "
                     f"nonzero shares{other}; valid: {valid}")]
        return self._interleaved_problems(key, value)

    def _interleaved_problems(self, key: str, value: int) -> list[Problem]:
        """Uneven stages under VPP: every stage's layers split into VPP equal chunks (Megatron's
        ``TransformerConfig`` and ``get_num_layers_to_build`` rules), and a stage between the ends (Megatron 0.16.1's
        ``get_transformer_layer_offset`` divides by their number under VPP: PP=2 with both ends set fails there)."""
        vpp = self.vpp
        if vpp is None:
            return []
        if self.pp - (self.first is not None) - (self.last is not None) == 0:
            return [(f"{_OKEY}.{key}", value, f"with virtual_pipeline_model_parallel_size={vpp} Megatron needs a "
                                              f"stage between the ends (it divides by their number): at PP={self.pp} "
                                              f"set only one of {FIRST} / {LAST}")]
        odd = [(i, n) for i, n in enumerate(self.stage_counts()) if n % vpp]
        if odd:
            stage, n = odd[0]
            return [(f"{_OKEY}.{key}", value, f"stage {stage} holds {n} layers, which its "
                                              f"virtual_pipeline_model_parallel_size={vpp} model chunks cannot share "
                                              f"equally; every stage's layer count must be a multiple of {vpp}")]
        return []

    def _fits(self) -> bool:
        """Whether the stages between the ends share the remaining layers equally and none is empty (Megatron's
        ``TransformerConfig.__post_init__`` rule for an uneven split)."""
        ends = [n for n in (self.first, self.last) if n is not None]
        middle_stages, middle = self.pp - len(ends), self.num_layers - sum(ends)
        if middle_stages == 0:
            return middle == 0
        return middle >= middle_stages and middle % middle_stages == 0

    def _valid(self, key: str) -> list[int]:
        """Values of ``key`` that make the split valid, the other end as it is."""
        return [n for n in range(1, self.num_layers + 1)
                if PipelineSplit(num_layers=self.num_layers, pp=self.pp, first=n if key == FIRST else self.first,
                                 last=n if key == LAST else self.last)._fits()]

    def stage_counts(self) -> list[int]:
        """Layers on each stage (a valid split)."""
        if not self.uneven:
            return [self.num_layers // self.pp] * self.pp
        ends = (self.first is not None) + (self.last is not None)
        middle = (self.num_layers - (self.first or 0) - (self.last or 0)) // max(self.pp - ends, 1)
        counts = [middle] * self.pp
        if self.first is not None:
            counts[0] = self.first
        if self.last is not None:
            counts[-1] = self.last
        return counts

    def layers(self, pp_rank: int) -> list[range]:
        """The global layer indices of each model chunk on ``pp_rank`` (one chunk without VPP). Under VPP chunk v of
        every stage comes before chunk v + 1 of any: chunk v starts at ``v·L/VPP`` plus the chunk-v layers of the
        stages before (``get_transformer_layer_offset``; even: block ``v·PP + pp_rank``)."""
        counts = self.stage_counts()
        if not self.vpp:
            start = sum(counts[:pp_rank])
            return [range(start, start + counts[pp_rank])]
        per_chunk = [n // self.vpp for n in counts]
        before, mine = sum(per_chunk[:pp_rank]), per_chunk[pp_rank]
        return [range(v * sum(per_chunk) + before, v * sum(per_chunk) + before + mine) for v in range(self.vpp)]

    def __str__(self) -> str:
        counts = self.stage_counts()
        return " + ".join(str(c) for c in counts) + f" layers over PP={self.pp}"
