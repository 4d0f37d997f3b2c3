"""Worker: ``rl_step.py``'s RL step in another precision or with activation recompute; a checkpoint resume.

    python -m torch.distributed.run --nproc-per-node N precision.py MODEL_DIR OUT_DIR RUN [RUN ...]

A run is ``<layout>.<dtype>[.<recompute>]`` or ``<layout>.<dtype>.resume``: layout as in ``rl_step.py``
(``tp2pp1cp1``, ``tp1pp1cp1-distopt``, …), dtype ``float32 | bfloat16 | float16`` (``megatron.dtype``),
recompute a key of :data:`RECOMPUTE` (``megatron.override_transformer_config``).

A step run is ``rl_step.run_layout`` (its fixed batch, config and DP sharding; old/ref log-probs, then 2
PPO mini-batch steps) for ``token-mean`` (Adam) and, except under the distributed optimizer,
``seq-mean-token-mean`` (SGD). Rank 0 saves ``OUT_DIR/<run>-<mode>.pt`` with what ``rl_step.py`` saves
plus ``main_weights`` (the optimizer's fp32 main weights after the step, HF-named; the parameters when
they are fp32) and ``forwards`` (forward calls of the layers, core attentions and MLPs during the update).

A resume run (Adam) takes the two mini-batch steps, saving a checkpoint (``hybridrl.checkpoint.rl``) after the
first; a fresh actor built from the HF model loads it and retakes the second step. ``OUT_DIR/<run>.pt``
holds both second steps (metrics, weights, main weights), the weights at the checkpoint and its path.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import TransformerLayer
from rl_step import config, fixed_batch, modes, parse_layout

from hybridrl.checkpoint.rl import load_checkpoint, save_checkpoint
from hybridrl.config.plan import Plan
from hybridrl.config.schema import RLConfig
from hybridrl.hybrid import ActorRolloutRef
from hybridrl.megatron.model import build_model_chunks, unwrap_model
from hybridrl.megatron.parallel import init_parallel, seed_everything
from hybridrl.megatron.policy import MegatronPolicy
from hybridrl.megatron.weights import export_hf_weights
from hybridrl.trainers.components import actor_objective

torch.set_num_threads(1)

# the ratio is clipped at 0.1 and 5: far outside every ratio of the step (fp32, seen 0.45–1.50 in the SGD mode's
# second mini-batch), so no token sits near a clip edge; test_mixed_precision checks clipfrac = 0
PRECISION_CLIP = {"clip_ratio_low": 0.9, "clip_ratio_high": 4.0}
RECOMPUTE = {  # run name suffix -> override_transformer_config
    "recompute": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
}


def run_config(model_dir: str, run: str, mode: str) -> RLConfig:
    layout_name, dtype, *extra = run.split(".")
    layout, distributed_optimizer = parse_layout(layout_name)
    cfg = config(model_dir, layout, mode, distributed_optimizer=distributed_optimizer,
                 dynamic_bsz=layout_name.endswith("-dyn"))
    m = cfg.actor_rollout_ref.actor.megatron
    m.dtype = dtype  # the ref runs in the actor's dtype
    # a smooth objective: rl_step's clip range (±0.02) clips half of the second mini-batch's tokens, and a token
    # whose ratio lies within 16-bit rounding of a clip edge is clipped in one run and not in the other — its
    # whole gradient appears or vanishes (one token of 44 did so at TP=2 bf16 on an AVX2 CPU: grad norm 3.6 %
    # off, 9 u). Rounding is what these runs measure, so no ratio may come near an edge.
    cfg.algorithm.policy_loss_kwargs = dict(PRECISION_CLIP)
    for name in extra:
        m.override_transformer_config = dict(RECOMPUTE[name])
    return cfg


def hf_weights(chunks: list[torch.nn.Module], policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    return {k: v for bucket in export_hf_weights(chunks, policy.arch, bucket_bytes=1 << 20) for k, v in bucket}


def main_weights(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 main weights, HF-named; the parameters themselves when they are fp32.

    The plain mixed-precision optimizer holds a full fp32 copy per parameter (``param.main_param``); the
    distributed one holds this DP rank's range of it: the ranges are summed over the optimizer's DP group.
    They are copied into an fp32 twin of the model, which is exported. (Not by swapping the parameters'
    ``.data``: a change of dtype drops a parameter's grad accumulator, and with it DDP's grad hook.)
    """
    if policy.dtype == torch.float32:
        return hf_weights(policy.chunks, policy)
    assert policy.optimizer is not None
    (opt,) = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    twin = build_model_chunks(policy.arch, policy.parallel)
    for chunk, twin_chunk in zip(policy.chunks, twin, strict=True):
        params = dict(unwrap_model(chunk).named_parameters())
        for name, twin_param in unwrap_model(twin_chunk).named_parameters():
            p = params[name]
            if getattr(p, "main_param_sharded", False):
                flat = torch.zeros(p.numel(), dtype=torch.float32)
                if p.main_param is not None:
                    r = opt._get_model_param_range_map(p)["param"]
                    flat[r.start:r.end] = p.main_param
                dist.all_reduce(flat, group=opt.data_parallel_group)
                twin_param.data.copy_(flat.view(p.shape))
            else:
                twin_param.data.copy_(p.main_param)
    return hf_weights(twin, policy)


