"""Random-weight HF checkpoints for tests and the tiny recipes (no model hub needed).

``make_tiny_model`` writes ``config.json``, ``model.safetensors``, ``generation_config.json`` and the
char tokenizer of :mod:`hybridrl.models.char_tokenizer` for a Qwen2, Qwen3 or Llama model, or a Qwen3-MoE /
Qwen2-MoE / Mixtral / GLM-4.5 / DeepSeek-V3 one (``moe=``: its config.json keys, e.g. ``num_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``; Mixtral's ``num_local_experts``, its experts ``intermediate``-wide;
any GLM-4.5 or DeepSeek-V3 key, e.g. ``use_qk_norm``, ``n_group``, ``q_lora_rank``). Weights are drawn
here, not by transformers' ``_init_weights``, so a seed gives the same checkpoint whatever the transformers version:
every matrix ~ N(0, 0.02²) in parameter-name order from one seeded generator, norms = 1, biases = 0.
``make_tiny_reward_model`` writes the same family's one-label ``*ForSequenceClassification`` (a reward model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    DeepseekV3Config,
    GenerationConfig,
    Glm4MoeConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from hybridrl.models.char_tokenizer import EOS_TOKEN, PAD_TOKEN, make_char_tokenizer

Arch = Literal["qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"]
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "llama": LlamaConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "mixtral": MixtralConfig,
    "glm4_moe": Glm4MoeConfig,
    "deepseek_v3": DeepseekV3Config,
}
MOE_DEFAULTS: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                "decoder_sparse_step": 1, "mlp_only_layers": []}
MIXTRAL_DEFAULTS: dict[str, Any] = {"num_local_experts": 4, "num_experts_per_tok": 2}  # every layer the MoE
# every GLM-4.5 feature on but QK norm: layer 0 dense, 8 experts in 2 groups of which 1 is chosen, top-2, a shared
# expert, scaled weights, q/k/v bias, RoPE over half of each head (moe_intermediate_size defaults to hidden)
GLM4_MOE_DEFAULTS: dict[str, Any] = {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                                     "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                                     "norm_topk_prob": True, "partial_rotary_factor": 0.5, "attention_bias": True,
                                     "use_qk_norm": False}
# GLM-4.5's routing and multi-latent attention with a query LoRA (q_lora_rank null: q_proj), rope dims interleaved, no
# RoPE scaling (YaRN is refused); heads are nope 16 + rope 8 wide, values 16 (KV heads = heads, as MLA has them)
DEEPSEEK_V3_DEFAULTS: dict[str, Any] = {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                                        "n_shared_experts": 1, "first_k_dense_replace": 1,
                                        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 32,
                                        "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                                        "v_head_dim": 16, "rope_interleave": True,
                                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                        # not DeepseekV3Config's, but DeepSeek-V3's config.json has them and vLLM
                                        # reads the router's bias only with them (transformers ignores them)
                                        "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
INIT_STD = 0.02


@dataclasses.dataclass(slots=True, kw_only=True, frozen=True)
class TinyModelSpec:
    arch: Arch = "qwen2"
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int | None = None  # MLP size; None: 3 × hidden
    vocab: int | Literal["chars"] = "chars"  # "chars": the tokenizer's size; an int pads to it
    max_positions: int = 512
    tie: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in CONFIG_CLASSES:
            raise ValueError(f"arch={self.arch!r} is not supported; valid: {sorted(CONFIG_CLASSES)}")
        for name in ("hidden", "layers", "heads", "kv_heads", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be divisible by kv_heads={self.kv_heads}")
        if self.intermediate is not None and self.intermediate < 1:
            raise ValueError(f"intermediate={self.intermediate} must be >= 1 or None (3 × hidden)")


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    arch: Arch = "qwen2",
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int | Literal["chars"] = "chars",
    max_positions: int = 512,
    tie: bool = True,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    moe: dict[str, Any] | None = None,
) -> Path:
    """Write a random-weight HF checkpoint with ``tokenizer`` (default: the char tokenizer) to ``out_dir``;
    return its path. A given tokenizer needs :data:`PAD_TOKEN` and :data:`EOS_TOKEN` among its tokens.
    ``moe``: an MoE family's config keys over :data:`MOE_DEFAULTS` (``moe_intermediate_size`` defaults to
    hidden; ``num_experts`` is written under the family's own name), Mixtral's over :data:`MIXTRAL_DEFAULTS`, GLM-4.5's
    over :data:`GLM4_MOE_DEFAULTS`, DeepSeek-V3's over :data:`DEEPSEEK_V3_DEFAULTS` (``kv_heads`` ignored: MLA's KV
    heads are its heads)."""
    spec = TinyModelSpec(arch=arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                         intermediate=intermediate, vocab=vocab, max_positions=max_positions,
                         tie=tie, seed=seed)
    tokenizer = tokenizer or make_char_tokenizer(model_max_length=spec.max_positions)
    n_tokens = len(tokenizer)
    if spec.vocab == "chars":
        vocab_size = n_tokens
    elif isinstance(spec.vocab, int) and spec.vocab >= n_tokens:
        vocab_size = spec.vocab
    else:
        raise ValueError(f"vocab={spec.vocab!r} must be 'chars' or an int >= the char vocab ({n_tokens})")

    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate or 3 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.hidden // spec.heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=spec.tie,
        rms_norm_eps=1e-6,
        initializer_range=INIT_STD,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    if spec.arch in ("qwen3_moe", "qwen2_moe"):
        extra = {**MOE_DEFAULTS, "moe_intermediate_size": spec.hidden, **(moe or {})}
        if spec.arch == "qwen3_moe" and "num_experts" not in Qwen3MoeConfig().to_dict():
            extra["num_local_experts"] = extra.pop("num_experts")  # transformers ≥ 5.x names it so
        fields |= extra
    elif spec.arch == "mixtral":
        unknown = sorted(set(moe or {}) - set(MixtralConfig().to_dict()))
        if unknown:
            raise ValueError(f"moe={moe!r}: {unknown} are not Mixtral config keys (valid e.g. num_local_experts, "
                             "num_experts_per_tok; the experts' size is intermediate)")
        fields |= {**MIXTRAL_DEFAULTS, **(moe or {})}
    elif spec.arch == "glm4_moe":
        unknown = sorted(set(moe or {}) - set(Glm4MoeConfig().to_dict()))
        if unknown:
            raise ValueError(f"moe={moe!r}: {unknown} are not GLM-4.5 config keys (valid e.g. n_routed_experts, "
                             "n_group, topk_group, use_qk_norm, partial_rotary_factor)")
        fields |= {**GLM4_MOE_DEFAULTS, "moe_intermediate_size": spec.hidden, **(moe or {})}
    elif spec.arch == "deepseek_v3":
        unknown = sorted(set(moe or {}) - set(DeepseekV3Config().to_dict()))
        if unknown:
            raise ValueError(f"moe={moe!r}: {unknown} are not DeepSeek-V3 config keys (valid e.g. n_routed_experts, "
                             "n_group, topk_group, q_lora_rank, kv_lora_rank, qk_rope_head_dim)")
        fields |= {**DEEPSEEK_V3_DEFAULTS, "moe_intermediate_size": spec.hidden, **(moe or {}),
                   "num_key_value_heads": spec.heads}
        del fields["head_dim"]  # DeepseekV3Config's is qk_rope_head_dim (its rotary embedding's width)
    elif moe:
        raise ValueError(f"moe={moe!r} is for arch qwen3_moe, qwen2_moe, mixtral, glm4_moe or deepseek_v3, not "
                         f"{spec.arch!r}")
    config = CONFIG_CLASSES[spec.arch](**fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, seed=spec.seed)
    # stop on <|im_end|> (chat) and <|endoftext|> (raw text); greedy unless the caller samples
    model.generation_config = GenerationConfig(
        eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=False
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_tiny_reward_model(
    out_dir: str | os.PathLike[str],
    *,
    arch: Arch = "qwen2",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 512,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Write a random-weight reward model, ``<Arch>ForSequenceClassification`` with one label, to ``out_dir``.

    The config and tokenizer are :func:`make_tiny_model`'s (its ``pad_token_id`` is what transformers
    pools the score at: the last non-pad token); the weights, score head included, are drawn as
    :func:`init_weights` does."""
    out = make_tiny_model(out_dir, arch=arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                          max_positions=max_positions, tie=False, seed=seed, tokenizer=tokenizer)
    config = AutoConfig.from_pretrained(out)
    config.num_labels = 1
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    init_weights(model, seed=seed)
    (out / "generation_config.json").unlink(missing_ok=True)  # a classifier does not generate
    model.save_pretrained(out)  # replaces the causal LM's config.json and model.safetensors
    return out


