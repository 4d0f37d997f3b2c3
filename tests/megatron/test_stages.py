"""``hybridrl.megatron.stages``: the layers each pipeline stage holds, as Megatron computes them (uneven end stages
through ``num_layers_in_first/last_pipeline_stage``, and the interleaved even split), and the same verdict on a bad
split as Megatron's ``TransformerConfig`` — before any model is built."""

from __future__ import annotations

import itertools

import pytest
import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from hybridrl.megatron.stages import FIRST, LAST, PipelineSplit


def _megatron(layers: int, pp: int, vpp: int | None, first: int | None, last: int | None) -> list[list[range]] | None:
    """Each stage's chunks as Megatron 0.16.1 builds them; None where its TransformerConfig refuses the split."""
    stages = []
    try:  # the config refuses some splits, the layer count asserts on others (an even split PP does not divide)
        config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=1,
                                   pipeline_dtype=torch.float32, pipeline_model_parallel_size=pp,
                                   virtual_pipeline_model_parallel_size=vpp,
                                   num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
        for r in range(pp):
            chunks = []
            for v in range(vpp) if vpp else [None]:
                offset = get_transformer_layer_offset(config, vp_stage=v, pp_rank=r)
                chunks.append(range(offset, offset + get_num_layers_to_build(config, vp_stage=v, pp_rank=r)))
            stages.append(chunks)
    except (ValueError, AssertionError, ZeroDivisionError):  # the last: VPP with no stage between the ends
        return None
    # Megatron takes an end stage larger than the model (its middle stage then holds a negative range): no split
    return None if any(len(c) < 1 for chunks in stages for c in chunks) else stages


ENDS = [None, 1, 2, 3, 4, 6]


@pytest.mark.parametrize("layers", [3, 5, 6, 8, 12])
def test_the_split_is_megatrons(layers: int) -> None:
    """Every valid split's stages equal Megatron's offsets and layer counts; every split Megatron refuses is refused
    here, with and without VPP."""
    checked = 0
    for pp, first, last in itertools.product((2, 3, 4), ENDS, ENDS):
        split = PipelineSplit(num_layers=layers, pp=pp, first=first, last=last)
        theirs = _megatron(layers, pp, None, first, last)
        assert (theirs is None) == bool(split.problems()), (layers, pp, first, last, split.problems())
        if theirs is not None and not split.problems():
            assert [split.layers(r) for r in range(pp)] == theirs, (layers, pp, first, last)
            checked += 1
    for pp, vpp, first, last in itertools.product((2, 3), (2, 3), ENDS, ENDS):
        split = PipelineSplit(num_layers=layers, pp=pp, vpp=vpp, first=first, last=last)
        theirs = _megatron(layers, pp, vpp, first, last)
        assert (theirs is None) == bool(split.problems()), (layers, pp, vpp, first, last, split.problems())
        if theirs is not None:
            assert [split.layers(r) for r in range(pp)] == theirs, (layers, pp, vpp, first, last)
            checked += 1
    assert checked >= 5


def test_deepseek_v3s_61_layers_split_over_four_stages() -> None:
    split = PipelineSplit(num_layers=61, pp=4, first=16, last=15)
    assert split.stage_counts() == [16, 15, 15, 15] and split.layers(3) == [range(46, 61)]
    assert str(split) == "16 + 15 + 15 + 15 layers over PP=4"
    (key, value, message), = PipelineSplit(num_layers=61, pp=4).problems()
    assert key == "pipeline_model_parallel_size" and "must divide the model's 61 layers (valid: [1, 61])" in message
    assert f"override_transformer_config.{FIRST} / {LAST}" in message
    (key, value, message), = PipelineSplit(num_layers=61, pp=4, first=15, last=15).problems()
    assert key == f"override_transformer_config.{FIRST}" and value == 15
    assert "leaves 31 of the model's 61 layers for the 2 stage(s) between the ends" in message and "16" in message


def test_bad_ends_name_their_key() -> None:
    assert PipelineSplit(num_layers=5, pp=2, first=2, last=2).problems() == [
        (f"override_transformer_config.{FIRST}", 2, "the two stages at PP=2 hold all 5 layers: 2 + 2 must equal it; "
                                                   "valid: [3]")]
    (key, _, message), = PipelineSplit(num_layers=5, pp=1, last=2).problems()
    assert key.endswith(LAST) and "needs pipeline_model_parallel_size ≥ 2" in message
    assert PipelineSplit(num_layers=6, pp=2, vpp=2, first=2).layers(1) == [range(1, 3), range(4, 6)]
    (key, _, message), = PipelineSplit(num_layers=6, pp=2, vpp=2, first=2, last=4).problems()
    assert key.endswith(FIRST) and "needs a stage between the ends" in message
    (key, _, message), = PipelineSplit(num_layers=7, pp=2, vpp=2, first=3).problems()
    assert key.endswith(FIRST) and "stage 0 holds 3 layers" in message
    assert PipelineSplit(num_layers=6, pp=2, first=0).problems()[0][2].startswith("must be an integer ≥ 1")
