"""The plan's per-rank memory estimate: parameter counts exact, the 7B recipe fits, a layout that can't is
rejected naming the keys that would shrink it (``hybridrl validate``, no weights loaded, no GPU needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridrl.config.memory import GB, engine_weight_bytes, estimate, layer_counts, parameter_count, rank_parameters
from hybridrl.hf.arch import HFArch
from hybridrl.interfaces import EngineMemory
from hybridrl.megatron.stages import PipelineSplit
from hybridrl.models.tiny import make_tiny_model

QWEN7B = Path(__file__).resolve().parents[2] / "recipes" / "model_configs" / "qwen2.5-7b.json"
QWEN30B_A3B = QWEN7B.with_name("qwen3-30b-a3b.json")
AOR = "actor_rollout_ref"


@pytest.mark.parametrize(("arch", "tie"), [("qwen2", True), ("qwen3", False), ("llama", False)])
def test_parameter_count_is_the_models(tmp_path: Path, arch: str, tie: bool) -> None:
    path = make_tiny_model(tmp_path / arch, arch=arch, hidden=64, layers=3, heads=4, kv_heads=2, tie=tie)
    layer, embedding, output = parameter_count(HFArch.from_hf(path))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert 3 * layer + embedding + output + 64 == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_an_moe_models_parameters_are_counted_layer_by_layer(tmp_path: Path, arch: str) -> None:
    """Every expert counted, dense layers (``mlp_only_layers``) and the shared expert too: the model's own count."""
    moe = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1],
               **({"shared_expert_intermediate_size": 40} if arch == "qwen2_moe" else {}))
    path = make_tiny_model(tmp_path / arch, arch=arch, hidden=64, layers=3, heads=4, kv_heads=2, tie=False, moe=moe)
    m = HFArch.from_hf(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(a + e for a, e in layer_counts(m)) + 2 * m.vocab_size * 64 + 64 == sum(
        p.numel() for p in model.parameters())


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_multi_latent_attention_is_counted_as_the_model_has_it(tmp_path: Path, q_lora_rank: int | None) -> None:
    """DeepSeek-V3's latent projections (with and without the query LoRA), their norms, the experts: the model's own
    count; and its published config is its 671 B parameters (the multi-token-prediction layer aside); its FP8 engine
    weights, its latent KV cache and its largest stage under uneven pipeline stages."""
    path = make_tiny_model(tmp_path / f"dsv3_{q_lora_rank}", arch="deepseek_v3", hidden=48, layers=3, heads=4,
                           intermediate=40, tie=False, moe=dict(moe_intermediate_size=16, q_lora_rank=q_lora_rank))
    m = HFArch.from_hf(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(a + e for a, e in layer_counts(m)) + 2 * m.vocab_size * 48 + 48 == sum(
        p.numel() for p in model.parameters())
    v3 = HFArch.from_hf(QWEN7B.with_name("deepseek-v3.json"))
    assert sum(a + e for a, e in layer_counts(v3)) + 2 * v3.vocab_size * v3.hidden_size == pytest.approx(671e9,
                                                                                                         rel=0.001)
    # FP8 as shipped (hybridrl.hf.fp8): every linear weight but the routers' and the output layer's at 1 byte + a
    # 4-byte scale a block; with 1×1 blocks that is 5 bytes against bf16's 2, so the difference counts them exactly
    linear = sum(mod.weight.numel() for name, mod in model.named_modules()
                 if isinstance(mod, torch.nn.Linear) and name != "lm_head" and not name.endswith("mlp.gate"))
    linears = [n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]
    linear += sum(p.numel() for name, p in model.named_parameters()  # transformers ≥ 5 fuses the experts in memory
                  if ".experts." in name and not any(name.startswith(n) for n in linears))
    fp8 = replace(m, fp8_blocks=(1, 1))
    assert engine_weight_bytes(fp8) - engine_weight_bytes(m) == 3 * linear
    assert engine_weight_bytes(replace(v3, fp8_blocks=None)) / engine_weight_bytes(v3) == pytest.approx(2, rel=0.01)
    # its KV cache: the latent and the rope key of each layer, 2 bytes each, whole on every engine rank
    kw = dict(tp=8, pp=4, dp=4, dtype="bfloat16", optimizer="adam", ref=False, micro_tokens=4096, recompute=True,
              rollout_tp=8, engine_tokens=0, distributed_optimizer=True, offload={}, seq_len=1, ep=32, etp=1)
    assert estimate(v3, **kw).seq_kv == 61 * (512 + 64) * 2
    # uneven stages: the largest rank is the largest stage's (16 + 15 + 15 + 15: a stage of 15 MoE layers; 19 + 14
    # × 3: the first, 3 dense and 16 MoE layers)
    per_moe_layer = layer_counts(v3)[-1][1] / 32
    for first, last, moe_layers in ((16, 15, 15), (19, 14, 16)):
        split = PipelineSplit(num_layers=61, pp=4, first=first, last=last)
        experts = rank_parameters(v3, tp=8, pp=4, ep=32, etp=1, split=split)[1]
        assert experts == pytest.approx(moe_layers * per_moe_layer)


def test_qwen3_30b_a3b_has_30b_parameters_and_expert_parallelism_splits_its_experts() -> None:
    """Qwen3-30B-A3B's published config (30.5 B parameters): the count, and EP=8 holding 1/8 of the experts."""
    cfg = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
           "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
           "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu"}
    m = HFArch.from_hf(cfg)
    total = sum(a + e for a, e in layer_counts(m)) + 2 * m.vocab_size * m.hidden_size
    assert total == pytest.approx(30.5e9, rel=0.01)
    kw = dict(tp=1, pp=1, dp=8, dtype="bfloat16", optimizer="adam", ref=False, micro_tokens=4096, recompute=True,
              rollout_tp=1, engine_tokens=0, distributed_optimizer=False, offload={})
    experts = sum(e for _, e in layer_counts(m))
    one, eight = estimate(m, ep=1, **kw), estimate(m, ep=8, **kw)
    assert one.params - eight.params == pytest.approx(experts * 7 / 8 * 2)  # bf16 bytes of 7/8 of the experts


def test_an_expert_tp_below_tp_keeps_experts_whole_and_lora_trains_only_its_adapters() -> None:
    """ETP=1 at TP=2 (verl's MoE grid): every expert whole on its EP rank, the rest split by TP; LoRA: the base is
    frozen, so gradients and optimizer state are the adapters' (r × (in + out) per adapted projection) and the ref
    is the actor with its adapters off (no copy)."""
    m = HFArch.from_hf(QWEN7B)
    kw = dict(tp=2, pp=1, dp=4, dtype="bfloat16", optimizer="adam", ref=True, micro_tokens=4096, recompute=True,
              rollout_tp=2, engine_tokens=0, distributed_optimizer=False, offload={})
    full = estimate(m, **kw)
    lora = estimate(m, lora_rank=32, lora_projections=("q_proj", "k_proj", "v_proj", "o_proj"), **kw)
    q, kv, h = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim, m.hidden_size
    adapters = 32 * m.num_layers * (4 * h + 2 * q + 2 * kv) / 2  # over TP=2
    assert lora.grads == pytest.approx(adapters * 4) and lora.optimizer == pytest.approx(adapters * 12)
    assert lora.ref == 0 and lora.params == pytest.approx(full.params + adapters * 2)
    assert lora.grads < full.grads / 100
    moe = HFArch.from_hf({**json.loads(QWEN30B_A3B.read_text())})
    experts = sum(e for _, e in layer_counts(moe))
    tp2 = dict(kw, dp=4, ref=False)
    assert (estimate(moe, ep=8, etp=1, **tp2).params - estimate(moe, ep=8, **tp2).params
            == pytest.approx(experts / 8 / 2 * 2))  # bf16 bytes of the half of its experts TP would have taken


def test_offload_and_the_distributed_optimizer_shrink_what_they_should() -> None:
    m = HFArch.from_hf(QWEN7B)
    kw = dict(tp=4, pp=1, dp=2, dtype="bfloat16", optimizer="adam", ref=True, micro_tokens=4096, recompute=False,
              rollout_tp=2, engine_tokens=100_000)
    base = estimate(m, distributed_optimizer=False, offload={}, **kw)
    assert base.params == pytest.approx(7.6e9 / 4 * 2, rel=0.01) and base.grads == 2 * base.params
    assert base.optimizer == 3 * base.grads  # fp32 main weights + two Adam moments
    assert estimate(m, distributed_optimizer=True, offload={}, **kw).optimizer == base.optimizer / 2
    off = estimate(m, distributed_optimizer=False, offload={"param": True, "grad": True, "optimizer": True,
                                                             "ref_param": True}, **kw)
    assert off.generate == pytest.approx(off.engine_weights + off.engine_kv) and off.train == base.train
    recompute = estimate(m, distributed_optimizer=False, offload={}, **{**kw, "recompute": True})
    assert recompute.activations < 0.6 * base.activations  # the fp32 logits stay: only the layers shrink


def test_megatrons_optimizer_cpu_offload_moves_its_share_of_the_optimizer_to_host_memory() -> None:
    """optimizer_cpu_offload with fraction f: the moments of f of the parameters leave the device, their fp32 main
    weights too under use_precision_aware_optimizer (else Megatron's distributed optimizer keeps them there); the host
    holds the fp32 weights, gradients and moments of that share, shown in the plan's line and not counted."""
    m = HFArch.from_hf(QWEN7B)
    kw = dict(tp=4, pp=1, dp=2, dtype="bfloat16", optimizer="adam", ref=True, micro_tokens=4096, recompute=False,
              rollout_tp=2, engine_tokens=100_000, distributed_optimizer=True, offload={})
    base = estimate(m, **kw)
    shard = base.optimizer / 12  # fp32 main weights (4) + two moments (8) a parameter of the DP shard
    aware = estimate(m, host_fraction=1.0, precision_aware=True, **kw)
    assert aware.optimizer == 0 and aware.optimizer_host == pytest.approx(shard * 16)
    assert aware.state == pytest.approx(base.state - base.optimizer) and base.optimizer_host == 0
    half = estimate(m, host_fraction=0.5, precision_aware=False, **kw)  # the main weights stay on the device
    assert half.optimizer == pytest.approx(shard * (4 + 8 * 0.5)) and half.optimizer_host == pytest.approx(shard * 8)
    assert "in host memory, not counted: " in str(aware) and "100% of the parameters" in str(aware)
    assert "host memory" not in str(base)
    off = estimate(m, host_fraction=1.0, precision_aware=True, **{**kw, "offload": {"optimizer": True}})
    assert off.offloaded == 0  # optimizer_offload moves what is left on the device: nothing
    critic = estimate(m, host_fraction=1.0, precision_aware=True, critic=True, **kw)
    assert critic.critic == pytest.approx(base.params + base.grads + base.optimizer)  # its own optimizer, on device


def validate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", "validate", "recipe=grpo_qwen7b", "--model-config",
                           str(QWEN7B), *args], capture_output=True, text=True)


