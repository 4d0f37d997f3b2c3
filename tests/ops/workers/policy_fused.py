"""Worker: the trainer's RL step (``tests/parallel/workers/rl_step.py``: old/ref log-probs, then PPO-clip + KL +
entropy bonus over 2 mini-batches) with ``actor_rollout_ref.actor.megatron.use_fused_kernels`` false, true, and
true with ``fused_lm_head`` (log-probs from hidden states × the LM-head weight), at TP = world size; prints the
largest differences from the first and the fused calls counted in each of the others.

    python -m torch.distributed.run --nproc-per-node N policy_fused.py MODEL_DIR
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "parallel" / "workers"))
from rl_step import config, fixed_batch  # noqa: E402

import hybridrl.megatron.policy as policy  # noqa: E402
import hybridrl.megatron.vocab_parallel as vocab_parallel  # noqa: E402
from hybridrl.config.plan import Plan  # noqa: E402
from hybridrl.hybrid import ActorRolloutRef  # noqa: E402
from hybridrl.megatron.parallel import ParallelConfig, init_parallel, seed_everything  # noqa: E402
from hybridrl.trainers.components import actor_objective  # noqa: E402

torch.set_num_threads(1)
calls = {"fused": 0, "fused_lm_head": 0}
fused_op, lm_head_op = vocab_parallel.logprob_entropy, policy.lm_head_logprob_entropy


def counted(*args, **kwargs):
    calls["fused"] += 1
    return fused_op(*args, **kwargs)


def counted_lm_head(*args, **kwargs):
    calls["fused_lm_head"] += 1
    return lm_head_op(*args, **kwargs)


vocab_parallel.logprob_entropy, policy.lm_head_logprob_entropy = counted, counted_lm_head


def rl_step(model_dir: str, fused: bool, full, *, lm_head: bool = False) -> dict:
    tp = int(os.environ["WORLD_SIZE"])
    layout = ParallelConfig(tensor_model_parallel_size=tp)
    init_parallel(layout)
    seed_everything(1)
    cfg = config(model_dir, layout, "token-mean")
    cfg.actor_rollout_ref.actor.megatron.use_fused_kernels = fused
    cfg.actor_rollout_ref.actor.megatron.fused_lm_head = lm_head
    plan, problems = Plan.build(cfg, world_size=dist.get_world_size(), device_type="cpu")
    assert not problems, problems
    hybrid = ActorRolloutRef(cfg.actor_rollout_ref, plan=plan, objective=actor_objective(cfg),
                             pad_token_id=full.pad_token_id)
    batch = full.index(list(range(len(full))))
    entropy = hybrid.compute_log_probs(batch)
    hybrid.compute_ref_log_probs(batch)
    steps = hybrid.update_actor(batch, seed=7)
    weights = {k: v for bucket in hybrid.actor.export_weights(bucket_bytes=1 << 20) for k, v in bucket}
    parallel_state.destroy_model_parallel()
    return {"old_logprobs": batch.old_logprobs, "ref_logprobs": batch.ref_logprobs, "entropy": entropy,
            "steps": steps, "weights": weights}


def main() -> None:
    model_dir = sys.argv[1]
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    full = fixed_batch(hf.vocab_size, hf.pad_token_id)
    off = rl_step(model_dir, False, full)
    assert calls == {"fused": 0, "fused_lm_head": 0}, calls
    for kind, lm_head in (("fused", False), ("fused_lm_head", True)):
        before = dict(calls)
        on = rl_step(model_dir, True, full, lm_head=lm_head)
        diffs = {k: (on[k] - off[k]).abs().max().item() for k in ("old_logprobs", "ref_logprobs", "entropy")}
        diffs["metrics"] = max(abs(a[m] - b[m]) for a, b in zip(on["steps"], off["steps"], strict=True) for m in a)
        diffs["weights"] = max((on["weights"][k] - off["weights"][k]).abs().max().item() for k in off["weights"])
        other = "fused_lm_head" if kind == "fused" else "fused"
        if dist.get_rank() == 0:
            print(f"TP={dist.get_world_size()} {kind} calls {calls[kind] - before[kind]} (other "
                  f"{calls[other] - before[other]}); max |{kind} - current|: "
                  + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()), flush=True)
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main()
