"""Router replay on one rank (gloo world of 1): the hf engine's recorded experts, R3 and R2 through
``MegatronPolicy``, the router losses; prints one JSON line of measurements for ``test_router_replay.py``.

    python tests/megatron/workers/router_replay_checks.py MODEL_DIR
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.config.schema import MegatronConfig, OptimConfig
from hybridrl.data.collate import PromptBatch
from hybridrl.interfaces import SamplingParams
from hybridrl.megatron.config import MicroBatching
from hybridrl.megatron.parallel import ParallelConfig, init_parallel, seed_everything
from hybridrl.megatron.policy import MegatronPolicy
from hybridrl.rollout.batching import rollout_batch_from_generations
from hybridrl.rollout.engines.hf import HFRolloutEngine

MICRO = MicroBatching(micro_batch_size=8)


def prompt_batch(prompts: list[list[int]], pad: int) -> PromptBatch:
    P = max(len(p) for p in prompts)
    ids, mask = torch.full((len(prompts), P), pad), torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
    return PromptBatch(input_ids=ids, attention_mask=mask, index=torch.arange(len(prompts)),
                       meta=[SampleMeta() for _ in prompts], pad_token_id=pad)


def sample(model: str, dtype: str, prompts: list[list[int]], pad: int) -> RolloutBatch:
    engine = HFRolloutEngine(HFRolloutEngine.Config(dtype=dtype), model_path=model)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=12, n=2, return_routed_experts=True),
                           seeds=list(range(len(prompts))))
    return rollout_batch_from_generations(prompt_batch(prompts, pad), gens, pad_token_id=pad)


def full_forward_routing(model: str, batch: RolloutBatch) -> float:
    """The share of recorded (position, layer) pairs whose experts equal transformers' own in one forward over
    the whole sequence (prompt ‖ response)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    same = total = 0
    for b in range(len(batch)):
        p = batch.prompt_mask[b].bool()
        r = batch.response_mask[b].bool()
        ids = torch.cat([batch.prompt_ids[b][p], batch.response_ids[b][r]])[None]
        seen: list[torch.Tensor] = []  # each router's top-k of softmax(x Wᵀ), computed here from its input
        hooks = [g.register_forward_hook(lambda m, inp, _out, seen=seen: seen.append(
            torch.topk(torch.softmax(inp[0].reshape(-1, m.weight.shape[1]) @ m.weight.T, -1), m.top_k).indices))
            for g in gates]
        with torch.no_grad():
            hf(input_ids=ids)
        for h in hooks:
            h.remove()
        own = torch.stack(seen, dim=1)  # [S, L, k]
        rec = torch.cat([batch.prompt_routed_experts[b][p], batch.response_routed_experts[b][r]]).long()
        have = rec[:, 0, 0] >= 0
        same += int((own[have].sort(-1).values == rec[have].sort(-1).values).all(-1).sum())
        total += int(have.sum()) * own.shape[1]
    return same / total


def used_routing(policy: MegatronPolicy, batch: RolloutBatch) -> RolloutBatch:
    """The experts ``policy``'s routers used in a forward that replays ``batch``'s (as they are, -1 elsewhere)."""
    out = dataclasses.replace(batch)
    with policy._routing(replay=True, record=True):
        policy._forward_rows(batch, lambda mb, o: (o.sum() * 0, {"x": torch.zeros_like(mb.batch.rollout_logprobs)}),
                             ("x",), batching=MICRO)
    policy._store_routing(out)
    policy.router_replay.take_mismatch()
    return out


def agree(a: RolloutBatch, b: RolloutBatch) -> float:
    """The share of ``a``'s recorded (position, layer) pairs where ``b`` routed to the same experts."""
    x = torch.cat([a.prompt_routed_experts, a.response_routed_experts], dim=1).long()
    y = torch.cat([b.prompt_routed_experts, b.response_routed_experts], dim=1).long()
    have = x[..., 0] >= 0
    return float((x.sort(-1).values == y.sort(-1).values).all(-1)[have].float().mean())


