"""Inputs for a plugin's own tests: a tiny real tokenizer and a real small RolloutBatch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hybridrl.batch import RolloutBatch, SampleMeta

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# make_batch's default task: prompts, their answers, and per prompt a right, a wrong and an unfinished response
PROMPTS: tuple[str, ...] = ("1+2=", "10+25=")
GROUND_TRUTHS: tuple[str, ...] = ("3", "35")


def tiny_tokenizer(*, model_max_length: int = 512) -> PreTrainedTokenizerBase:
    """A real tokenizer without a model hub: the project's char-level ``Qwen2Tokenizer`` (printable ASCII, one
    token per char, ChatML template, ``<|im_end|>`` as EOS) — for tests that need one of their own."""
    from hybridrl.models.char_tokenizer import make_char_tokenizer

    return make_char_tokenizer(model_max_length=model_max_length)


def make_batch(
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompts: Sequence[str] = PROMPTS,
    ground_truths: Sequence[str | None] | None = GROUND_TRUTHS,
    responses: Sequence[Sequence[str]] | None = None,
    chat_template: bool = True,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> RolloutBatch:
    """A real small ``RolloutBatch``: ``responses[i]`` are prompt ``i``'s samples, prompt-major.

    Prompts go through the tokenizer's chat template (when it has one and ``chat_template``), as the
    prompt dataset does; responses are tokenized as written, so a special token's text (e.g.
    ``tokenizer.eos_token``) becomes that token. Default responses per prompt: the ground truth +
    EOS, a wrong answer + EOS, and an unfinished one (no EOS, finish reason "length"). Rollout
    log-probs are random negatives; ``group_index`` is the prompt's index.
    """
    truths = list(ground_truths) if ground_truths is not None else [None] * len(prompts)
    if len(truths) != len(prompts):
        raise ValueError(f"make_batch: {len(truths)} ground truths for {len(prompts)} prompts")
    eos = tokenizer.eos_token or ""
    if responses is None:
        responses = [[f"{t}{eos}", f"{t}0{eos}", f"the answer is {t}"] for t in (g or "0" for g in truths)]
    if len(responses) != len(prompts):
        raise ValueError(f"make_batch: responses for {len(responses)} prompts, expected {len(prompts)}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("make_batch: the tokenizer has neither a pad nor an eos token")
    rows: list[tuple[list[int], list[int], int, str | None]] = []
    for i, (prompt, samples) in enumerate(zip(prompts, responses, strict=True)):
        if chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=False)
            prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            prompt_ids = list(tokenizer(prompt)["input_ids"])
        rows += [(prompt_ids, list(tokenizer(r, add_special_tokens=False)["input_ids"]), i, truths[i])
                 for r in samples]
    b = len(rows)
    p, t = max(1, *(len(r[0]) for r in rows)), max(1, *(len(r[1]) for r in rows))
    prompt_ids_BP = torch.full((b, p), pad, dtype=torch.long)
    prompt_mask_BP = torch.zeros((b, p), dtype=torch.long)
    response_ids_BT = torch.full((b, t), pad, dtype=torch.long)
    response_mask_BT = torch.zeros((b, t), dtype=torch.long)
    for k, (prompt_ids, response_ids, _, _) in enumerate(rows):
        if prompt_ids:
            prompt_ids_BP[k, p - len(prompt_ids):] = torch.tensor(prompt_ids)  # left padding
            prompt_mask_BP[k, p - len(prompt_ids):] = 1
        response_ids_BT[k, :len(response_ids)] = torch.tensor(response_ids, dtype=torch.long)  # right padding
        response_mask_BT[k, :len(response_ids)] = 1
    gen = torch.Generator().manual_seed(seed)
    logprobs_BT = -(torch.rand((b, t), generator=gen) * 3 + 0.01) * response_mask_BT
    ends = {tokenizer.eos_token_id} - {None}
    meta = [SampleMeta(ground_truth=g, data_source="hybridrl.testing",
                       finish_reason="stop" if r and r[-1] in ends else "length") for _, r, _, g in rows]
    batch = RolloutBatch(
        prompt_ids=prompt_ids_BP, prompt_mask=prompt_mask_BP, response_ids=response_ids_BT,
        response_mask=response_mask_BT, rollout_logprobs=logprobs_BT,
        weight_version=torch.zeros(b, dtype=torch.long), group_index=torch.tensor([r[2] for r in rows]),
        meta=meta, pad_token_id=int(pad),
    )
    return batch.to(device)
