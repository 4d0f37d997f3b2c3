"""Worker: one critic step (values pass, clipped-value-loss updates over 2 mini-batches) at the layouts given, saved.

    python -m torch.distributed.run --nproc-per-node N critic_step.py MODEL_DIR OUT_DIR LAYOUT [LAYOUT ...]

Layouts as ``rl_step.py``'s (``tp<a>pp<b>cp<c>[vpp<d>][-dyn][-pad]``: packed rows unless ``-pad``; DP is what remains
of the world), with its FIXED batch and its DP sharding, so every layout takes the same optimizer steps. For each
layout and each optimizer (Adam, SGD) the worker builds :class:`MegatronCritic` as ``ActorRolloutRef`` does, fills
``values`` (``compute_values``), draws returns near them, and runs the critic's PPO epochs
(``hybridrl.distributed.dp_batches.epochs``, as ``update_critic``). Rank 0 saves
``OUT_DIR/<layout>dp<DP>-<optimizer>.pt`` with
every sample's values, each optimizer step's metrics and the full (TP-gathered, HF-named) trunk and head weights
after the step; every rank checks that its TP peers hold the same (replicated) value head.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from rl_step import DYN_BUDGET, MICRO, MINI_PROMPTS, N, T, fixed_batch, parse_layout

from hybridrl.config.schema import MegatronConfig, OptimConfig
from hybridrl.distributed import dp_batches
from hybridrl.megatron.config import MicroBatching
from hybridrl.megatron.convert import hf_from_full
from hybridrl.megatron.critic import MegatronCritic
from hybridrl.megatron.model import unwrap_model
from hybridrl.megatron.parallel import init_parallel, seed_everything
from hybridrl.megatron.weights import _tp_gather, local_units

torch.set_num_threads(1)

OPTIMIZERS = {"adam": OptimConfig(optimizer="adam", lr=1e-3, adam_eps=1e-6, clip_grad=1.0),
              "sgd": OptimConfig(optimizer="sgd", lr=0.5, clip_grad=1.0)}
CLIPRANGE = 0.05  # small: the second mini-batch's values have moved past it (clipping exercised)


def full_weights(critic: MegatronCritic) -> dict[str, torch.Tensor]:
    """The whole critic, HF-named (``score.*``: the head), on every rank (TP-gathered, PP all-gathered)."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out: dict[str, torch.Tensor] = {}
    for unit, param in local_units(critic.chunks, critic.arch, skip=("output_layer.",)).values():
        full = _tp_gather(unit, critic.arch, param, tp_group, tp)
        out.update(zip(unit.hf_names, hf_from_full(unit, critic.arch, full, tp_size=tp), strict=True))
    if parallel_state.is_pipeline_last_stage():
        head = unwrap_model(critic.chunks[-1]).output_layer
        out["score.weight"], out["score.bias"] = head.weight.detach().clone(), head.bias.detach().clone()
        peers = [torch.empty_like(head.weight) for _ in range(tp)]
        dist.all_gather(peers, head.weight.detach().contiguous(), group=tp_group)
        assert all(torch.equal(p, peers[0]) for p in peers), "the replicated value head drifted apart over TP"
    stages: list = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, out, group=parallel_state.get_pipeline_model_parallel_group())
    return {k: v for stage in stages for k, v in stage.items()}


def run_layout(model_dir: str, out_dir: Path, name: str, optimizer: str, pad_token_id: int, vocab: int) -> None:
    start = time.perf_counter()
    layout, _ = parse_layout(name)
    init_parallel(layout)
    seed_everything(1)
    full = fixed_batch(vocab, pad_token_id)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    B = len(full)
    mine = list(range(dp_rank * B // dp, (dp_rank + 1) * B // dp))
    batch = full.index(mine)
    megatron = MegatronConfig(tensor_model_parallel_size=layout.tensor_model_parallel_size,
                              pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
                              context_parallel_size=layout.context_parallel_size,
                              virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size)
    critic = MegatronCritic(model_dir=model_dir, megatron=megatron, optim=OPTIMIZERS[optimizer], total_steps=2,
                            pad_token_id=pad_token_id, seed=5)
    dynamic = "-dyn" in name  # token-budget micro-batches (critic.use_dynamic_bsz), both passes
    packed = not name.endswith("-pad")  # critic.megatron.use_remove_padding (the default: packed rows)
    budget = DYN_BUDGET if dynamic else None
    batching = MicroBatching(micro_batch_size=MICRO, max_tokens=budget, packed=packed)
    batch.values = critic.compute_values(batch, batching=MicroBatching(micro_batch_size=4, max_tokens=budget,
                                                                       packed=packed))
    noise = torch.randn(B, T, generator=torch.Generator().manual_seed(99))[mine]
    batch.returns = (batch.values + noise) * batch.response_mask
    group = dp_batches.DPGroup(rank=dp_rank, size=dp, group=parallel_state.get_data_parallel_group())
    steps = dp_batches.epochs(batch, lambda mini: critic.train_step(mini, batching=batching, cliprange=CLIPRANGE),
                              dp=group, epochs=1, mini_batch=MINI_PROMPTS * N // dp,
                              order=lambda n, _: torch.arange(n), seed=7)
    weights = full_weights(critic)
    gathered: list = [None] * dp
    dist.all_gather_object(gathered, (mine, batch.values), group=parallel_state.get_data_parallel_group())
    if dist.get_rank() == 0:
        values = torch.zeros(B, T)
        for idx, v in gathered:
            values[idx] = v
        torch.save({"values": values, "steps": steps, "weights": weights}, out_dir / f"{name}dp{dp}-{optimizer}.pt")
        print(f"{name}dp{dp} {optimizer}: {time.perf_counter() - start:.1f}s, "
              + " ".join(f"{k}={v:.3g}" for k, v in steps[-1].items()), flush=True)
    parallel_state.destroy_model_parallel()


def main() -> None:
    model_dir, out_dir, layouts = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    for name in layouts:
        for optimizer in OPTIMIZERS:
            run_layout(model_dir, out_dir, name, optimizer, hf.pad_token_id, hf.vocab_size)
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main()