@pytest.mark.slow
def test_grpo_qwen7b_fits_and_a_layout_that_does_not_is_rejected_naming_the_keys() -> None:
    ok = validate()
    assert ok.returncode == 0, ok.stderr
    line = next(x for x in ok.stdout.splitlines() if x.startswith("memory "))
    assert "params 3.8, grads 7.6, optimizer 11.4, ref 3.8" in line and "engine KV pool" in line  # TP=4, bf16, DP=2
    peak = max(float(v) for v in (line.split("generate ")[1].split(" GB")[0], line.split("train ")[1].split(" GB")[0]))
    assert peak * GB < 80 * GB and "memory: the largest rank may need" not in ok.stdout
    tp1 = f"{AOR}.actor.megatron.tensor_model_parallel_size=1"
    # the whole 7B model on every GPU: its model state fits (72 + 7.6 GB of engine weights), the peak may not
    over = validate(tp1)
    assert over.returncode == 0, over.stderr
    assert "note: memory: the largest rank may need ~1" in over.stdout
    assert "activations and KV are estimates" in over.stdout
    assert "gpu_memory_utilization=0.5 lower" in over.stdout and "param_offload=true" in over.stdout
    # without the distributed optimizer its Adam state alone is 91 GB: that cannot fit, whatever the estimates say
    bad = validate(tp1, f"{AOR}.actor.megatron.use_distributed_optimizer=false")
    assert bad.returncode == 2 and "trainer.device_memory_gb=80.0: the largest rank's model state alone" in bad.stderr
    for key in ("tensor_model_parallel_size", "use_distributed_optimizer=true", "param_offload=true"):
        assert key in bad.stderr, key
    assert validate(tp1, f"{AOR}.actor.megatron.use_distributed_optimizer=false", "trainer.device_memory_gb=192",
                    ).returncode == 0


