"""Worker (2 ranks, PP=2): send activations of two different shapes from stage 0 to stage 1 with
``variable_seq_lengths`` (the shape goes first), upstream as is and with the CPU adaptation.

    python -m torch.distributed.run --nproc-per-node 2 p2p_shapes.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import p2p_communication

from hybridrl.megatron import cpu
from hybridrl.megatron.parallel import ParallelConfig, init_parallel

SHAPES = [(3, 1, 2), (5, 2, 2)]


def exchange() -> list[list[int]]:
    config = ModelParallelConfig(pipeline_model_parallel_size=2, variable_seq_lengths=True,
                                 pipeline_dtype=torch.float32, **cpu.cpu_model_parallel_kwargs())
    comm = p2p_communication.P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
    got = []
    for shape in SHAPES:
        if parallel_state.is_pipeline_first_stage():
            comm.send_forward(torch.ones(shape), is_last_stage=False)
        else:  # the tensor_shape given is a placeholder: the real one arrives first
            got.append(list(comm.recv_forward((1, 1, 1), is_first_stage=False).shape))
    return got


def main(out: Path) -> None:
    init_parallel(ParallelConfig(pipeline_model_parallel_size=2))  # installs every adaptation
    results = {}
    adapted = p2p_communication.torch
    p2p_communication.torch = torch  # upstream as released
    try:
        exchange()
        results["without"] = None
    except Exception as e:
        results["without"] = f"{type(e).__name__}: {e}"
    p2p_communication.torch = adapted
    try:
        results["with"] = exchange()
    except Exception:
        results["with"] = "FAILED: " + traceback.format_exc(limit=4)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
