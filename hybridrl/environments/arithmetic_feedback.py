"""``arithmetic_feedback``: the arithmetic task with a second try — a wrong answer gets feedback and another turn.

Each assistant turn's answer is the last integer in its text (none: no answer). Right: the episode ends with
reward 1. Wrong: the environment says so (``feedback``) and the policy answers again, up to ``max_tries`` answers;
the last wrong one ends the episode with reward 0. The ground truth is the row's (``SampleMeta.ground_truth``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hybridrl.batch import SampleMeta
from hybridrl.interfaces import EnvStep

_INT = re.compile(r"-?\d+")


class ArithmeticFeedback:
    @dataclass(slots=True, kw_only=True)
    class Config:
        max_tries: int = 2  # answers per episode
        feedback: str = "That is not right. Try again."

        def __post_init__(self) -> None:
            if self.max_tries < 1:
                raise ValueError(f"max_tries={self.max_tries} must be ≥ 1")

    def __init__(self, config: ArithmeticFeedback.Config | None = None, **ctx: Any) -> None:
        self.config = config if config is not None else self.Config()

    def open(self, meta: SampleMeta, *, seed: int) -> _Episode:
        if meta.ground_truth is None:
            raise ValueError("arithmetic_feedback needs the row's ground truth (data.ground_truth_key)")
        return _Episode(self.config, meta.ground_truth.strip())


class _Episode:
    def __init__(self, config: ArithmeticFeedback.Config, truth: str) -> None:
        self.config, self.truth, self.tries = config, truth, 0

    def step(self, message: dict[str, Any]) -> EnvStep:
        self.tries += 1
        answers = _INT.findall(str(message.get("content", "")))
        right = bool(answers) and answers[-1] == self.truth
        if right or self.tries >= self.config.max_tries:
            return EnvStep(messages=[], done=True, reward=float(right), info={"tries": self.tries})
        return EnvStep(messages=[{"role": "user", "content": self.config.feedback}], done=False, reward=0.0,
                       info={"tries": self.tries})
