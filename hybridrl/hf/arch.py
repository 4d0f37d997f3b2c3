"""A Hugging Face checkpoint directory's architecture and problems (``config.json`` and what lies beside it).

- :class:`HFArch`: the part of ``config.json`` that decides the Megatron model, and how TP/PP/VPP may
  split it (:meth:`HFArch.split_problems`, the one statement of those rules).
- :func:`inspect_model_dir`: every problem with a checkpoint directory, as strings (static validation);
  :func:`eos_token_ids`.

Its tensors are :mod:`hybridrl.hf.tensors`; writing a checkpoint is :mod:`hybridrl.hf.write`.

Supported: the dense decoder families Qwen2/Qwen2.5 (QKV bias), Qwen3 (QK RMSNorm) and Llama
(RMSNorm, SwiGLU, GQA, RoPE, tied or untied embeddings), and the mixtures of experts Qwen3-MoE
(``mlp_only_layers``, ``decoder_sparse_step``, ``norm_topk_prob`` both ways), Qwen2-MoE (its gated shared
expert), Mixtral (every layer's MLP the MoE, top-k renormalised, no sliding window), GLM-4.5 (``glm4_moe``:
DeepSeek-V3's routing — sigmoid scores, a selection bias, grouped top-k, scaled weights — a shared expert, dense first
layers, attention bias, optional QK norm, partial RoPE) and DeepSeek-V3 (``deepseek_v3``, also Moonlight's, and
Kimi K2's as ``kimi_k2``: that routing with multi-latent attention, :class:`~hybridrl.hf.mla.MLA`): :class:`MoE`, and
where each family's checkpoint keeps a layer's router and experts (:data:`EXPERT_NAMES`). Anything else is an error
that names the file, the key, its value and what would be valid, so an unsupported checkpoint fails before any
process group or model is built.

Importing this module imports neither torch nor transformers (static validation runs without them).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hybridrl.hf.fp8 import read_fp8_blocks
from hybridrl.hf.mla import MLA, read_mla
from hybridrl.hf.values import divisors as _divisors
from hybridrl.hf.values import number as _number
from hybridrl.hf.values import positive_int as _size
from hybridrl.hf.vlm import VLM_FAMILIES, VisionSpec, language_config
from hybridrl.megatron.stages import PipelineSplit

Family = Literal["qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"]
FAMILIES: tuple[Family, ...] = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe",
                                "deepseek_v3")
# model_types that are a family's architecture under another name, read as that family. Kimi K2 (``kimi_k2``) is
# DeepSeek-V3's (its config.json: architectures ["DeepseekV3ForCausalLM"], auto_map to its own remote code);
# transformers registers no ``kimi_k2`` config (docs/operations.md)
FAMILY_ALIASES: dict[str, Family] = {"kimi_k2": "deepseek_v3"}
MOE_FAMILIES: tuple[Family, ...] = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")
SIGMOID_MOE_FAMILIES: tuple[Family, ...] = ("glm4_moe", "deepseek_v3")
# what transformers assumes where a sigmoid-routed family's config.json leaves a key out (its config class's defaults)
_SIGMOID_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4_moe": dict(norm_topk_prob=True, n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                     routed_scaling_factor=1.0),
    "deepseek_v3": dict(norm_topk_prob=True, n_group=8, topk_group=4, first_k_dense_replace=3, n_shared_experts=1,
                        routed_scaling_factor=2.5),
}

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

_TP = "tensor_model_parallel_size"
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
    ``<block>.gate.weight`` (the router; with :attr:`MoE.expert_bias` also ``<block>.gate.e_score_correction_bias``),
    ``<block>.experts.<e>.<gate|up|down>.weight`` (each expert's SwiGLU: down(silu(gate(x)) * up(x))) and
    ``<block>.<shared>.{gate,up,down}_proj.weight`` (the shared expert, where there is one). transformers ≥ 5 fuses
    the experts in memory but saves and loads these names."""

    block: str
    gate: str
    up: str
    down: str
    shared: str = "shared_expert"


EXPERT_NAMES: dict[str, ExpertNames] = {  # by model_type
    "qwen3_moe": ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "qwen2_moe": ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "mixtral": ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
    "glm4_moe": ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj", shared="shared_experts"),
    "deepseek_v3": ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj",
                               shared="shared_experts"),
}