def logprob_diff(policy: MegatronPolicy, batch: RolloutBatch) -> tuple[float, dict[str, float]]:
    lp, _ = policy.compute_log_probs(batch, batching=MICRO, old_pass=True)
    mask = batch.response_mask.bool()
    return float((lp - batch.rollout_logprobs).abs()[mask].mean()), dict(policy.replay_metrics)


def main() -> None:
    model = sys.argv[1]
    init_parallel(ParallelConfig())
    seed_everything(1)
    from transformers import AutoConfig

    pad = AutoConfig.from_pretrained(model).pad_token_id
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, pad, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(24)]
    out: dict[str, object] = {}
    fp32 = sample(model, "float32", prompts, pad)
    out["engine_equals_full_forward"] = full_forward_routing(model, fp32)

    def policy(mode: str, dtype: str = "float32", **overrides: float) -> MegatronPolicy:
        megatron = MegatronConfig(dtype=dtype, override_transformer_config=overrides)
        return MegatronPolicy(model_dir=model, megatron=megatron, optim=OptimConfig(lr=3e-2), total_steps=4,
                              pad_token_id=pad, router_replay=mode)

    r3 = policy("R3")
    out["r3_fp32"] = logprob_diff(r3, fp32)
    out["r3_fp32_used_equals_engine"] = agree(fp32, used_routing(r3, fp32))
    # bf16 engine and trainer: different kernels, near-tied routers choose differently
    bf16 = sample(model, "bfloat16", prompts, pad)
    out["bf16_disabled"] = logprob_diff(policy("disabled", "bfloat16"), bf16)
    r3_bf16 = policy("R3", "bfloat16")
    out["bf16_r3"] = logprob_diff(r3_bf16, bf16)
    out["bf16_r3_used_equals_engine"] = agree(bf16, used_routing(r3_bf16, bf16))
    # R2: the old-log-prob pass records; after an update the weights route otherwise, the replay does not
    r2 = policy("R2")
    batch = dataclasses.replace(fp32, prompt_routed_experts=None, response_routed_experts=None)
    r2.compute_log_probs(batch, batching=MICRO, old_pass=True)
    out["r2_recorded"] = batch.prompt_routed_experts is not None
    recorded = dataclasses.replace(batch)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.old_logprobs = batch.rollout_logprobs

    def loss(logp, ent, mb, *, normalizer):  # noqa: ANN001, ANN202
        return -(logp * mb.advantages).sum() / normalizer, {}

    steps = [r2.train_step(batch, loss, batching=MICRO, loss_agg_mode="token-mean") for _ in range(3)]
    out["r2_update_mismatch"] = [m.get("router_replay_mismatch") for m in steps]
    out["r2_used_equals_recorded"] = agree(recorded, used_routing(r2, batch))
    # the router losses, off by default, logged when on
    aux = policy("disabled", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    out["aux_on"] = aux.train_step(batch, loss, batching=MICRO, loss_agg_mode="token-mean")
    out["aux_off"] = policy("disabled").train_step(batch, loss, batching=MICRO, loss_agg_mode="token-mean")
    out["expert_marking"] = expert_marking(model, r3)
    print(json.dumps(out))


def expert_marking(model: str, policy: MegatronPolicy) -> dict[str, int]:
    """moe_compat item 2 at EP = 1: the experts Megatron marks ``allreduce=False`` itself (none: still needed),
    those hybridrl's build marks, and the optimizers the policy's chain holds."""
    from hybridrl.hf.arch import HFArch
    from hybridrl.megatron import model as build

    def unmarked(module: torch.nn.Module) -> int:
        return 0

    mark, build.mark_expert_weights = build.mark_expert_weights, unmarked
    try:
        [upstream] = build.build_model_chunks(HFArch.from_hf(model), ParallelConfig())
    finally:
        build.mark_expert_weights = mark
    [ours] = build.build_model_chunks(HFArch.from_hf(model), ParallelConfig())

    def count(m: torch.nn.Module) -> int:
        return sum(not getattr(p, "allreduce", True) for p in m.parameters())

    return {"upstream": count(upstream), "ours": count(ours),
            "experts": sum(p.dim() > 0 for n, p in ours.named_parameters() if ".experts." in n),
            "optimizers": len(getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]))}


if __name__ == "__main__":
    main()
