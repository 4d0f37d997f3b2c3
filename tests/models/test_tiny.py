"""The offline tiny model: exact tokenizer round trip through AutoTokenizer, config, weights, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Tokenizer

from hybridrl.cli import main as cli_main
from hybridrl.models.char_tokenizer import CHARS, IM_END, IM_START, PAD_TOKEN, make_char_tokenizer
from hybridrl.models.tiny import make_tiny_model

ARCHS = ["qwen2", "qwen3", "llama"]
SMALL = dict(hidden=32, layers=2, heads=4, kv_heads=2)

TRICKY = [
    "",
    " ",
    "   ",
    "  leading spaces",
    "trailing spaces  ",
    "a  b   c",
    "\n",
    "line one\n\nline three\n",
    " \n \n",
    "\ttab\tseparated\t",
    "12+34=46",
    "007 - 1000000 = -999993",
    "3.14159, 2.71828; 1e-6",
    "What's 12*(3+4)? It's 84!",
    "`code` {x: [1, 2]} <tag> a/b\\c |pipe| ~tilde^ @#$%&_",
    CHARS,
    CHARS[::-1],
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch, **SMALL) for arch in ARCHS}


def safetensor_keys(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def safetensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trip_is_exact_after_reload(checkpoints: dict[str, Path], arch: str) -> None:
    tok = AutoTokenizer.from_pretrained(checkpoints[arch])
    assert isinstance(tok, Qwen2Tokenizer)
    reference = make_char_tokenizer(model_max_length=512)
    for text in TRICKY:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text, repr(text)
        assert len(ids) == len(text), f"not one token per char: {text!r}"
        assert ids == reference(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("arch", ARCHS)
def test_special_tokens_and_chat_template(checkpoints: dict[str, Path], arch: str) -> None:
    tok = AutoTokenizer.from_pretrained(checkpoints[arch])
    assert tok.eos_token == IM_END and tok.pad_token == PAD_TOKEN
    assert len({tok.eos_token_id, tok.pad_token_id, tok.convert_tokens_to_ids(IM_START)}) == 3
    assert len(tok) == len(CHARS) + 3

    text = tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}], add_generation_prompt=True, tokenize=False
    )
    assert text == f"{IM_START}user\n12+34={IM_END}\n{IM_START}assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids(IM_START)
    assert ids.count(tok.eos_token_id) == 1
    assert tok.decode(ids) == text


@pytest.mark.parametrize("arch", ARCHS)
def test_model_loads_with_saved_weights_and_generates(checkpoints: dict[str, Path], arch: str) -> None:
    path = checkpoints[arch]
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    embed = safetensor(path, "model.embed_tokens.weight")
    torch.testing.assert_close(model.get_input_embeddings().weight.detach(), embed, rtol=0, atol=0)
    assert 0.015 < embed.std().item() < 0.025

    tok = AutoTokenizer.from_pretrained(path)
    prompt = torch.tensor([tok("1+2=")["input_ids"]])
    out = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, prompt.shape[1] + 4) or out[0, -1].item() in model.generation_config.eos_token_id


def test_config_fields_match_arguments(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, arch="qwen3", hidden=48, layers=3, heads=6, kv_heads=3,
                           intermediate=100, max_positions=256, seed=7)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (48, 3, 6)
    assert (cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["head_dim"]) == (3, 100, 8)
    assert cfg["max_position_embeddings"] == 256 and cfg["tie_word_embeddings"] is True
    assert cfg["vocab_size"] == len(CHARS) + 3
    assert safetensor(path, "model.layers.0.self_attn.k_proj.weight").shape == (3 * 8, 48)
    assert "model.layers.0.self_attn.q_norm.weight" in safetensor_keys(path)
    assert AutoTokenizer.from_pretrained(path).model_max_length == 256


def test_default_intermediate_is_three_times_hidden(checkpoints: dict[str, Path]) -> None:
    cfg = json.loads((checkpoints["llama"] / "config.json").read_text())
    assert cfg["intermediate_size"] == 3 * SMALL["hidden"]


def test_tied_and_untied_embeddings(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    assert "lm_head.weight" not in safetensor_keys(checkpoints["qwen2"])
    untied = make_tiny_model(tmp_path, tie=False, **SMALL)
    assert json.loads((untied / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in safetensor_keys(untied)
    assert not torch.equal(safetensor(untied, "lm_head.weight"), safetensor(untied, "model.embed_tokens.weight"))
    model = AutoModelForCausalLM.from_pretrained(untied)
    torch.testing.assert_close(model.lm_head.weight.detach(), safetensor(untied, "lm_head.weight"))


def test_vocab_padding(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, vocab=128, **SMALL)
    assert json.loads((path / "config.json").read_text())["vocab_size"] == 128
    assert safetensor(path, "model.embed_tokens.weight").shape == (128, SMALL["hidden"])
    assert len(AutoTokenizer.from_pretrained(path)) == len(CHARS) + 3
    with pytest.raises(ValueError, match="vocab=50"):
        make_tiny_model(tmp_path / "small", vocab=50, **SMALL)


def test_weights_are_deterministic_by_seed(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=3, **SMALL)
    b = make_tiny_model(tmp_path / "b", seed=3, **SMALL)
    c = make_tiny_model(tmp_path / "c", seed=4, **SMALL)
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(safetensor(a, name), safetensor(b, name))
    assert not torch.equal(safetensor(a, name), safetensor(c, name))


def test_bad_shapes_name_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hidden=30 must be divisible by heads=4"):
        make_tiny_model(tmp_path, hidden=30, heads=4)
    with pytest.raises(ValueError, match="heads=4 must be divisible by kv_heads=3"):
        make_tiny_model(tmp_path, kv_heads=3)


def test_cli_writes_a_loadable_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    argv = ["make-tiny-model", str(out), "--arch", "llama", "--hidden", "32", "--layers", "1",
            "--heads", "2", "--kv-heads", "1", "--vocab", "112", "--no-tie", "--seed", "5"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "model.safetensors" in printed and "untied" in printed
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama" and model.config.vocab_size == 112
    assert model.config.num_hidden_layers == 1 and model.config.tie_word_embeddings is False
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("a b\nc")["input_ids"]) == "a b\nc"