@torch.no_grad()
def init_weights(model: PreTrainedModel, *, seed: int, std: float = INIT_STD) -> None:
    """Matrices ~ N(0, std²) from one generator in parameter-name order; norms 1; biases 0."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):  # tied weights are listed once
        if param.ndim >= 2:
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * std)
        elif name.endswith("bias"):
            param.zero_()
        else:  # RMSNorm weights (incl. Qwen3's q_norm/k_norm)
            param.fill_(1.0)


def main(args: argparse.Namespace) -> int:
    """``hybridrl make-tiny-model OUT ...`` (arguments defined in :mod:`hybridrl.cli`)."""
    vocab: int | Literal["chars"] = "chars" if args.vocab == "chars" else _parse_vocab(args.vocab)
    out = make_tiny_model(
        args.out, arch=args.arch, hidden=args.hidden, layers=args.layers, heads=args.heads,
        kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=vocab,
        max_positions=args.max_positions, tie=args.tie, seed=args.seed, moe=_parse_moe(args.moe) or None,
    )
    config = PretrainedConfig.from_json_file(str(out / "config.json"))
    n_params = _count_params(out / "model.safetensors")
    print(
        f"wrote {out}: {args.arch}, {n_params:,} parameters, hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads / "
        f"{config.num_key_value_heads} kv, vocab {config.vocab_size}, "
        f"{'tied' if config.tie_word_embeddings else 'untied'} embeddings, seed {args.seed}"
    )
    for path in sorted(out.iterdir()):
        print(f"  {path.name}  {path.stat().st_size:,} bytes")
    return 0


def _parse_moe(items: list[str]) -> dict[str, Any]:
    """``--moe KEY=VALUE`` (VALUE read as JSON, else as a string) → ``make_tiny_model(moe=...)``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--moe {item!r}: expected KEY=VALUE, e.g. --moe use_qk_norm=true")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def _parse_vocab(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"--vocab={text!r}: expected 'chars' or an integer") from None


def _count_params(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