@dataclass(slots=True, kw_only=True, frozen=True)
class MoE:
    """The mixture-of-experts MLP of Qwen3-MoE / Qwen2-MoE / Mixtral / GLM-4.5 layers, in Megatron's terms.

    Softmax routing (Qwen, Mixtral): p = softmax(router(x)) in fp32, the top-k experts by p, weights p_topk —
    renormalised to sum 1 when ``norm_topk_prob`` (Megatron: softmax over the top-k logits,
    ``moe_router_pre_softmax=False``), else as they are (softmax first, ``moe_router_pre_softmax=True``); Mixtral
    always renormalises. Qwen2-MoE adds a shared expert on every token, scaled by sigmoid(shared_expert_gate(x)).

    Sigmoid routing (GLM-4.5; DeepSeek-V3's): s = sigmoid(router(x)) in fp32; experts are chosen by s + b
    (``expert_bias``: the checkpoint's ``e_score_correction_bias``), first the ``group_topk`` best of ``num_groups``
    equal groups (a group scored by the sum of its two best), then the top-k within them; the weights are the chosen
    s, renormalised to sum 1 and times ``scaling_factor``. The shared expert is ungated.
    """

    num_experts: int
    top_k: int
    ffn_hidden_size: int  # each expert's: HF moe_intermediate_size (Mixtral: intermediate_size)
    norm_topk_prob: bool
    shared_ffn_hidden_size: int  # Qwen2-MoE's shared expert (HF shared_expert_intermediate_size); 0: none
    shared_expert_gate: bool  # Qwen2-MoE: the shared expert's sigmoid gate
    sparse_layers: tuple[bool, ...]  # per layer: True where the MLP is the MoE, False a dense MLP
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    expert_bias: bool = False  # sigmoid routing: a per-expert bias added to the scores for choosing only
    num_groups: int | None = None  # grouped top-k (HF n_group); None: every expert is a candidate
    group_topk: int | None = None  # groups each token may choose from (HF topk_group)
    scaling_factor: float | None = None  # the top-k weights' factor (HF routed_scaling_factor); None: 1

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
    rotary_percent: float = 1.0  # the leading part of each head that RoPE rotates (HF partial_rotary_factor)
    mla: MLA | None = None  # DeepSeek-V3's attention; None: GQA over q/k/v projections
    fp8_blocks: tuple[int, int] | None = None  # FP8 linear weights, one scale per block this shape (hybridrl.hf.fp8)
    # a reward model's layout (*ForSequenceClassification, one label): a scalar ``score.weight`` [1, hidden] in place
    # of the LM head; set by the model that trains one (hybridrl.megatron.reward_model), never read from config.json
    score_head: bool = False
    # a vision-language model's language model (hybridrl.hf.vlm): multimodal RoPE's (time, height, width) split of
    # the rotary dims, and the vision side; None: a text-only causal LM
    mrope_section: tuple[int, ...] | None = None
    vision: VisionSpec | None = None

    @property
    def hf_prefix(self) -> str:
        """The checkpoint's prefix of the language model's tensors: ``model.`` (``model.layers.0.…``), or a VLM
        family's own (Qwen3-VL: ``model.language_model.``)."""
        return "model." if self.vision is None else self.vision.text_prefix

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def split_problems(self, *, tp: int, pp: int, vpp: int | None = None, ep: int = 1, etp: int | None = None,
                       first: int | None = None, last: int | None = None) -> list[tuple[str, int, str]]:
        """Every way ``tp``/``pp``(×``vpp``) fail to split this model evenly, as ``(key, value, message)``
        with key one of ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
        ``virtual_pipeline_model_parallel_size``, ``expert_model_parallel_size``, ``expert_tensor_parallel_size``
        (``etp``: the experts' TP, null = ``tp``), or ``override_transformer_config.num_layers_in_first_pipeline_stage``
        / ``..._last_...`` (``first``/``last``: uneven end stages, :class:`~hybridrl.megatron.stages.PipelineSplit`,
        which states the layer rules); the message reads after ``<key>=<value>: ``.

        Only the model's rules: sizes < 1, VPP without PP and the world size are the caller's.
        """
        heads, kv, ffn, layers = self.num_attention_heads, self.num_query_groups, self.ffn_hidden_size, self.num_layers
        out: list[tuple[str, int, str]] = []
        if tp >= 1 and heads % tp:
            out.append((_TP, tp, f"must divide the model's {heads} attention heads (valid: {_divisors(heads)})"))
        if tp >= 1 and kv % tp:
            out.append((_TP, tp, f"must divide the model's {kv} KV heads (GQA groups) (valid: {_divisors(kv)})"))
        if self.mla is not None and tp >= 1:  # the latent down projections: column-parallel, gathered
            for key, size in (("q_lora_rank", self.mla.q_lora_rank),
                              ("kv_lora_rank + qk_rope_head_dim", self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)):
                if size is not None and size % tp:
                    out.append((_TP, tp, f"must divide the model's {key}={size} (Megatron splits the latent down "
                                        f"projection's rows over TP) (valid: {_divisors(size)})"))
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
        split = PipelineSplit(num_layers=layers, pp=pp, vpp=vpp if vpp is not None and vpp >= 1 else None,
                              first=first, last=last)
        out += split.problems()
        return out

    def check_split(self, *, tp: int, pp: int, vpp: int | None = None, ep: int = 1, etp: int | None = None,
                    first: int | None = None, last: int | None = None) -> None:
        """Raise ``ValueError`` listing :meth:`split_problems` unless the sizes split this model."""
        problems = self.split_problems(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, first=first, last=last)
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
        if config.get("model_type") in VLM_FAMILIES:
            text, section, vision = language_config(config, source)
            return dataclasses.replace(_parse(text, source), mrope_section=section, vision=vision)
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

    if cfg.get("model_type") in FAMILY_ALIASES:
        cfg = {**cfg, "model_type": FAMILY_ALIASES[cfg["model_type"]]}
    family = need("model_type")
    if family not in FAMILIES:
        raise NotImplementedError(f"{source}: model_type={family!r} is not supported; valid: "
                                  f"{FAMILIES + tuple(FAMILY_ALIASES)}")
    expect("hidden_act", "silu", "silu")
    expect("use_sliding_window", False, False)
    expect("mlp_bias", False, False)
    if family not in ("qwen2", "glm4_moe"):  # Qwen2's q/k/v bias is fixed in its code; this key adds o_proj's
        expect("attention_bias", False, False)  # DeepSeek-V3: q_a, kv_a and o_proj's
    if family == "mixtral":  # no use_sliding_window switch: a window is on when set
        expect("sliding_window", None, None)
        expect("router_jitter_noise", 0.0, 0.0)  # training-time noise on the router's input

    hidden = _size(need("hidden_size"), f"{source}: hidden_size")
    heads = _size(need("num_attention_heads"), f"{source}: num_attention_heads")
    kv_heads = _size(cfg.get("num_key_value_heads") or heads, f"{source}: num_key_value_heads")  # absent: MHA
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    mla = read_mla(cfg, source, heads, kv_heads, need) if family == "deepseek_v3" else None
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
        head_dim=mla.q_head_dim if mla else _size(cfg.get("head_dim") or hidden // heads, f"{source}: head_dim"),
        rms_norm_eps=_number(need("rms_norm_eps"), f"{source}: rms_norm_eps"),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_size(need("max_position_embeddings"), f"{source}: max_position_embeddings"),
        tie_word_embeddings=bool(need("tie_word_embeddings")),
        qkv_bias=(family == "qwen2" or family == "qwen2_moe" and bool(cfg.get("qkv_bias", True))
                  or family == "glm4_moe" and bool(cfg.get("attention_bias", False))),  # GLM: q/k/v only, as Qwen2
        qk_layernorm=family in ("qwen3", "qwen3_moe") or family == "glm4_moe" and bool(cfg.get("use_qk_norm", False)),
        moe=moe,
        rotary_percent=_rotary_percent(cfg, source) if family == "glm4_moe" else 1.0,
        mla=mla,
        fp8_blocks=read_fp8_blocks(cfg, source),
    )


