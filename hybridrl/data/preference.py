"""Preference pairs: rows ``(prompt, chosen, rejected)`` for DPO (``launch/dpo.py``).

Row layout (what :class:`PreferenceDataset` reads and ``hybridrl prepare preference`` writes):
``prompt`` (a string or a list of chat messages, as for the RL prompts), ``chosen`` and ``rejected``
(the two responses as strings), ``data_source``, and any other columns, kept. The column names are
``data.prompt_key``, ``data.chosen_key``, ``data.rejected_key`` (TRL's names by default).

``hybridrl prepare preference OUT_DIR --from FILE`` also reads TRL's conversational layout, where
``chosen``/``rejected`` are message lists ending with the assistant's reply (optionally preceded by
the prompt's own messages, as in UltraFeedback-binarized): the reply's text is kept. Anything else
(a missing or empty response, other preceding turns) is an error naming the file and row.

:func:`arithmetic_preference_rows` turns the arithmetic task's rows into pairs (the tiny DPO recipe's
data): chosen = the correct answer, rejected = a plausible wrong one (see there).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from hybridrl.config.errors import DataError
from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig, PromptItem
from hybridrl.data.rows import Row

PAIR_COLUMNS = ("prompt", "chosen", "rejected", "data_source")  # the columns prepare writes


@dataclass(slots=True, kw_only=True)
class PreferenceDatasetConfig:
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    apply_chat_template: bool = True
    max_prompt_length: int = 64  # tokens; longer prompts are dropped (counted in a warning)
    margin_key: str | None = None  # a numeric column each row must hold (the reward model's data.margin_key)


class PreferenceDataset(PromptDataset):
    """Tokenized prompts with their two responses: an item's ``meta.ground_truth`` is the chosen one,
    ``meta.extra[data.rejected_key]`` the rejected one (both checked to be non-empty strings)."""

    def __init__(self, files: Sequence[str | os.PathLike[str]], *, config: PreferenceDatasetConfig,
                 tokenizer: PreTrainedTokenizerBase) -> None:
        self.pairs = config
        super().__init__(files, tokenizer=tokenizer, config=PromptDatasetConfig(
            prompt_key=config.prompt_key, ground_truth_key=config.chosen_key,
            apply_chat_template=config.apply_chat_template, max_prompt_length=config.max_prompt_length))

    def _item(self, where: str, stem: str, row: Row) -> PromptItem:
        for key, config_key in ((self.pairs.chosen_key, "data.chosen_key"),
                                (self.pairs.rejected_key, "data.rejected_key")):
            value = row.get(key)
            if not isinstance(value, str) or not value:
                what = "missing" if key not in row else f"{type(value).__name__} {value!r:.60}"
                raise DataError(f"{where}: {key!r} ({config_key}) must be a non-empty string, got {what}; the row has "
                                 f"keys {sorted(row)} (conversational pairs: convert them with `hybridrl prepare "
                                 f"preference`)")
        if (key := self.pairs.margin_key) is not None:
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise DataError(f"{where}: {key!r} (data.margin_key) must be a finite number, got "
                                f"{'nothing' if key not in row else repr(value)[:60]}; the row has keys {sorted(row)}")
        return super()._item(where, stem, row)


def preference_row(row: Row, *, where: str, prompt_key: str, template: str | None, prompt_format: str,
                   data_source: str) -> Row:
    """A source row → the pair layout (module docstring); ValueError naming ``where`` (file and row)."""
    prompt: Any = row.get(prompt_key)
    if isinstance(prompt, str) and prompt.strip():
        text = template.replace("{question}", prompt) if template is not None else prompt
        out_prompt: Any = [{"role": "user", "content": text}] if prompt_format == "chat" else text
        as_messages = [{"role": "user", "content": prompt}]
    elif _is_messages(prompt):
        if prompt_format == "text":
            raise ValueError(f"{where}: {prompt_key!r} is a list of chat messages; use --prompt-format chat")
        out_prompt = as_messages = list(prompt)
    else:
        raise ValueError(f"{where}: no prompt: {prompt_key!r} (--question-key) must be a non-empty string or a list of "
                         f"chat messages, got {prompt!r:.60}; the row has keys {sorted(row)}")
    responses = {key: _response_text(row, key, where=where, prompt_messages=as_messages)
                 for key in ("chosen", "rejected")}
    rest = {k: v for k, v in row.items() if k not in PAIR_COLUMNS and k != prompt_key}
    return {"prompt": out_prompt, **responses, "data_source": data_source, **rest}


def _response_text(row: Row, key: str, *, where: str, prompt_messages: list[dict[str, str]]) -> str:
    value: Any = row.get(key)
    if isinstance(value, str) and value.strip():
        return value
    if _is_messages(value) and value[-1]["role"] == "assistant" and value[-1]["content"].strip():
        before = value[:-1]
        if before and before != prompt_messages:
            raise ValueError(f"{where}: {key!r} has turns before its last assistant message that are not the "
                             f"prompt's ({len(before)} messages); only single-reply pairs are supported")
        return str(value[-1]["content"])
    what = "missing" if key not in row else f"{value!r:.60}"
    raise ValueError(f"{where}: {key!r} must be a non-empty string or a list of chat messages ending with the "
                     f"assistant's reply, got {what}; the row has keys {sorted(row)}")


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer to a non-negative integer ``answer``: off by ±1 or ±10, two adjacent digits
    swapped, a digit dropped or repeated — the kinds of mistakes a small model makes on this task. Never
    equals it, never negative, never with a leading zero."""
    n = int(answer)
    digits = str(n)
    numbers = {n + 1, n - 1, n + 10, n - 10}
    texts = {digits[:i] + digits[i + 1] + digits[i] + digits[i + 2:] for i in range(len(digits) - 1)}  # swapped
    texts |= {digits[:i] + digits[i + 1:] for i in range(len(digits))}  # a digit dropped
    texts |= {digits[:i] + digits[i] + digits[i:] for i in range(len(digits))}  # a digit repeated
    numbers |= {int(t) for t in texts if t and str(int(t)) == t}
    return str(rng.choice(sorted(m for m in numbers if m >= 0 and m != n)))


def arithmetic_preference_rows(rows: Sequence[Row], *, seed: int) -> list[Row]:
    """The arithmetic task's rows as pairs: chosen = ``ground_truth``, rejected = :func:`wrong_answer`
    (seeded); the other columns are kept."""
    rng = random.Random(seed)
    return [{"prompt": r["prompt"], "chosen": r["ground_truth"], "rejected": wrong_answer(r["ground_truth"], rng),
             **{k: v for k, v in r.items() if k not in ("prompt", "chosen", "rejected")}} for r in rows]
