"""Worker: the critic's values of rl_step's fixed batch at the layouts given, from MODEL_DIR, saved by rank 0.

    python -m torch.distributed.run --nproc-per-node N critic_values.py MODEL_DIR OUT_DIR LAYOUT [LAYOUT ...]

Layouts as ``tests/parallel/workers/rl_step.py``'s (``tp<a>pp<b>cp<c>``); writes ``OUT_DIR/<layout>.pt``: the
``[B, T]`` values (in the batch's order: every rank computes the whole batch, DP ranks alike).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "parallel" / "workers"))
from rl_step import fixed_batch, parse_layout  # noqa: E402

from hybridrl.config.schema import MegatronConfig, OptimConfig  # noqa: E402
from hybridrl.megatron.config import MicroBatching  # noqa: E402
from hybridrl.megatron.critic import MegatronCritic  # noqa: E402
from hybridrl.megatron.parallel import init_parallel, seed_everything  # noqa: E402

torch.set_num_threads(1)


def main() -> None:
    model_dir, out_dir, layouts = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    for name in layouts:
        layout, _ = parse_layout(name)
        init_parallel(layout)
        seed_everything(1)
        megatron = MegatronConfig(tensor_model_parallel_size=layout.tensor_model_parallel_size,
                                  pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
                                  context_parallel_size=layout.context_parallel_size)
        critic = MegatronCritic(model_dir=model_dir, megatron=megatron, optim=OptimConfig(), total_steps=1,
                                pad_token_id=hf.pad_token_id, seed=0)
        values = critic.compute_values(fixed_batch(hf.vocab_size, hf.pad_token_id),
                                       batching=MicroBatching(micro_batch_size=4))
        if dist.get_rank() == 0:
            torch.save(values, out_dir / f"{name}.pt")
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