def dp_share(full_batch: Any) -> tuple[list[int], Any]:
    """This DP rank's samples, as ``rl_step.py`` shards them."""
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    B = len(full_batch)
    mine = list(range(dp_rank * B // dp, (dp_rank + 1) * B // dp))
    return mine, full_batch.index(mine)


def build(cfg: RLConfig, pad_token_id: int) -> ActorRolloutRef:
    plan, problems = Plan.build(cfg, world_size=dist.get_world_size(), device_type="cpu")
    assert not problems, problems
    return ActorRolloutRef(cfg.actor_rollout_ref, plan=plan, objective=actor_objective(cfg), pad_token_id=pad_token_id)


def run_step(model_dir: str, out_dir: Path, run: str, mode: str, full: Any) -> None:
    """``rl_step.run_layout`` in ``run``'s precision / recompute, saving main weights too."""
    start = time.perf_counter()
    cfg = run_config(model_dir, run, mode)
    init_parallel(parse_layout(run.split(".")[0])[0])
    seed_everything(1)
    mine, batch = dp_share(full)
    hybrid = build(cfg, full.pad_token_id)
    entropy_BT = hybrid.compute_log_probs(batch)
    hybrid.compute_ref_log_probs(batch)
    with count_forwards(hybrid.actor) as forwards:
        steps = hybrid.update_actor(batch, seed=7)
    weights, main = hf_weights(hybrid.actor.chunks, hybrid.actor), main_weights(hybrid.actor)
    assert batch.old_logprobs is not None and batch.ref_logprobs is not None
    save_gathered(out_dir / f"{run}-{mode}.pt", mine, len(full),
                  {"old_logprobs": batch.old_logprobs, "ref_logprobs": batch.ref_logprobs, "entropy": entropy_BT},
                  {"steps": steps, "weights": weights, "main_weights": main, "forwards": forwards})
    if dist.get_rank() == 0:
        print(f"{run} {mode}: {time.perf_counter() - start:.1f}s " + " ".join(
            f"{k}={v:.4g}" for k, v in steps[-1].items()), flush=True)
    parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def count_forwards(policy: MegatronPolicy) -> Iterator[dict[str, int]]:
    """Forward calls of the policy's transformer layers, core attentions and MLPs while the block runs:
    under activation recompute the recomputed modules run twice per micro-batch."""
    counts = {"layer": 0, "core_attention": 0, "mlp": 0}
    hooks = []
    for chunk in policy.chunks:
        for name, module in chunk.named_modules():
            kind = "layer" if isinstance(module, TransformerLayer) else name.rpartition(".")[2]
            if kind in counts:
                hooks.append(module.register_forward_pre_hook(partial(_count, counts, kind)))
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


def _count(counts: dict[str, int], kind: str, *args: Any) -> None:
    counts[kind] += 1


def save_gathered(path: Path, mine: list[int], B: int, per_token: dict[str, torch.Tensor],
                  rest: dict[str, Any]) -> None:
    """Rank 0 saves ``rest`` and the per-token tensors of every DP rank, in the fixed batch's order."""
    dp = parallel_state.get_data_parallel_world_size()
    gathered: list[Any] = [None] * dp
    dist.all_gather_object(gathered, (mine, per_token), group=parallel_state.get_data_parallel_group())
    if dist.get_rank() == 0:
        out = {k: torch.zeros(B, v.shape[1]) for k, v in per_token.items()}
        for idx, tensors in gathered:
            for k, v in tensors.items():
                out[k][idx] = v
        torch.save({**out, **rest}, path)


def run_resume(model_dir: str, out_dir: Path, run: str, full: Any) -> None:
    """Two Adam steps; a checkpoint after the first; a fresh actor resumes from it and retakes the second."""
    cfg = run_config(model_dir, run.removesuffix(".resume"), "token-mean")
    cfg.trainer.output_dir = str(out_dir / run)
    init_parallel(parse_layout(run.split(".")[0])[0])
    seed_everything(1)
    _, batch = dp_share(full)
    hybrid = build(cfg, full.pad_token_id)
    hybrid.compute_log_probs(batch)
    hybrid.compute_ref_log_probs(batch)
    first, second = batch.split(hybrid.plan.batch.mini_batch_samples_per_dp_rank)

    def step(policy: MegatronPolicy, mini: Any) -> dict[str, Any]:
        metrics = policy.train_step(mini, hybrid.objective, batching=hybrid.plan.batch.update,
                                    loss_agg_mode=cfg.actor_rollout_ref.actor.loss_agg_mode,
                                    temperature=hybrid.logprob_temperature)
        return {"metrics": metrics, "weights": hf_weights(policy.chunks, policy), "main_weights": main_weights(policy)}

    at_checkpoint = step(hybrid.actor, first)["weights"]
    path = save_checkpoint(cfg=cfg, step=1, policy=hybrid.actor, weight_version=1, sampler_state={},
                           model_dir=model_dir)
    uninterrupted = step(hybrid.actor, second)
    fresh = MegatronPolicy(model_dir=model_dir, megatron=cfg.actor_rollout_ref.actor.megatron,
                           optim=cfg.actor_rollout_ref.actor.optim, total_steps=hybrid.plan.batch.total_optimizer_steps,
                           pad_token_id=full.pad_token_id)
    before = main_weights(fresh)
    load_checkpoint(path, cfg=cfg, policy=fresh)
    resumed = step(fresh, second)
    if dist.get_rank() == 0:
        torch.save({"uninterrupted": uninterrupted, "resumed": resumed, "fresh_main_weights": before,
                    "weights_at_checkpoint": at_checkpoint, "checkpoint": str(path)}, out_dir / f"{run}.pt")
        print(f"{run}: {uninterrupted['metrics']} / {resumed['metrics']}", flush=True)
    parallel_state.destroy_model_parallel()


def main() -> None:
    model_dir, out_dir, runs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    full = fixed_batch(hf.vocab_size, hf.pad_token_id)
    for run in runs:
        if run.endswith(".resume"):
            run_resume(model_dir, out_dir, run, full)
            continue
        for mode in modes(run.split(".")[0]):
            run_step(model_dir, out_dir, run, mode, full)
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main()
