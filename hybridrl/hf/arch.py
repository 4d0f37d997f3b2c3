"""A Hugging Face checkpoint directory's architecture and problems (``config.json`` and what lies beside it).

- :class:`HFArch`: the part of ``config.json`` that decides the Megatron model, and how TP/PP/VPP may
  split it (:meth:`HFArch.split_problems`, the one statement of those rules).
- :func:`inspect_model_dir`: every problem with a checkpoint directory, as strings (static validation);
  :func:`eos_token_ids`.

Its tensors are :mod:`hybridrl.hf.tensors`; writing a checkpoint is :mod:`hybridrl.hf.write`.

Supported: the dense decoder families Qwen2/Qwen2.5 (QKV bias), Qwen3 (QK RMSNorm) and Llama
(RMSNorm, SwiGLU, GQA, RoPE, tied or untied embeddings), and the mixtures of experts Qwen3-MoE
(``mlp_only_layers``, ``decoder_sparse_step``, ``norm_topk_prob`` both ways), Qwen2-MoE (its gated shared
expert) and Mixtral (every layer's MLP the MoE, top-k renormalised, no sliding window): :class:`MoE`, and where
each family's checkpoint keeps a layer's router and experts (:data:`EXPERT_NAMES`). Anything else is an error
that names the file, the key, its value and what would be valid, so an unsupported checkpoint fails before any
process group or model is built.

Importing this module imports neither torch nor transformers (static validation runs without them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:

    pass

Family = Literal["qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe", "mixtral"]
FAMILIES: tuple[Family, ...] = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe", "mixtral")
MOE_FAMILIES: tuple[Family, ...] = ("qwen3_moe", "qwen2_moe", "mixtral")

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

_TP, _PP, _VPP = "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"
_EP = "expert_model_parallel_size"
_ETP = "expert_tensor_parallel_size"


# --- architecture -------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True, frozen=True)
class Llama3RopeScaling:
    """Llama-3.1-style frequency scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(slots=True, kw_only=True, frozen=True)
class ExpertNames:
    """Where an MoE family's checkpoint keeps a layer's router and experts, under ``model.layers.<i>.``:
    ``<block>.gate.weight`` (the router) and ``<block>.experts.<e>.<gate|up|down>.weight`` (each expert's SwiGLU:
    down(silu(gate(x)) * up(x))). transformers ≥ 5 fuses the experts in memory but saves and loads these names."""

    block: str
    gate: str
    up: str
    down: str


EXPERT_NAMES: dict[str, ExpertNames] = {  # by model_type
    "qwen3_moe": ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "qwen2_moe": ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "mixtral": ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
}


@dataclass(slots=True, kw_only=True, frozen=True)
class MoE:
    """The mixture-of-experts MLP of Qwen3-MoE / Qwen2-MoE / Mixtral layers, in Megatron's terms.

    Routing (every family): p = softmax(router(x)) in fp32, the top-k experts by p, weights p_topk — renormalised
    to sum 1 when ``norm_topk_prob`` (Megatron: softmax over the top-k logits, ``moe_router_pre_softmax=False``),
    else as they are (softmax first, ``moe_router_pre_softmax=True``); Mixtral always renormalises. Qwen2-MoE adds a
    shared expert on every token, scaled by sigmoid(shared_expert_gate(x)).
    """

    num_experts: int
    top_k: int
    ffn_hidden_size: int  # each expert's: HF moe_intermediate_size (Mixtral: intermediate_size)
    norm_topk_prob: bool
    shared_ffn_hidden_size: int  # Qwen2-MoE's shared expert (HF shared_expert_intermediate_size); 0: none
    shared_expert_gate: bool  # Qwen2-MoE: the shared expert's sigmoid gate
    sparse_layers: tuple[bool, ...]  # per layer: True where the MLP is the MoE, False a dense MLP

    @property
    def layer_freq(self) -> list[int]:
        """Megatron's ``moe_layer_freq`` pattern (1: MoE layer)."""
        return [int(x) for x in self.sparse_layers]


