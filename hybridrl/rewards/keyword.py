"""Reward for mentioning keywords: the share (or presence) of configured keywords in the response.

The response is decoded without special tokens; a keyword counts once if it occurs as a substring
(case-insensitive unless ``case_sensitive``). ``mode``:
- ``fraction``: matched keywords / all keywords;
- ``any``: 1.0 if at least one keyword occurs, else 0.0;
- ``all``: 1.0 if every keyword occurs, else 0.0.
The result is multiplied by ``scale``. ``correct_B``: every keyword occurs; per-sample info:
``matched`` (how many keywords occur).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import RewardOutput
from hybridrl.rewards.response_text import decode, response_tokens

if TYPE_CHECKING:  # annotations only: static validation loads these classes without transformers
    from transformers import PreTrainedTokenizerBase

MODES = ("fraction", "any", "all")


class KeywordReward:
    overlaps_compute: ClassVar[bool] = True  # pure Python on decoded text: may run beside the log-prob passes

    @dataclass(slots=True, kw_only=True)
    class Config:
        keywords: list[str]  # at least one non-empty string
        mode: Literal["fraction", "any", "all"] = "fraction"
        case_sensitive: bool = False
        scale: float = 1.0

        def __post_init__(self) -> None:
            if not self.keywords or not all(isinstance(k, str) and k for k in self.keywords):
                raise ValueError(f"keywords={self.keywords!r} must be a non-empty list of non-empty strings")
            if self.mode not in MODES:
                raise ValueError(f"mode={self.mode!r} is not valid; valid: {list(MODES)}")

    def __init__(self, config: Config, *, tokenizer: PreTrainedTokenizerBase, **ctx: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._keywords = [self._fold(k) for k in config.keywords]

    def __call__(self, batch: RolloutBatch) -> RewardOutput:
        c = self.config
        scores: list[float] = []
        matched: list[int] = []
        for tokens in response_tokens(batch):
            text = self._fold(decode(self.tokenizer, tokens, skip_special_tokens=True))
            n = sum(k in text for k in self._keywords)
            share = n / len(self._keywords)
            value = share if c.mode == "fraction" else float(n > 0) if c.mode == "any" else float(share == 1.0)
            scores.append(c.scale * value)
            matched.append(n)
        device = batch.response_ids.device
        return RewardOutput(scores_B=torch.tensor(scores, dtype=torch.float32, device=device),
                            correct_B=torch.tensor(matched, device=device) == len(self._keywords),
                            info={"matched": matched})

    def _fold(self, text: str) -> str:
        return text if self.config.case_sensitive else text.casefold()
