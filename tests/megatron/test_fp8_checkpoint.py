"""A block-wise FP8 checkpoint as DeepSeek-V3 and Kimi K2 ship theirs (:mod:`hybridrl.hf.fp8`) loads into Megatron
dequantised: every linear projection's weight in float8 e4m3 with a float32 ``weight_scale_inv`` per block
(``amax / 448``), the embedding, output layer, norms, routers and their score-correction biases left as they were,
and ``quantization_config`` in config.json. The blocks here are 12 × 20 (not square, so a transposed block grid
shows; the model's 40-, 48- and 96-wide matrices end in partial blocks, and TP=2 cuts ``kv_b_proj`` mid-block).

The dequantisation is redone here independently of the reader; Megatron's logits from the FP8 checkpoint equal
transformers' from the independently dequantised fp32 copy, at TP=1 and TP=2, and the weights exported back are the
dequantised ones, written without ``quantization_config``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridrl.hf.arch import HFArch
from hybridrl.hf.tensors import SafetensorsReader
from hybridrl.hf.write import save_hf_checkpoint
from hybridrl.models.tiny import make_tiny_model

BLOCK = (12, 20)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
KEPT = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")  # DeepSeek leaves these (and all 1-D) unquantised


def _quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantisation: ``scale_inv = amax / 448`` per block, ``e4m3 = w / scale_inv``."""
    (br, bc), (rows, cols) = BLOCK, w.shape
    scale = torch.empty(-(-rows // br), -(-cols // bc))
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            scale[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    (br, bc), out = BLOCK, q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * br:(i + 1) * br, j * bc:(j + 1) * bc] *= scale[i, j]
    return out


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory, discriminate: Callable[[Path, int], Path]) -> dict[str, Path]:
    """``fp8``: the quantised checkpoint; ``dequantised``: the same weights dequantised here, fp32, no
    quantization_config."""
    root = tmp_path_factory.mktemp("fp8")
    plain = discriminate(make_tiny_model(root / "dequantised", arch="deepseek_v3", tie=False, hidden=48, layers=3,
                                         heads=4, intermediate=40, max_positions=64, seed=7,
                                         moe=dict(moe_intermediate_size=16)), 3)
    state = load_file(plain / "model.safetensors")
    quantised, dequantised = {}, {}
    for name, w in state.items():
        if w.ndim == 2 and not name.endswith(KEPT):
            q, scale = _quantise(w * (8 if "q_b_proj" in name or "kv_" in name else 1))  # peaked attention
            quantised |= {name: q, f"{name}_scale_inv": scale}
            dequantised[name] = _dequantise(q, scale)
        else:
            quantised[name] = dequantised[name] = w.float()
    save_file(dequantised, plain / "model.safetensors", metadata={"format": "pt"})
    out = Path(shutil.copytree(plain, root / "fp8"))
    save_file(quantised, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": FP8}, indent=2))
    return {"fp8": out, "dequantised": plain}


def test_the_reader_dequantises_whole_and_sliced(fp8: dict[str, Path]) -> None:
    """Every FP8 weight reads as the independent dequantisation, bit for bit, also in slices that start and end
    mid-block; the scales are not listed; without the block shape the reader gives the stored tensors."""
    want = load_file(fp8["dequantised"] / "model.safetensors")
    on_disk = load_file(fp8["fp8"] / "model.safetensors")
    # MLA's 5 a layer, the dense MLP's 3, the sparse layers' 2 × (8 experts + the shared one) × 3
    assert sum(t.dtype == torch.float8_e4m3fn for t in on_disk.values()) == 72
    with SafetensorsReader(fp8["fp8"], fp8_blocks=HFArch.from_hf(fp8["fp8"]).fp8_blocks) as reader:
        assert set(reader.files) == set(want)
        for name, w in want.items():
            assert torch.equal(reader.read(name), w), name
        name = "model.layers.1.self_attn.kv_b_proj.weight"  # 128 × 24
        assert torch.equal(reader.read(name, (slice(5, 71), slice(3, 23))), want[name][5:71, 3:23])
    with SafetensorsReader(fp8["fp8"]) as raw:
        assert raw.read(name).dtype == torch.float8_e4m3fn and f"{name}_scale_inv" in raw.files


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_loads_the_fp8_checkpoint_dequantised(fp8: dict[str, Path], tp: int) -> None:
    """verify-model on both checkpoints in one launch: logits ≤ 1e-4 of transformers' and the exported weights
    bit-identical to the dequantised ones (the scales not among them); transformers runs the FP8 one from the
    reader's dequantisation (hybridrl.megatron.verify._dequantised_copy), bit-identical to this file's (above), so
    both compare with the same model. ~15 s per TP."""
    from hybridrl.megatron.verify import run_verification

    reports = run_verification([fp8["fp8"], fp8["dequantised"]], tp=tp, bucket_bytes=20_000)
    n = len(load_file(fp8["dequantised"] / "model.safetensors"))
    for r in reports:
        print(f"{Path(r.model_dir).name} tp={tp}: max_abs_logit_diff={r.max_abs_logit_diff:.3g}")
        assert r.max_abs_logit_diff <= 1e-4 and r.roundtrip_exact and r.n_tensors == n, r


def test_the_export_drops_quantization_config_unless_it_writes_fp8(fp8: dict[str, Path], tmp_path: Path) -> None:
    w = load_file(fp8["dequantised"] / "model.safetensors")
    save_hf_checkpoint([sorted(w.items())], tmp_path / "bf16", source_dir=fp8["fp8"])
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config and HFArch.from_hf(tmp_path / "bf16").fp8_blocks is None
    assert config["model_type"] == "deepseek_v3"
    save_hf_checkpoint([sorted(load_file(fp8["fp8"] / "model.safetensors").items())], tmp_path / "fp8",
                       source_dir=fp8["fp8"])
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"] == FP8