@dataclass(slots=True, kw_only=True, frozen=True)
class HFArch:
    """Architecture of a dense HF causal LM, in Megatron's terms."""

    family: Family
    vocab_size: int  # true vocab (the checkpoint's rows); Megatron may pad it, exports never do
    hidden_size: int
    ffn_hidden_size: int  # HF intermediate_size
    num_layers: int
    num_attention_heads: int
    num_query_groups: int  # KV heads
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: q/k/v projections have biases
    qk_layernorm: bool  # Qwen3: RMSNorm over each head of q and k
    moe: MoE | None = None  # the MoE families; None: every layer's MLP is dense (ffn_hidden_size)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def split_problems(self, *, tp: int, pp: int, vpp: int | None = None, ep: int = 1,
                       etp: int | None = None) -> list[tuple[str, int, str]]:
        """Every way ``tp``/``pp``(×``vpp``) fail to split this model evenly, as ``(key, value, message)``
        with key one of ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
        ``virtual_pipeline_model_parallel_size``, ``expert_model_parallel_size``, ``expert_tensor_parallel_size``
        (``etp``: the experts' TP, null = ``tp``); the message reads after
        ``<key>=<value>: ``.

        Only the model's rules: sizes < 1, VPP without PP and the world size are the caller's.
        """
        heads, kv, ffn, layers = self.num_attention_heads, self.num_query_groups, self.ffn_hidden_size, self.num_layers
        out: list[tuple[str, int, str]] = []
        if tp >= 1 and heads % tp:
            out.append((_TP, tp, f"must divide the model's {heads} attention heads (valid: {_divisors(heads)})"))
        if tp >= 1 and kv % tp:
            out.append((_TP, tp, f"must divide the model's {kv} KV heads (GQA groups) (valid: {_divisors(kv)})"))
        moe = self.moe
        sizes = [] if moe is not None and all(moe.sparse_layers) else [("intermediate_size", ffn)]  # dense MLPs
        if moe is not None and etp is not None and etp != tp:  # the experts split over their own TP
            if etp >= 1 and moe.ffn_hidden_size % etp:
                out.append((_ETP, etp, f"must divide the model's moe_intermediate_size={moe.ffn_hidden_size} (each "
                                       f"expert-TP rank holds an equal slice of every expert) (valid: "
                                       f"{_divisors(moe.ffn_hidden_size)})"))
        elif moe is not None:
            sizes.append(("moe_intermediate_size", moe.ffn_hidden_size))
        if moe is not None:
            if moe.shared_ffn_hidden_size:
                sizes.append(("shared_expert_intermediate_size", moe.shared_ffn_hidden_size))
        for key, size in sizes:
            if tp >= 1 and size % tp:
                valid = _divisors(math.gcd(heads, kv, *(n for _, n in sizes)))
                out.append((_TP, tp, f"must divide the model's {key}={size} (each TP rank holds an equal slice of "
                                    f"the MLP) (valid for this model: {valid})"))
        if ep > 1 and self.moe is None:
            out.append((_EP, ep, f"splits the experts of an MoE model; {self.family} is dense: set 1"))
        elif ep > 1 and self.moe is not None and self.moe.num_experts % ep:
            out.append((_EP, ep, f"must divide the model's {self.moe.num_experts} experts (whole experts per rank) "
                                f"(valid: {_divisors(self.moe.num_experts)})"))
        if pp >= 1 and layers % pp:
            out.append((_PP, pp, f"must divide the model's {layers} layers (valid: {_divisors(layers)})"))
        if pp >= 1 and vpp is not None and vpp >= 1 and layers % (pp * vpp):
            valid = [v for v in _divisors(layers // pp if layers % pp == 0 else 0) if v >= 2]
            out.append((_VPP, vpp, f"PP×VPP = {pp}×{vpp} = {pp * vpp} must divide the model's {layers} layers "
                                  f"(each chunk holds equal layers); valid at PP={pp}: null or {valid or 'none'}"))
        return out

    def check_split(self, *, tp: int, pp: int, vpp: int | None = None, ep: int = 1, etp: int | None = None) -> None:
        """Raise ``ValueError`` listing :meth:`split_problems` unless the sizes split this model evenly."""
        problems = self.split_problems(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp)
        if problems:
            raise ValueError("; ".join(f"{key}={value}: {message}" for key, value, message in problems))

    @classmethod
    def from_hf(cls, config: Any, *, source: str = "config") -> HFArch:
        """From a ``transformers.PretrainedConfig``, a config.json dict, or a checkpoint directory.

        Raises ``KeyError`` (missing key), ``NotImplementedError`` (unsupported value), ``ValueError``
        (unreadable file, bad or inconsistent values), each naming ``source`` (the file) and the key, or
        ``FileNotFoundError`` (no config.json).
        """
        if isinstance(config, str | Path):
            path = Path(config)
            path = path / CONFIG_FILE if path.is_dir() else path
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such file; a HF checkpoint dir holds {CONFIG_FILE}")
            return cls.from_hf(read_json(path), source=str(path))
        if not isinstance(config, Mapping):
            config = config.to_dict()  # PretrainedConfig: carries its class defaults
        return _parse(config, source)


def _parse(cfg: Mapping[str, Any], source: str) -> HFArch:
    def need(key: str) -> Any:
        if key not in cfg:
            raise KeyError(f"{source}: missing key {key!r} (needed to build the Megatron model)")
        return cfg[key]

    def expect(key: str, valid: object, default: object) -> None:
        value = cfg.get(key, default)  # absent means the HF default, which is the valid value
        if value != valid:
            raise NotImplementedError(f"{source}: {key}={value!r} is not supported; valid: {valid!r}")

    family = need("model_type")
    if family not in FAMILIES:
        raise NotImplementedError(f"{source}: model_type={family!r} is not supported; valid: {FAMILIES}")
    expect("hidden_act", "silu", "silu")
    expect("use_sliding_window", False, False)
    expect("mlp_bias", False, False)
    if family != "qwen2":  # Qwen2's q/k/v bias is fixed in its modeling code; this key adds o_proj's
        expect("attention_bias", False, False)
    if family == "mixtral":  # no use_sliding_window switch: a window is on when set
        expect("sliding_window", None, None)
        expect("router_jitter_noise", 0.0, 0.0)  # training-time noise on the router's input

    hidden = _size(need("hidden_size"), f"{source}: hidden_size")
    heads = _size(need("num_attention_heads"), f"{source}: num_attention_heads")
    kv_heads = _size(cfg.get("num_key_value_heads") or heads, f"{source}: num_key_value_heads")  # absent: MHA
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    theta, scaling = _rope(cfg, source)
    layers = _size(need("num_hidden_layers"), f"{source}: num_hidden_layers")
    moe = _moe(cfg, source, family, layers, need) if family in MOE_FAMILIES else None
    return HFArch(
        family=family,
        vocab_size=_size(need("vocab_size"), f"{source}: vocab_size"),
        hidden_size=hidden,
        ffn_hidden_size=_size(need("intermediate_size"), f"{source}: intermediate_size"),
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        head_dim=_size(cfg.get("head_dim") or hidden // heads, f"{source}: head_dim"),
        rms_norm_eps=_number(need("rms_norm_eps"), f"{source}: rms_norm_eps"),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_size(need("max_position_embeddings"), f"{source}: max_position_embeddings"),
        tie_word_embeddings=bool(need("tie_word_embeddings")),
        qkv_bias=family == "qwen2" or family == "qwen2_moe" and bool(cfg.get("qkv_bias", True)),
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        moe=moe,
    )


def _moe(cfg: Mapping[str, Any], source: str, family: str, layers: int, need: Any) -> MoE:
    """Qwen3-MoE / Qwen2-MoE: layer i's MLP is the MoE unless i is in ``mlp_only_layers`` or
    (i + 1) % ``decoder_sparse_step`` ≠ 0 (transformers' rule). Mixtral: every layer's, experts of
    ``intermediate_size``, the top-k weights renormalised."""
    key = "num_experts" if "num_experts" in cfg else "num_local_experts"  # transformers ≥ 5.x: num_local_experts
    experts = _size(need(key), f"{source}: {key}")
    top_k = _size(need("num_experts_per_tok"), f"{source}: num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds {key}={experts}")
    if family == "mixtral":
        return MoE(num_experts=experts, top_k=top_k,
                   ffn_hidden_size=_size(need("intermediate_size"), f"{source}: intermediate_size"),
                   norm_topk_prob=True, shared_ffn_hidden_size=0, shared_expert_gate=False,
                   sparse_layers=(True,) * layers)
    step = _size(cfg.get("decoder_sparse_step", 1), f"{source}: decoder_sparse_step")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < layers for i in dense):
        raise ValueError(f"{source}: mlp_only_layers={dense!r} must be a list of layer indices in [0, {layers})")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    shared = cfg.get("shared_expert_intermediate_size") or 0 if family == "qwen2_moe" else 0
    return MoE(num_experts=experts, top_k=top_k,
               ffn_hidden_size=_size(need("moe_intermediate_size"), f"{source}: moe_intermediate_size"),
               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
               shared_ffn_hidden_size=_size(shared, f"{source}: shared_expert_intermediate_size") if shared else 0,
               shared_expert_gate=bool(shared), sparse_layers=sparse)


def _rope(cfg: Mapping[str, Any], source: str) -> tuple[float, Llama3RopeScaling | None]:
    """transformers 5.x keeps θ and scaling in ``rope_parameters``; 4.x in ``rope_theta``/``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    if "rope_theta" in params:
        theta = _number(params["rope_theta"], f"{source}: {key}.rope_theta")
    elif "rope_theta" in cfg:
        theta = _number(cfg["rope_theta"], f"{source}: rope_theta")
    else:
        raise KeyError(f"{source}: missing key 'rope_parameters.rope_theta' (or 'rope_theta')")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        def need(name: str) -> Any:
            if name not in params:
                raise KeyError(f"{source}: missing key '{key}.{name}' (rope_type 'llama3' needs it)")
            return params[name]

        scaling = Llama3RopeScaling(
            factor=_number(need("factor"), f"{source}: {key}.factor"),
            low_freq_factor=_number(need("low_freq_factor"), f"{source}: {key}.low_freq_factor"),
            high_freq_factor=_number(need("high_freq_factor"), f"{source}: {key}.high_freq_factor"),
            original_max_position_embeddings=_size(need("original_max_position_embeddings"),
                                                   f"{source}: {key}.original_max_position_embeddings"),
        )
        # Megatron's RotaryEmbedding._apply_scaling fixes these three; only the factor is an argument.
        fixed = Llama3RopeScaling(factor=scaling.factor, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192)
        if scaling != fixed:
            raise NotImplementedError(f"{source}: {key}={params!r}: Megatron's llama3 RoPE scaling "
                                      f"supports only {fixed}")
        return theta, scaling
    raise NotImplementedError(f"{source}: {key}.rope_type={rope_type!r} is not supported; "
                              "valid: 'default', 'llama3'")


def _size(value: Any, where: str) -> int:
    whole = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if not whole or value < 1:
        raise ValueError(f"{where}={value!r} must be an integer ≥ 1")
    return int(value)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}={value!r} must be a number")
    return float(value)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a usable HF checkpoint file ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a usable HF checkpoint file (a JSON object expected, got "
                         f"{type(data).__name__})")
    return data


# --- the directory ------------------------------------------------------------------------------


def inspect_model_dir(path: str | Path, *,
                      tokenizer_path: str | Path | None = None) -> tuple[HFArch | None, list[str]]:
    """The checkpoint's architecture (None when config.json is missing or unusable) and every problem
    with the directory: config.json (incl. what :class:`HFArch` does not support), weights, tokenizer.
    Each problem names the file (and key) it is about. Reads files only."""
    d = Path(path)
    if not d.is_dir():
        return None, [f"directory {d} does not exist (an HF checkpoint: config.json + *.safetensors + tokenizer)"]
    problems: list[str] = []
    arch: HFArch | None = None
    cfg = d / CONFIG_FILE
    if not cfg.is_file():
        problems.append(f"{cfg} is missing")
    else:
        try:
            arch = HFArch.from_hf(cfg)
        except (KeyError, ValueError, NotImplementedError) as e:
            problems.append(str(e.args[0]) if e.args else type(e).__name__)  # KeyError's str() adds quotes
    if not any((d / f).is_file() for f in WEIGHT_FILES):
        has_bin = any(d.glob("*.bin"))
        problems.append(
            f"{d} holds no {SINGLE_FILE} or {INDEX_FILE}"
            + (" (only *.bin weights: hybridrl reads safetensors; re-save with safe_serialization=True)"
               if has_bin else "")
        )
    tok = Path(tokenizer_path) if tokenizer_path else d
    if not any((tok / f).is_file() for f in TOKENIZER_FILES):
        problems.append(f"{tok} holds no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    return arch, problems


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """The stop ids: ``generation_config.json``'s ``eos_token_id`` (an id or a list), else config.json's."""
    root = Path(model_dir)
    eos = None
    if (root / GENERATION_CONFIG_FILE).is_file():
        eos = read_json(root / GENERATION_CONFIG_FILE).get("eos_token_id")
    if eos is None:
        if not (root / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{root}: no {CONFIG_FILE} (nor an eos_token_id in {GENERATION_CONFIG_FILE})")
        eos = read_json(root / CONFIG_FILE).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