def test_the_model_state_is_what_must_fit_the_rest_is_an_estimate() -> None:
    """Issue 42: weights, gradients and optimizer state (each phase's) are the state; activations and KV are not."""
    m = HFArch.from_hf(QWEN7B)
    kw = dict(tp=2, pp=2, dp=2, dtype="bfloat16", optimizer="adam", ref=True, micro_tokens=8192, recompute=False,
              rollout_tp=2, engine_tokens=0, distributed_optimizer=True, seq_len=2048)
    sleeping = EngineMemory(fraction=0.6, weights_released=True, kv_released=True)
    mem = estimate(m, offload={}, engine=sleeping, device_bytes=80 * GB, critic=True, **kw)
    trainer = mem.params + mem.grads + mem.optimizer + mem.ref + mem.critic
    assert mem.state == pytest.approx(trainer + mem.engine_weights)  # generating: the engine's weights beside it all
    off = estimate(m, offload={"param": True, "grad": True, "optimizer": True, "ref_param": True}, engine=sleeping,
                   device_bytes=80 * GB, critic=True, **kw)
    assert off.state == pytest.approx(trainer)  # the train phase holds everything (the slept engine nothing)
    assert mem.peak - mem.state == pytest.approx(max(mem.engine_kv, mem.activations - mem.engine_weights))


