"""Reward for verifiable arithmetic: exact match of the extracted answer with ``ground_truth``.

The answer is extracted from the decoded response — its policy's last turn, in a multi-turn sample (the tool
results and turns before it are not the answer) — in one of two ways (``extract``):
- ``before_eos`` (default): the text before the first special token (EOS, ``<|endoftext|>``, ...).
  A response that never emits one (cut by ``max_response_length``) has no answer.
- ``last_number``: the last integer (``-?\\d+``) in the text before the first special token, or in
  the whole response if it never ended; none → no answer.
With ``strip`` both answer and ground truth are stripped of surrounding whitespace.
Score: ``correct_score`` on a match, ``wrong_score`` on a mismatch, ``format_score`` without an
answer. ``correct_B``: the answer matches; per-sample info: ``has_answer`` (bool).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import RewardOutput
from hybridrl.rewards.response_text import cut_at_end, decode, last_turn_tokens

if TYPE_CHECKING:  # annotations only: static validation loads these classes without transformers
    from transformers import PreTrainedTokenizerBase

EXTRACTORS = ("before_eos", "last_number")
_INTEGER = re.compile(r"-?\d+")


class ArithmeticReward:
    overlaps_compute: ClassVar[bool] = True  # pure Python on decoded text: may run beside the log-prob passes

    @dataclass(slots=True, kw_only=True)
    class Config:
        correct_score: float = 1.0
        wrong_score: float = 0.0  # an answer that does not match
        format_score: float = 0.0  # no answer could be extracted
        extract: Literal["before_eos", "last_number"] = "before_eos"
        strip: bool = True  # compare without surrounding whitespace

        def __post_init__(self) -> None:
            if self.extract not in EXTRACTORS:
                raise ValueError(f"extract={self.extract!r} is not valid; valid: {list(EXTRACTORS)}")

    def __init__(self, config: Config, *, tokenizer: PreTrainedTokenizerBase, **ctx: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.end_ids = frozenset(tokenizer.all_special_ids)

    def __call__(self, batch: RolloutBatch) -> RewardOutput:
        c = self.config
        scores: list[float] = []
        correct: list[bool] = []
        has_answer: list[bool] = []
        for i, (tokens, meta) in enumerate(zip(last_turn_tokens(batch), batch.meta, strict=True)):
            if meta.ground_truth is None:
                raise ValueError(f"arithmetic reward: sample {i} has no ground truth; the dataset must "
                                 f"provide one (data.ground_truth_key)")
            answer = self.extract(tokens)
            truth = meta.ground_truth.strip() if c.strip else meta.ground_truth
            ok = answer is not None and answer == truth
            scores.append(c.format_score if answer is None else c.correct_score if ok else c.wrong_score)
            correct.append(ok)
            has_answer.append(answer is not None)
        device = batch.response_ids.device
        return RewardOutput(scores_B=torch.tensor(scores, dtype=torch.float32, device=device),
                            correct_B=torch.tensor(correct, dtype=torch.bool, device=device),
                            info={"has_answer": has_answer})

    def extract(self, tokens: list[int]) -> str | None:
        """The answer in one response's tokens, or ``None``."""
        before_end = cut_at_end(tokens, self.end_ids)
        if self.config.extract == "before_eos":
            if before_end is None:
                return None
            text = decode(self.tokenizer, before_end)
        else:
            text = decode(self.tokenizer, before_end if before_end is not None else tokens,
                          skip_special_tokens=True)
            numbers = _INTEGER.findall(text)
            if not numbers:
                return None
            text = numbers[-1]
        return text.strip() if self.config.strip else text
