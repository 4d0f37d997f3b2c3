"""``trainer.rollout_data_dir`` (verl's key): every step's samples as ``<dir>/<step>.jsonl``, one line per sample.

Fields: ``step``, ``input`` (the prompt's text), ``output`` (the response's text, special tokens dropped, as verl),
``score`` (the sequence score the advantages saw: the reward plus any overlong penalty), ``turns`` (the policy's
turns: runs of ``loss_mask`` = 1), ``data_source``, ``weight_version`` (the oldest version that sampled its tokens),
``response_ids`` and ``loss_mask`` (lists, the response's real tokens), ``env_error`` (why a multi-turn episode's
environment failed, null when it did not). Rank 0 writes the whole step (every DP
rank's share, in DP order); a file is written whole or not at all (a temporary file renamed into place).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hybridrl.batch import RolloutBatch


def rows(batch: RolloutBatch, scores_B: torch.Tensor, tokenizer: PreTrainedTokenizerBase,
         step: int) -> list[dict[str, Any]]:
    out = []
    for b in range(len(batch)):
        real = batch.response_mask[b].bool()
        ids, mask = batch.response_ids[b][real].tolist(), batch.loss_mask[b][real].tolist()
        prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()].tolist()
        out.append({"step": step, "input": tokenizer.decode(prompt, skip_special_tokens=True),
                    "output": tokenizer.decode(ids, skip_special_tokens=True), "score": float(scores_B[b]),
                    "turns": sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])),
                    "data_source": batch.meta[b].data_source, "weight_version": int(batch.weight_version[b]),
                    "response_ids": ids, "loss_mask": mask, "env_error": batch.meta[b].env_error})
    return out


def dump(directory: str, step: int, batch: RolloutBatch, scores_B: torch.Tensor,
         tokenizer: PreTrainedTokenizerBase) -> None:
    """Gather the step's rows over the DP group (host objects) and write them from rank 0."""
    mine = rows(batch, scores_B, tokenizer, step)
    parts: list[Any] = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(parts, mine, group=parallel_state.get_data_parallel_group_gloo())
    if dist.get_rank() != 0:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".{step}.jsonl.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        for part in parts:
            for row in part:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path / f"{step}.jsonl")