def test_a_critic_adds_a_second_trained_model_state_and_its_offload_takes_it_back() -> None:
    m = HFArch.from_hf(QWEN7B)
    kw = dict(tp=4, pp=1, dp=2, dtype="bfloat16", optimizer="adam", ref=True, micro_tokens=4096, recompute=False,
              rollout_tp=2, engine_tokens=100_000, distributed_optimizer=False, offload={})
    base = estimate(m, **kw)
    critic = estimate(m, critic=True, **kw)
    assert critic.critic == base.params + base.grads + base.optimizer and "critic" in str(critic)
    assert critic.train == base.train + critic.critic  # trained between the actor's passes: no extra activations
    off = estimate(m, critic=True, critic_offload={"param": True, "grad": True, "optimizer": True}, **kw)
    assert off.generate == pytest.approx(base.generate)


def test_an_engine_with_a_pool_counts_its_share_of_the_device_not_the_steps_tokens() -> None:
    """Issue 25: the KV cache of every sample of a step at once refused setups verl runs; vLLM and SGLang page
    a step's samples through the pool that gpu_memory_utilization of the device leaves after the weights."""
    m = HFArch.from_hf(QWEN7B)
    kw = dict(tp=2, pp=2, dp=2, dtype="bfloat16", optimizer="adam", ref=True, micro_tokens=8192, recompute=True,
              rollout_tp=2, engine_tokens=1280 * 2048, distributed_optimizer=True, offload={}, seq_len=2048)
    need = estimate(m, **kw)  # no pool (the hf engine): the KV of its whole share
    assert need.engine_kv == pytest.approx(1280 * 2048 * 2 * 28 * 4 * 128 * 2 / 2) and need.sequences_at_once is None
    sleeping = EngineMemory(fraction=0.6, weights_released=True, kv_released=True)
    pooled = estimate(m, engine=sleeping, device_bytes=80 * GB, **kw)
    assert pooled.engine_weights + pooled.engine_kv == pytest.approx(0.6 * 80 * GB)
    assert pooled.sequences_at_once == int(pooled.engine_kv // (2048 * 2 * 28 * 4 * 128 * 2 / 2)) > 500
    assert pooled.train == pytest.approx(need.train - need.engine_weights)  # slept: nothing kept on the device
    awake = estimate(m, engine=EngineMemory(fraction=0.6, weights_released=False, kv_released=False),
                     device_bytes=80 * GB, **kw)
    assert awake.train == pytest.approx(pooled.train + 0.6 * 80 * GB)  # no sleep mode: the whole share stays
    fixed = estimate(m, engine=EngineMemory(fraction=0.6, kv_pool_bytes=4 * GB, weights_released=True,
                                            kv_released=True), device_bytes=80 * GB, **kw)
    assert fixed.engine_kv == 4 * GB  # vLLM's kv_cache_memory_bytes


@pytest.mark.slow
def test_a_share_too_small_for_one_sequence_is_refused_naming_the_key() -> None:
    r = validate(f"{AOR}.rollout.gpu_memory_utilization=0.09")  # 7.2 GB: not even the 7.6 GB of TP=2 weights
    assert r.returncode == 2 and f"{AOR}.rollout.gpu_memory_utilization=0.09: the engine's KV pool" in r.stderr
    ok = validate()
    assert "each engine's KV pool holds" in ok.stdout and "sequences of the longest length" in ok.stdout
