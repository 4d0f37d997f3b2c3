"""Worker: LoRA train steps on the Megatron policy at the layouts given; what they give is saved for comparison.

    python -m torch.distributed.run --nproc-per-node N lora_step.py MODEL_DIR OUT_DIR LAYOUT [LAYOUT ...]

A layout is ``tp<a>pp<b>cp<c>[vpp<d>][ep<e>][-distopt][-qv|-mlp]``; DP is what remains of the world; ``-qv`` adapts only
``q_proj`` and ``v_proj`` (peft's usual pick, a subset of the fused ``linear_qkv``), ``-mlp`` only the MLP's
(an MoE model's experts), else ``all-linear``.
Each layout builds a
:class:`MegatronPolicy` with LoRA (rank 4, alpha 8, Adam lr 1e-2), takes 2 optimizer steps of token-mean NLL
on a fixed batch of 8 rows (DP rank r: the r-th contiguous block; the loss is normalised over the whole
batch, so every DP size takes the same step), then records on rank 0 (``OUT_DIR/<layout>dp<DP>.pt``): the
base's log-probs before and after (adapters disabled), the adapted log-probs after, the full adapters
(``LoRAModel.gather``), the merged HF weights the engine would receive, the metrics, whether exactly
the adapters require grad and are in the optimizer, and whether a fresh policy restored from its checkpoint
state (``checkpoint.py``: adapters + optimizer) takes a 3rd step bitwise like the original.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.checkpoint.rl import _model_and_optimizer_state, _restore
from hybridrl.config.schema import MegatronConfig, OptimConfig
from hybridrl.lora.config import LoRAConfig, resolve_targets
from hybridrl.megatron.config import MicroBatching
from hybridrl.megatron.lora import is_lora_name
from hybridrl.megatron.parallel import init_parallel, seed_everything
from hybridrl.megatron.policy import MegatronPolicy
from hybridrl.trainers.sft import nll_loss

torch.set_num_threads(1)
LAYOUT = re.compile(r"tp(\d+)pp(\d+)cp(\d+)(?:vpp(\d+))?(?:ep(\d+))?(-distopt)?(-qv|-mlp)?")
B, P, T, MICRO = 8, 6, 8, 2


def fixed_batch(pad_token_id: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(99)
    prompt_ids = torch.randint(0, pad_token_id, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[::2, :2] = 0
    prompt_ids[prompt_mask == 0] = pad_token_id
    response_ids = torch.randint(0, pad_token_id, (B, T), generator=g)
    response_mask = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        response_mask[b, : 2 + b % (T - 1)] = 1
    response_ids[response_mask == 0] = pad_token_id
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, rollout_logprobs=torch.zeros(B, T),
                        weight_version=torch.zeros(B, dtype=torch.long), group_index=torch.arange(B),
                        meta=[SampleMeta() for _ in range(B)], pad_token_id=pad_token_id)


def run_layout(model_dir: str, out_dir: Path, name: str, pad_token_id: int) -> None:
    match = LAYOUT.fullmatch(name)
    assert match, name
    tp, pp, cp, vpp, ep, distopt, pick = match.groups()
    targets = {"-qv": ["q_proj", "v_proj"], "-mlp": ["gate_proj", "up_proj", "down_proj"]}.get(pick or "",
                                                                                            ["all-linear"])
    megatron = MegatronConfig(tensor_model_parallel_size=int(tp), pipeline_model_parallel_size=int(pp),
                              context_parallel_size=int(cp),
                              virtual_pipeline_model_parallel_size=int(vpp) if vpp else None,
                              expert_model_parallel_size=int(ep) if ep else 1,
                              use_distributed_optimizer=bool(distopt))
    from hybridrl.megatron.policy import parallel_config

    init_parallel(parallel_config(megatron))
    seed_everything(1)
    lora = LoRAConfig(rank=4, alpha=8.0, projections=resolve_targets(targets))

    def build() -> MegatronPolicy:
        return MegatronPolicy(model_dir=model_dir, megatron=megatron, total_steps=3, pad_token_id=pad_token_id,
                              optim=OptimConfig(optimizer="adam", lr=1e-2, adam_eps=1e-6, clip_grad=1.0), lora=lora)

    policy = build()
    assert policy.lora is not None
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    full = fixed_batch(pad_token_id)
    mine = list(range(dp_rank * B // dp, (dp_rank + 1) * B // dp))
    batch = full.index(mine)
    micro = MicroBatching(micro_batch_size=MICRO)

    trainable = [n for c in policy.chunks for n, p in c.named_parameters() if p.requires_grad]
    frozen_lora = [n for c in policy.chunks for n, p in c.named_parameters() if not p.requires_grad and is_lora_name(n)]
    assert policy.optimizer is not None
    in_optimizer = sum(p.numel() for g in policy.optimizer.param_groups for p in g["params"])
    adapter_ids = {id(p) for p in policy.lora.parameters()}
    only_adapters = all(is_lora_name(n) for n in trainable) and not frozen_lora and bool(trainable)
    base_before, _ = policy.compute_log_probs(batch, batching=micro)
    steps = [policy.train_step(batch, nll_loss, batching=micro, loss_agg_mode="token-mean") for _ in range(2)]
    adapted, _ = policy.compute_log_probs(batch, batching=micro)
    with policy.lora.disabled():
        base_after, _ = policy.compute_log_probs(batch, batching=micro)
    adapters = policy.lora.gather()
    merged = {k: v for bucket in policy.export_weights(bucket_bytes=1 << 20) for k, v in bucket}
    resumed = resume_bitwise(policy, build(), out_dir / f"ckpt-{name}dp{dp}", batch, micro)
    gathered: list = [None] * dp
    dist.all_gather_object(gathered, (mine, base_before, base_after, adapted),
                           group=parallel_state.get_data_parallel_group())
    local_numel = sum(p.numel() for p in policy.lora.parameters())
    if dist.get_rank() == 0:
        rows = {k: torch.zeros(B, T) for k in ("base_before", "base_after", "adapted")}
        for idx, *values in gathered:
            for key, value in zip(rows, values, strict=True):
                rows[key][idx] = value
        torch.save({**rows, "prompt_ids": full.prompt_ids, "prompt_mask": full.prompt_mask,
                    "response_ids": full.response_ids, "response_mask": full.response_mask, "steps": steps,
                    "adapters": adapters, "merged": merged,
                    "only_adapters_trainable": only_adapters, "in_optimizer": in_optimizer,
                    "local_adapter_numel": local_numel, "n_adapter_params": len(adapter_ids),
                    "trainable_numel": policy.lora.trainable_numel(), "resumed_bitwise": resumed},
                   out_dir / f"{name}dp{dp}.pt")
        print(f"{name}dp{dp}: " + " ".join(f"{k}={v:.4g}" for k, v in steps[-1].items()), flush=True)
    parallel_state.destroy_model_parallel()


def resume_bitwise(policy: MegatronPolicy, fresh: MegatronPolicy, ckpt: Path, batch: RolloutBatch,
                   micro: MicroBatching) -> bool:
    """Save ``policy``'s checkpoint state (adapters + optimizer, as ``checkpoint.save_checkpoint`` does), restore it
    into ``fresh`` (as a resume does), take one more step with each: the same adapters, bitwise?"""
    assert policy.scheduler is not None and policy.lora is not None and fresh.lora is not None
    if dist.get_rank() == 0:
        ckpt.mkdir()
    dist.barrier()
    dist_checkpointing.save(_model_and_optimizer_state(policy, loading=False), str(ckpt))
    _restore(fresh, ckpt, policy.scheduler.state_dict())
    for p in (policy, fresh):
        p.train_step(batch, nll_loss, batching=micro, loss_agg_mode="token-mean")
    a, b = policy.lora.gather(), fresh.lora.gather()
    return all(torch.equal(a[k][i], b[k][i]) for k in a for i in (0, 1))


def main() -> None:
    model_dir, out_dir, layouts = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    from transformers import AutoConfig

    pad = AutoConfig.from_pretrained(model_dir).pad_token_id
    for name in layouts:
        run_layout(model_dir, out_dir, name, pad)
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main()
