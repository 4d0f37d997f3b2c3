"""HF <-> Megatron layout rules of hybridrl/megatron/convert.py, checked in one process (no ranks):
against Megatron's own reading of its fused tensors, and as exact round trips at TP 1/2/4."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.hf.arch import HFArch
from hybridrl.megatron.convert import (
    all_units,
    full_from_shards,
    hf_from_full,
    hf_shapes,
    shard_from_hf,
)


def make_arch(**overrides: object) -> HFArch:
    fields: dict[str, object] = dict(
        family="qwen2", vocab_size=131, hidden_size=32, ffn_hidden_size=48, num_layers=2,
        num_attention_heads=8, num_query_groups=4, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
        rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=True,
        qk_layernorm=True,
    )
    fields.update(overrides)
    return HFArch(**fields)  # type: ignore[arg-type]


def hf_state(arch: HFArch) -> dict[str, torch.Tensor]:
    """Every HF tensor of ``arch`` with distinct values (so any misplaced element shows)."""
    state, start = {}, 0
    for unit in all_units(arch):
        for name, shape in zip(unit.hf_names, hf_shapes(unit, arch), strict=True):
            n = math.prod(shape)
            state[name] = torch.arange(start, start + n, dtype=torch.float32).reshape(shape)
            start += n
    return state


class Reader:
    """A checkpoint reader over a dict that counts the elements it hands out."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state, self.elements = state, 0

    def __call__(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        out = self.state[name][index] if index else self.state[name]
        self.elements += out.numel()
        return out


def shards_of(unit: object, arch: HFArch, state: dict[str, torch.Tensor], tp: int, padded: int) -> list[torch.Tensor]:
    return [shard_from_hf(unit, arch, Reader(state), tp_rank=r, tp_size=tp, padded_vocab=padded)  # type: ignore[arg-type]
            for r in range(tp)]


def test_qkv_matches_megatron_group_split() -> None:
    """Megatron views linear_qkv's output as [groups, (heads_per_group + 2)·d] and splits q | k | v."""
    arch = make_arch()
    state = hf_state(arch)
    unit = next(u for u in all_units(arch) if u.megatron_name == "decoder.layers.1.self_attention.linear_qkv.weight")
    (fused,) = shards_of(unit, arch, state, 1, 256)
    g, rep, d, h = arch.num_query_groups, arch.heads_per_group, arch.head_dim, arch.hidden_size
    q, k, v = fused.view(g, (rep + 2) * d, h).split([rep * d, d, d], dim=1)
    hf = "model.layers.1.self_attn."
    # query head j of group i is HF head i·rep + j (transformers' repeat_kv); KV head i is group i
    assert torch.equal(q.reshape(g * rep * d, h), state[hf + "q_proj.weight"])
    assert torch.equal(k.reshape(g * d, h), state[hf + "k_proj.weight"])
    assert torch.equal(v.reshape(g * d, h), state[hf + "v_proj.weight"])


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_are_contiguous_chunks_of_tp1(tp: int) -> None:
    """ColumnParallelLinear splits the full fused weight into contiguous row chunks: whole groups per rank."""
    arch = make_arch()
    state = hf_state(arch)
    for unit in all_units(arch):
        if unit.kind == "qkv":
            (full,) = shards_of(unit, arch, state, 1, 256)
            assert torch.equal(torch.cat(shards_of(unit, arch, state, tp, 512)), full)


def test_fc1_is_gate_then_up_per_rank() -> None:
    arch = make_arch()
    state = hf_state(arch)
    unit = next(u for u in all_units(arch) if u.kind == "fc1")
    f = arch.ffn_hidden_size // 2
    for r, shard in enumerate(shards_of(unit, arch, state, 2, 256)):
        gate, up = shard.chunk(2)  # Megatron's SwiGLU: silu(first half) * second half, per rank
        assert torch.equal(gate, state["model.layers.0.mlp.gate_proj.weight"][r * f:(r + 1) * f])
        assert torch.equal(up, state["model.layers.0.mlp.up_proj.weight"][r * f:(r + 1) * f])


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_is_exact(tp: int, tie: bool) -> None:
    arch = make_arch(tie_word_embeddings=tie)
    state = hf_state(arch)
    padded = 128 * tp * math.ceil(arch.vocab_size / (128 * tp))
    seen = set()
    for unit in all_units(arch):
        shards = shards_of(unit, arch, state, tp, padded)
        if unit.kind == "vocab":
            assert sum(s.shape[0] for s in shards) == padded
            assert not torch.cat(shards)[arch.vocab_size:].any()  # padding rows are zero
        full = full_from_shards(unit, arch, shards)
        for name, tensor in zip(unit.hf_names, hf_from_full(unit, arch, full, tp_size=tp), strict=True):
            assert torch.equal(tensor, state[name]), name
            seen.add(name)
    assert seen == set(state)
    assert ("lm_head.weight" in seen) == (not tie)


def test_each_rank_reads_only_its_part() -> None:
    arch = make_arch()
    state = hf_state(arch)
    for unit in all_units(arch):
        if unit.kind in ("qkv", "fc1", "row"):
            for r in range(2):
                reader = Reader(state)
                shard = shard_from_hf(unit, arch, reader, tp_rank=r, tp_size=2, padded_vocab=256)
                assert reader.elements == shard.numel(), unit.megatron_name


def test_units_cover_every_family_tensor_once() -> None:
    plain = make_arch(family="llama", qkv_bias=False, qk_layernorm=False, tie_word_embeddings=True)
    names = [n for u in all_units(plain) for n in u.hf_names]
    assert len(names) == len(set(names)) == 2 + 9 * plain.num_layers  # embed, norm; 9 per layer
    assert not any("bias" in n or "q_norm" in n for n in names)
