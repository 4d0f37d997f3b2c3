"""Worker: aux-loss-free balancing on a sigmoid-routed MoE actor (GLM-4.5 / DeepSeek-V3's expert bias).

    python -m torch.distributed.run --nproc-per-node 1 expert_bias_step.py MODEL_DIR OUT_JSON RATE

Builds a :class:`MegatronPolicy` with ``override_transformer_config.moe_router_bias_update_rate = RATE``, takes two
optimizer steps of token-mean NLL on a fixed batch and writes, per step: each router's expert bias before and after,
its token counts left afterwards, and the bias the HF weight stream carries (what the engine receives).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lora_step import MICRO, fixed_batch

from hybridrl.config.schema import MegatronConfig, OptimConfig
from hybridrl.megatron.config import MicroBatching
from hybridrl.megatron.model import unwrap_model
from hybridrl.megatron.parallel import init_parallel, seed_everything
from hybridrl.megatron.policy import MegatronPolicy, parallel_config
from hybridrl.trainers.sft import nll_loss

torch.set_num_threads(1)


def main() -> None:
    model_dir, out, rate = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    from transformers import AutoConfig

    pad = AutoConfig.from_pretrained(model_dir).pad_token_id
    megatron = MegatronConfig(override_transformer_config={"moe_router_bias_update_rate": rate})
    init_parallel(parallel_config(megatron))
    seed_everything(1)
    policy = MegatronPolicy(model_dir=model_dir, megatron=megatron, total_steps=2, pad_token_id=pad,
                            optim=OptimConfig(optimizer="adam", lr=1e-3))
    routers = [m for c in policy.chunks for m in unwrap_model(c).modules()
               if getattr(m, "expert_bias", None) is not None]
    batch, steps = fixed_batch(pad), []
    for _ in range(2):
        before = [r.expert_bias.clone().tolist() for r in routers]
        policy.train_step(batch, nll_loss, batching=MicroBatching(micro_batch_size=MICRO), loss_agg_mode="token-mean")
        exported = {k: v.tolist() for bucket in policy.export_weights(bucket_bytes=1 << 20) for k, v in bucket
                    if k.endswith("e_score_correction_bias")}
        steps.append({"before": before, "after": [r.expert_bias.tolist() for r in routers],
                      "counts_left": [r.local_tokens_per_expert.tolist() for r in routers], "exported": exported})
    out.write_text(json.dumps(steps))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