def _moe(cfg: Mapping[str, Any], source: str, family: str, layers: int, need: Any) -> MoE:
    """Qwen3-MoE / Qwen2-MoE: layer i's MLP is the MoE unless i is in ``mlp_only_layers`` or
    (i + 1) % ``decoder_sparse_step`` ≠ 0 (transformers' rule). Mixtral: every layer's, experts of
    ``intermediate_size``, the top-k weights renormalised. GLM-4.5, DeepSeek-V3: :func:`_sigmoid_moe`."""
    if family in SIGMOID_MOE_FAMILIES:
        return _sigmoid_moe(cfg, source, layers, need, _SIGMOID_DEFAULTS[family])
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


def _sigmoid_moe(cfg: Mapping[str, Any], source: str, layers: int, need: Any, defaults: Mapping[str, Any]) -> MoE:
    """DeepSeek-V3-style MoE by its config keys (GLM-4.5's; DeepSeek-V3 names them the same): layers
    ``< first_k_dense_replace`` dense (``intermediate_size``), the rest the MoE: ``n_routed_experts`` experts of
    ``moe_intermediate_size``, sigmoid routing with ``e_score_correction_bias``, ``n_group``/``topk_group`` grouped
    top-k, ``routed_scaling_factor``, and ``n_shared_experts`` × ``moe_intermediate_size`` of ungated shared expert.
    What Megatron's router computes otherwise than transformers is refused, naming the key. ``defaults``: the
    family's config class's values for absent keys."""
    cfg = {**defaults, **cfg}
    experts = _size(need("n_routed_experts"), f"{source}: n_routed_experts")
    top_k = _size(need("num_experts_per_tok"), f"{source}: num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds n_routed_experts={experts}")
    norm = bool(cfg["norm_topk_prob"])
    if norm != (top_k > 1):  # topk_routing_with_score_function: probs = s / sum(s) iff topk > 1
        raise NotImplementedError(f"{source}: norm_topk_prob={norm} with num_experts_per_tok={top_k} is not "
                                  f"supported; valid: {top_k > 1} (Megatron renormalises sigmoid top-k weights "
                                  "exactly when more than one expert is chosen)")
    groups = _size(cfg["n_group"], f"{source}: n_group")
    group_topk = _size(cfg["topk_group"], f"{source}: topk_group")
    if experts % groups or group_topk > groups:
        raise ValueError(f"{source}: n_group={groups} must divide n_routed_experts={experts} and topk_group="
                         f"{group_topk} must not exceed it")
    grouped = group_topk < groups
    if grouped and top_k // group_topk != 2:  # group_limited_topk: a group's score is its top (k // topk_group)
        raise NotImplementedError(
            f"{source}: topk_group={group_topk} with num_experts_per_tok={top_k} and n_group={groups} is not "
            f"supported: transformers scores an expert group by its 2 best experts, Megatron by its "
            f"num_experts_per_tok // topk_group = {top_k // group_topk}; valid: a topk_group that makes it 2, or "
            f"topk_group = n_group")
    dense = cfg["first_k_dense_replace"]
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense <= layers:
        raise ValueError(f"{source}: first_k_dense_replace={dense!r} must be an integer in [0, {layers}]")
    ffn = _size(need("moe_intermediate_size"), f"{source}: moe_intermediate_size")
    shared = cfg["n_shared_experts"]
    scale = _number(cfg["routed_scaling_factor"], f"{source}: routed_scaling_factor")
    return MoE(num_experts=experts, top_k=top_k, ffn_hidden_size=ffn, norm_topk_prob=norm,
               shared_ffn_hidden_size=_size(shared, f"{source}: n_shared_experts") * ffn if shared else 0,
               shared_expert_gate=False, sparse_layers=tuple(i >= dense for i in range(layers)),
               score_function="sigmoid", expert_bias=True, num_groups=groups if grouped else None,
               group_topk=group_topk if grouped else None, scaling_factor=scale if scale != 1.0 else None)


def _rotary_percent(cfg: Mapping[str, Any], source: str) -> float:
    """GLM-4.5's ``partial_rotary_factor`` (in ``rope_parameters`` in transformers 5.x, top level in 4.x; absent:
    Glm4MoeConfig's 0.5): RoPE rotates the leading ``head_dim × factor`` dims of each head, rotate-half style as
    Megatron's ``rotary_percent`` (not interleaved)."""
    params = cfg.get("rope_parameters") or {}
    key = "rope_parameters.partial_rotary_factor" if "partial_rotary_factor" in params else "partial_rotary_factor"
    value = _number(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)), f"{source}: {key}")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{source}: {key}={value!r} must lie in (0, 1]")
    return value


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
    if rope_type == "default" or (rope_type == "yarn" and cfg.get("model_type") == "deepseek_v3"):
        return theta, None  # (DeepSeek-V3's YaRN is its attention's: hybridrl.hf.mla)
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


