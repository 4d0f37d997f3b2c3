"""Worker: every rank builds the colocated rollout of each plan with a recording engine and generates.

    torchrun --nproc-per-node W placement.py PLANS.pkl OUT_DIR

For each plan (``hybridrl validate``'s, pickled by the test): which engine this rank started (device,
TP size), which prompts that engine was asked for, and the samples this rank got back. A recording
engine stands in for a real one because the plans place engines on ``cuda:<k>`` devices that a CPU
machine does not have; the real engines run this same code in the training tests.
"""

from __future__ import annotations

import json
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from hybridrl.batch import SampleMeta
from hybridrl.data.collate import PromptBatch
from hybridrl.interfaces import Generation, SamplingParams
from hybridrl.rollout.colocated import ColocatedEngines

STARTED: list[dict[str, Any]] = []


class RecordingEngine:
    supports_tensor_parallel: ClassVar[bool] = True

    def __init__(self, *, device: str, tp_size: int) -> None:
        self.asked: list[int] = []
        STARTED.append({"device": device, "tp_size": tp_size, "asked": self.asked})

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *,
                 seeds: Sequence[int] | None = None) -> list[Generation]:
        self.asked += [p[0] - 1 for p in prompts]  # prompt k is the one token k + 1 (see below)
        return [Generation(prompt_index=i, token_ids=[p[0], 100 + j], logprobs=[0.0, 0.0], finish_reason="stop",
                           weight_version=0) for i, p in enumerate(prompts) for j in range(params.n)]

    def resume_memory(self) -> None: ...

    def release_memory(self) -> None: ...

    def shutdown(self) -> None: ...


def main() -> None:
    plans, out = pickle.loads(Path(sys.argv[1]).read_bytes()), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, report = dist.get_rank(), []
    for name, plan in plans:
        STARTED.clear()
        rollout = ColocatedEngines(plan, build_engine=RecordingEngine, pad_token_id=0)
        num = plan.batch.prompts_per_step
        prompts = PromptBatch(input_ids=torch.arange(1, num + 1)[:, None], attention_mask=torch.ones(num, 1).long(),
                              index=torch.arange(num), meta=[SampleMeta()] * num, pad_token_id=0)
        batch = rollout.generate(prompts, SamplingParams(n=plan.batch.n, max_new_tokens=2), seed=0)
        got = [(int(r[0]) - 1, int(r[1]) - 100) for r in batch.response_ids]  # (prompt, sample)
        report.append({"layout": name, "started": STARTED[:], "got": got})
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
