"""Reward for math word problems (GSM8K, MATH): the response's final answer against ``ground_truth``.

Text: the decoded response before its first special token (EOS, ``<|endoftext|>``, ...). A response
that never emits one (cut by ``max_response_length``) is still parsed, whole (special tokens
skipped): its last ``\\boxed{}`` / ``####`` / number is its answer, though it may itself be cut
short ("#### 12" of "#### 125"); such a response never earns ``format_reward``.

Answer (``extract``, see :mod:`hybridrl_math_reward.extraction`): ``gsm8k`` (``#### x``, else the
last number), ``boxed`` (the last ``\\boxed{x}``, else math-verify's own extraction), ``last_number``,
or ``auto``: ``gsm8k`` for a sample whose ``meta.data_source`` contains "gsm8k" (``gsm8k``,
``openai/gsm8k``), ``boxed`` for every other source (``math``, ``hendrycks_math``, ...).

Correct: the answer equals the ground truth character for character, or math-verify says they are
equivalent (:mod:`hybridrl_math_reward.equivalence`): ``0.5`` = ``\\frac{1}{2}`` = ``1/2``,
``1,000`` = ``1000``, ``\\sqrt{2}/2`` = ``\\frac{\\sqrt2}{2}``, ``(1,2]`` = ``\\left(1, 2\\right]``,
``\\text{(B)}`` = ``B``, ``50\\%`` = ``50``, ``90^\\circ`` = ``90``, ``{2, 3}`` in any order. An
equation against a value counts (``x=3`` against ``3``, either way round), as math-verify decides.
Not equal: ``\\pi`` vs ``3.14159`` and ``1/3`` vs ``0.333`` (numbers agree to 6 decimals or not at all).

Score: ``correct_score`` / ``wrong_score`` / ``format_score`` (no answer found), plus
``format_reward`` when the answer is in the task's format (``####`` for gsm8k, ``\\boxed{}`` for
boxed, a number for last_number; not a fallback's answer) and the response ended with a special
token. ``correct_B``: correct; per-sample info: ``has_answer`` (bool), ``extracted`` (the answer as
written, None without one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import RewardOutput
from hybridrl.rewards.response_text import cut_at_end, decode, response_tokens
from hybridrl_math_reward.equivalence import Parsed, equivalent, parse_math

if TYPE_CHECKING:  # static validation loads this class to check reward.kwargs: no transformers import for that
    from transformers import PreTrainedTokenizerBase
from hybridrl_math_reward.extraction import FORMATS, Answer, Format, extract_answer

EXTRACTORS = ("auto", *FORMATS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Judgement:
    """One response, scored."""

    score: float
    correct: bool
    answer: Answer | None


class MathReward:
    # thread-safe and CPU-only (no torch.distributed, no accelerator memory): it may score while the
    # trainer computes log-probs (hybridrl.rewards.execution)
    overlaps_compute: ClassVar[bool] = True

    @dataclass(slots=True, kw_only=True)
    class Config:
        correct_score: float = 1.0
        wrong_score: float = 0.0  # an answer that is not equivalent
        format_score: float = 0.0  # no answer could be extracted
        format_reward: float = 0.0  # added when the answer is in the task's format and the response ended
        extract: Literal["auto", "gsm8k", "boxed", "last_number"] = "auto"  # auto: by meta.data_source
        max_answer_chars: int = 1000  # longer answers are not parsed (only a verbatim match counts)

        def __post_init__(self) -> None:
            if self.extract not in EXTRACTORS:
                raise ValueError(f"extract={self.extract!r} is not valid; valid: {list(EXTRACTORS)}")
            for name in ("correct_score", "wrong_score", "format_score", "format_reward"):
                value = getattr(self, name)
                if not math.isfinite(value):
                    raise ValueError(f"{name}={value!r} must be a finite number")
            if self.max_answer_chars < 1:
                raise ValueError(f"max_answer_chars={self.max_answer_chars} must be >= 1")

    def __init__(self, config: Config, *, tokenizer: PreTrainedTokenizerBase, **ctx: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.end_ids = frozenset(tokenizer.all_special_ids)

    def __call__(self, batch: RolloutBatch) -> RewardOutput:
        truths: dict[str, Parsed] = {}  # a group's samples share their ground truth: parse it once
        judged: list[Judgement] = []
        for i, (tokens, meta) in enumerate(zip(response_tokens(batch), batch.meta, strict=True)):
            if meta.ground_truth is None:
                raise ValueError(f"math reward: sample {i} has no ground truth; the dataset must provide "
                                 f"one (data.ground_truth_key)")
            if meta.ground_truth not in truths:
                truths[meta.ground_truth] = parse_math(meta.ground_truth)
            before_end = cut_at_end(tokens, self.end_ids)
            text = decode(self.tokenizer, tokens if before_end is None else before_end, skip_special_tokens=True)
            judged.append(self.judge(text, ended=before_end is not None, truth=meta.ground_truth,
                                     truth_parsed=truths[meta.ground_truth], data_source=meta.data_source))
        device = batch.response_ids.device
        return RewardOutput(
            scores_B=torch.tensor([j.score for j in judged], dtype=torch.float32, device=device),
            correct_B=torch.tensor([j.correct for j in judged], dtype=torch.bool, device=device),
            info={"has_answer": [j.answer is not None for j in judged],
                  "extracted": [j.answer.text if j.answer is not None else None for j in judged]},
        )

    def judge(self, text: str, *, ended: bool, truth: str, truth_parsed: Parsed | None = None,
              data_source: str = "") -> Judgement:
        """Score one decoded response against ``truth``; ``ended``: it stopped on a special token."""
        c = self.config
        answer = extract_answer(text, self.format_of(data_source), max_chars=c.max_answer_chars)
        if answer is None:
            return Judgement(score=c.format_score, correct=False, answer=None)
        if truth_parsed is None:
            truth_parsed = parse_math(truth)
        correct = answer.text.strip() == truth.strip() or equivalent(truth_parsed, answer.parsed)
        score = (c.correct_score if correct else c.wrong_score) + (c.format_reward if answer.formatted and ended
                                                                  else 0.0)
        return Judgement(score=score, correct=correct, answer=answer)

    def format_of(self, data_source: str) -> Format:
        """The answer format of a sample from ``data_source`` under ``extract``."""
        if self.config.extract != "auto":
            return self.config.extract
        return "gsm8k" if "gsm8k" in data_source.lower() else "boxed"
