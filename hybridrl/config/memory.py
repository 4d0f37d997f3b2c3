"""Per-rank device memory of a run, estimated from the config before anything is built.

The largest rank of a layout (the first pipeline stage with the embedding, or the last with the
output layer) holds, in bytes:

    params      = P_rank · b_dtype                 P_rank: the rank's share of the parameters (TP, PP split)
    grads       = P_rank · 4                       Megatron's DDP grad buffer (fp32 accumulation)
    optimizer   = P_rank · (m + 8) / D             Adam moments (fp32) + fp32 main weights (m = 4 unless the
                                                   params are fp32 already); D = DP with the distributed optimizer.
                                                   With Megatron's optimizer CPU offload (override_optimizer_config:
                                                   optimizer_cpu_offload, fraction f) the moments of f of the
                                                   parameters live in host memory, and their fp32 main weights too
                                                   under use_precision_aware_optimizer (else the distributed
                                                   optimizer keeps them on the device and the host holds a copy):
                                                   P_rank · (m·(1 − f) or m + 8·(1 − f)) / D on the device,
                                                   P_rank · f · (4 + 4 + 8) / D on the host (fp32 weights,
                                                   gradients, moments)
    ref         = P_rank · b_dtype                 when a KL term needs the reference model
    teacher     = P^T_rank · b_dtype               the distillation teacher's share, split as the actor's (its own
                                                   architecture; its log-prob pass runs between the others)
    critic      = P_rank · (b_dtype + 4) + optimizer   when a critic is built: its params, grads and optimizer
                                                   state, taken as the actor's (an upper bound: its head is
                                                   one row, not the vocabulary); it trains between, not
                                                   alongside, the actor's passes, so no activations are added
    activations = L_rank · t · h · 34 / TP + t · V / TP · 12
                                                   t: tokens per micro-batch; 34 bytes per token and hidden unit
                                                   per layer without recompute (Korthikanti et al. 2022,
                                                   "Reducing Activation Recomputation", attention scores left out:
                                                   flash/fused attention); with full recompute only each layer's
                                                   input (2 bytes) plus one layer; the fp32 logits with the
                                                   log-softmax temporaries (3 × 4 bytes)
    engine      = what the engine takes at start: an engine with a memory pool (vLLM, SGLang on GPU) takes its
                  budget, gpu_memory_utilization × the device (``actor_rollout_ref.rollout.gpu_memory_utilization``,
                  verl's key: weights, KV pool and workspace), and pages the step's samples through its KV pool:
                  pool = budget − P · 2 / rollout TP (P at ~1 byte where the checkpoint's weights are FP8,
                  :func:`engine_weight_bytes`); it holds ⌊pool / (2 · layers · KV heads · head_dim · 2 bytes
                  · (max_prompt_length + max_response_length) / rollout TP)⌋ sequences of the longest length at
                  once (multi-latent attention: layers · (kv_lora_rank + qk_rope_head_dim) · 2 bytes a token, on every
                  engine rank) and runs the rest as they finish. An engine without a pool (``hf``) takes its bf16
                  weights + the KV cache of its whole share of a step's prompts.
    stages      = which layers each pipeline stage holds (:mod:`hybridrl.megatron.stages`: equal blocks, or uneven
                  end stages): the largest rank is the largest stage's, its ends (embedding, output layer) included.

Generation holds the engine and whatever is not offloaded (``param_offload``, ``grad_offload``,
``optimizer_offload``, ``ref.megatron.param_offload``, ``critic.megatron.*_offload``); training holds the
actor state, the ref, the critic state, the activations and what the engine keeps after ``release_memory``
(its plugin's ``memory_budget`` says: vLLM's sleep mode frees both, SGLang's memory saver the KV pool and, with
``release_weights``, the weights; the ``hf`` engine keeps its weights). The allocator's fragmentation and
CUDA/NCCL workspaces (a few GB) come on top.

Two numbers are checked against the device (``trainer.device_memory_gb``): the **model state** (``state``: the
weights of every model on the rank, the actor's and critic's gradients and optimizer state, each phase holding what
it does) is counted exactly and what cannot fit is refused; the **peak** adds the activations and the engine's KV
(a pool's share or an estimate of what the samples need), which are estimates — over the device they are a warning
naming what would help (verl's published setups run where this estimate says they need a few GB more).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridrl.hf.arch import HFArch
from hybridrl.interfaces import EngineMemory
from hybridrl.megatron.stages import PipelineSplit

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    params: float  # bytes, per rank
    grads: float
    optimizer: float
    ref: float
    activations: float
    engine_weights: float
    engine_kv: float
    offloaded: float  # moved to host while the engine generates
    critic: float = 0.0
    engine_kept: float | None = None  # what the engine holds through training (None: its weights)
    seq_kv: float = 0.0  # the KV cache of one sequence of the longest length, on one engine rank
    pooled: bool = False  # engine_kv is a pool the engine pages its samples through (else its samples' need)
    teacher: float = 0.0  # the distillation teacher's weights
    optimizer_host: float = 0.0  # Megatron's optimizer CPU offload: the actor's optimizer bytes in host memory
    host_fraction: float = 0.0  # ... the share of its parameters they are (optimizer_offload_fraction)

    @property
    def generate(self) -> float:
        resident = self.params + self.grads + self.optimizer + self.ref + self.teacher + self.critic - self.offloaded
        return resident + self.engine_weights + self.engine_kv

    @property
    def train(self) -> float:
        kept = self.engine_weights if self.engine_kept is None else self.engine_kept
        return (self.params + self.grads + self.optimizer + self.ref + self.teacher + self.critic + self.activations
                + kept)

    @property
    def kept_weights(self) -> float:
        """The engine's weights held through training (what it keeps after ``release_memory``, at most them)."""
        return self.engine_weights if self.engine_kept is None else min(self.engine_kept, self.engine_weights)

    @property
    def state(self) -> float:
        """The model state of the larger phase: every model's weights, the trained ones' gradients and optimizer
        state (less what is offloaded while generating) — no activations, no KV."""
        trainer = self.params + self.grads + self.optimizer + self.ref + self.teacher + self.critic
        return max(trainer - self.offloaded + self.engine_weights, trainer + self.kept_weights)

    @property
    def sequences_at_once(self) -> int | None:
        """Sequences of the longest length the engine's KV pool holds at once (None: no pool)."""
        if not self.pooled or self.seq_kv <= 0:
            return None
        return max(int(self.engine_kv // self.seq_kv), 0)

    @property
    def peak(self) -> float:
        return max(self.generate, self.train)

    def __str__(self) -> str:
        parts = {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "ref": self.ref,
                 "teacher": self.teacher, "critic": self.critic, "activations": self.activations,
                 "engine weights": self.engine_weights, "engine KV": self.engine_kv}
        if self.pooled:
            parts["engine KV pool"] = parts.pop("engine KV")
        shown = ", ".join(f"{k} {v / GB:.1f}" for k, v in parts.items() if v)
        fit = self.sequences_at_once
        if self.host_fraction:
            shown += (f" GB; in host memory, not counted: {self.optimizer_host / GB:.1f} GB of the optimizer "
                      f"(optimizer_cpu_offload: the fp32 weights, gradients and state of {self.host_fraction:.0%} of "
                      "the parameters)")
        else:
            shown += " GB"
        return (f"{shown} → generate {self.generate / GB:.1f} GB, train {self.train / GB:.1f} GB "
                f"(offloaded while generating {self.offloaded / GB:.1f} GB"
                + (f"; the KV pool holds {fit} sequence(s) of the longest length at once" if fit is not None else "")
                + ")")


def parameter_count(m: HFArch) -> tuple[int, int, int]:
    """``(per layer, embedding, output layer)`` parameter counts (output 0 when tied to the embedding); an MoE
    model's per-layer count is the mean over its layers, every expert counted (:func:`layer_counts`)."""
    per_layer = layer_counts(m)
    layer = round(sum(a + e for a, e in per_layer) / len(per_layer))
    embedding = m.vocab_size * m.hidden_size
    return layer, embedding, 0 if m.tie_word_embeddings else embedding


def layer_counts(m: HFArch) -> list[tuple[int, int]]:
    """Each layer's ``(parameters outside the experts, parameters of its experts)``: the experts split over EP
    ranks, the rest does not (a dense model: ``(all, 0)``)."""
    q, kv, h = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim, m.hidden_size
    attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if m.qkv_bias else 0)
    attention += 2 * m.head_dim if m.qk_layernorm else 0
    if (a := m.mla) is not None:  # DeepSeek-V3's latent projections and their norms
        heads = m.num_attention_heads
        query = (h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * heads * a.q_head_dim if a.q_lora_rank
                 else h * heads * a.q_head_dim)
        latent = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
        attention = (query + latent + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
                     + heads * a.v_head_dim * h)
    dense = attention + 3 * h * m.ffn_hidden_size + 2 * h
    moe = m.moe
    if moe is None:
        return [(dense, 0)] * m.num_layers
    shared = 3 * h * moe.shared_ffn_hidden_size + (h if moe.shared_expert_gate else 0)
    sparse = (attention + moe.num_experts * h + shared + 2 * h, moe.num_experts * 3 * h * moe.ffn_hidden_size)
    return [sparse if s else (dense, 0) for s in moe.sparse_layers]


def estimate(m: HFArch, *, tp: int, pp: int, dp: int, dtype: str, distributed_optimizer: bool, optimizer: str,
             ref: bool, micro_tokens: int, recompute: bool, offload: dict[str, bool], rollout_tp: int,
             engine_tokens: int, critic: bool = False, critic_offload: dict[str, bool] | None = None,
             engine: EngineMemory | None = None, device_bytes: float = 80 * GB, seq_len: int = 0,
             ep: int = 1, etp: int | None = None, teacher: HFArch | None = None,
             teacher_offload: bool = False, lora_rank: int = 0,
             lora_projections: tuple[str, ...] = (), split: PipelineSplit | None = None,
             engine_weight_bytes: float | None = None, lm_head: bool = True, vision_params: int = 0,
             vision_trained: bool = False, host_fraction: float = 0.0,
             precision_aware: bool = False) -> MemoryEstimate:
    """``engine``: the rollout engine's own memory plan (None: weights + the KV of its ``engine_tokens``);
    ``device_bytes`` sizes its budget; ``seq_len``: the longest sequence (prompt + response); ``ep``: the
    experts of an MoE model split over that many ranks (the largest PP stage counts), each expert over ``etp`` (its
    own TP; None: ``tp``); ``lora_rank`` > 0: only the adapters of ``lora_projections`` train (gradients and optimizer
    state are theirs; the ref is the actor with its adapters off, no copy); ``teacher``: the
    distillation teacher's architecture (its weights offloaded while generating with ``teacher_offload``); ``split``:
    the layers of each pipeline stage (None: ``pp`` equal blocks; the largest stage counts); ``engine_weight_bytes``:
    the engine's weights over all its ranks (None: every parameter in bf16); ``lm_head`` False: the last stage
    computes no vocabulary logits (a reward model's scalar head); ``vision_params``: a VLM's vision tower, replicated
    on the rank (and in the ref and the engine, whose TP splits it), with gradients and optimizer state when
    ``vision_trained`` (its activations — a few hundred patches an image — are left out); ``host_fraction``: the
    share of the optimizer's parameters Megatron's CPU offload updates in host memory (their fp32 main weights with
    them when ``precision_aware``)."""
    etp = tp if etp is None else etp
    split = split or PipelineSplit(num_layers=m.num_layers, pp=pp)
    p_rank, experts = rank_parameters(m, tp=tp, pp=pp, ep=ep, etp=etp, split=split)
    _, embedding, output = parameter_count(m)
    per_layer = layer_counts(m)
    layers = max(split.stage_counts())
    b = BYTES[dtype]
    moments = 8 if optimizer == "adam" else 0
    main = 0 if dtype == "float32" else 4
    on_device = main * ((1 - host_fraction) if precision_aware else 1) + moments * (1 - host_fraction)
    on_host = host_fraction * (4 + 4 + moments)  # fp32 weights, gradients and state of the CPU optimizer
    # the distributed optimizer shards over DP, an expert's state over its own data-parallel ranks (TP·DP / (EP·ETP))
    expert_dp = max(tp * dp // (ep * etp), 1)
    shards = (p_rank - experts / etp) / dp + experts / etp / expert_dp if distributed_optimizer else p_rank
    optimizer_params = shards
    per_layer_act = 2 if recompute else 34 / tp
    activations = micro_tokens * m.hidden_size * (layers * per_layer_act + (34 / tp if recompute else 0))
    activations += micro_tokens * m.vocab_size / tp * 12 if lm_head else 0.0
    total_params = sum(a + e for a, e in per_layer) + embedding + output + m.hidden_size
    kv_per_token = 2 * m.num_layers * m.num_query_groups * m.head_dim * 2 / rollout_tp
    if m.mla is not None:  # MLA caches the latent and the rope key (SGLang's MLA: the whole of it on every TP rank)
        kv_per_token = m.num_layers * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * 2
    engine_weights = (total_params * 2 if engine_weight_bytes is None else engine_weight_bytes) / rollout_tp
    params, grads, ref_bytes = p_rank * b, p_rank * 4, p_rank * b if ref else 0.0
    if vision_params:
        params, ref_bytes = params + vision_params * b, ref_bytes + (vision_params * b if ref else 0.0)
        engine_weights += vision_params * 2 / rollout_tp
        if vision_trained and lora_rank <= 0:
            grads += vision_params * 4
            optimizer_params += vision_params / (dp if distributed_optimizer else 1)
    if lora_rank > 0:  # the base is frozen: the adapters alone have gradients and optimizer state
        adapters = lora_parameters(m, rank=lora_rank, projections=lora_projections) / (tp * pp)
        params, grads, ref_bytes = params + adapters * b, adapters * 4, 0.0
        optimizer_params = adapters / (dp if distributed_optimizer else 1)
    optim = optimizer_params * on_device
    teacher_bytes = (rank_parameters(teacher, tp=tp, pp=pp, ep=ep, etp=etp, split=replace(
        split, num_layers=teacher.num_layers))[0] * b if teacher is not None else 0.0)
    offloaded = (params * offload.get("param", False) + grads * offload.get("grad", False)
                 + optim * offload.get("optimizer", False) + ref_bytes * offload.get("ref_param", False)
                 + teacher_bytes * teacher_offload)
    critic_bytes = 0.0
    if critic:  # its own optimizer, without the actor's CPU offload
        critic_offload, critic_optim = critic_offload or {}, optimizer_params * (main + moments)
        critic_bytes = params + grads + critic_optim
        offloaded += (params * critic_offload.get("param", False) + grads * critic_offload.get("grad", False)
                      + critic_optim * critic_offload.get("optimizer", False))
    engine_kv, kept = engine_tokens * kv_per_token, None
    if engine is not None:
        engine_kv = (engine.kv_pool_bytes if engine.kv_pool_bytes is not None
                     else max(engine.fraction * device_bytes - engine_weights, 0.0))
        kept = engine_weights * (not engine.weights_released) + engine_kv * (not engine.kv_released)
    return MemoryEstimate(params=params, grads=grads, optimizer=optim, ref=ref_bytes, activations=activations,
                          engine_weights=engine_weights, engine_kv=engine_kv, offloaded=offloaded,
                          critic=critic_bytes, engine_kept=kept, seq_kv=seq_len * kv_per_token,
                          pooled=engine is not None, teacher=teacher_bytes,
                          optimizer_host=optimizer_params * on_host, host_fraction=host_fraction)


def engine_weight_bytes(m: HFArch) -> float:
    """The weights an engine loads from ``m``'s checkpoint, over all its ranks: every parameter in bf16; or, for
    block-wise FP8 weights (``m.fp8_blocks``, :mod:`hybridrl.hf.fp8`), the linear layers' weights at 1 byte and one
    fp32 scale a block (taken as ``params / block`` scales: the big matrices are whole blocks), the embedding,
    output layer, norms and routers in bf16 — what SGLang and vLLM hold serving that checkpoint as shipped."""
    _, embedding, output = parameter_count(m)
    per_layer = layer_counts(m)
    total = sum(a + e for a, e in per_layer) + embedding + output + m.hidden_size
    if m.fp8_blocks is None:
        return total * 2.0
    h, heads = m.hidden_size, m.num_attention_heads
    norms = 2 * h + (2 * m.head_dim if m.qk_layernorm else 0)
    if m.mla is not None:
        norms += (m.mla.q_lora_rank or 0) + m.mla.kv_lora_rank
    elif m.qkv_bias:
        norms += (heads + 2 * m.num_query_groups) * m.head_dim
    routers = [m.moe.num_experts * h if m.moe is not None and sparse else 0
               for sparse in (m.moe.sparse_layers if m.moe is not None else (False,) * m.num_layers)]
    kept = m.num_layers * norms + sum(routers) + embedding + output + m.hidden_size  # bf16
    block = m.fp8_blocks[0] * m.fp8_blocks[1]
    return (total - kept) * (1 + 4 / block) + kept * 2.0


def lora_parameters(m: HFArch, *, rank: int, projections: tuple[str, ...]) -> float:
    """The adapters' parameters over the whole model: ``rank × (in + out)`` for each adapted projection of every
    layer (the attention's everywhere, the MLP's in dense layers: experts are not adapted)."""
    q, kv, h = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim, m.hidden_size
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
    mlp = {"gate_proj": h + m.ffn_hidden_size, "up_proj": h + m.ffn_hidden_size, "down_proj": m.ffn_hidden_size + h}
    dense_layers = m.num_layers if m.moe is None else sum(not s for s in m.moe.sparse_layers)
    per_attention = sum(sizes.get(p, 0) for p in projections)
    per_mlp = sum(mlp.get(p, 0) for p in projections)
    return float(rank * (m.num_layers * per_attention + dense_layers * per_mlp))


def rank_parameters(m: HFArch, *, tp: int, pp: int, ep: int = 1, etp: int | None = None,
                    split: PipelineSplit | None = None) -> tuple[float, float]:
    """``(P_rank, experts)``: the largest rank's share of ``m``'s parameters under TP/PP/EP (each expert split over
    ``etp``, None: ``tp``), and the expert parameters of its stage (before that split). ``split``: which layers each
    stage holds (None: ``pp`` equal blocks)."""
    _, embedding, output = parameter_count(m)
    per_layer = layer_counts(m)
    split = split or PipelineSplit(num_layers=m.num_layers, pp=pp)
    stages = []
    for s in range(pp):
        held = [per_layer[i] for r in split.layers(s) for i in r if i < len(per_layer)]
        # one stage holds both ends; with PP > 1 the first holds the embedding, the last an output layer of the
        # same size (a tied one is a copy there) and the final norm
        edge = (embedding if s == 0 else 0) + ((output or embedding * (pp > 1)) + m.hidden_size if s == pp - 1
                                               else 0)
        experts = sum(e for _, e in held) / ep
        stages.append(((sum(a for a, _ in held) + edge) / tp + experts / (tp if etp is None else etp), experts))
    return max(stages)
