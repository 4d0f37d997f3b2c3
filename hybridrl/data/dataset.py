"""Prompt datasets: rows from parquet/jsonl files or HF datasets → tokenized prompts with their ground truth.

A row's prompt is a string or a list of chat messages (``[{"role": ..., "content": ...}]``, verl's
layout). With ``apply_chat_template`` and a tokenizer that has a chat template, a string becomes one
user message and the template is applied with the generation prompt (no extra special tokens are
added: the template has them). Otherwise a string prompt is tokenized as is, with the tokenizer's
usual special tokens (e.g. BOS). Keys may be dotted paths into nested columns
(``reward_model.ground_truth``). A row's ``data_source`` column (default: the file's stem) and its other
columns go to :class:`SampleMeta` (``data_source``, ``extra``). Entries are files or ``hf://`` names (see
:mod:`hybridrl.data.sources`). Everything is read and tokenized once, at construction; prompts longer
than ``max_prompt_length`` tokens are dropped with one counted warning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from hybridrl.batch import SampleMeta
from hybridrl.data.rows import Row
from hybridrl.data.sources import read_source, source_stem

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class PromptDatasetConfig:
    prompt_key: str = "prompt"  # column holding a string or a list of chat messages
    ground_truth_key: str | None = "ground_truth"  # None: the rows carry no reference answer
    apply_chat_template: bool = True  # when the tokenizer has a chat template
    max_prompt_length: int = 64  # tokens; longer prompts are dropped

    def __post_init__(self) -> None:
        if self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length} must be >= 1")


@dataclass(slots=True, kw_only=True, frozen=True)
class PromptItem:
    prompt_ids: list[int]
    meta: SampleMeta


class PromptDataset:
    """The kept prompts of ``files``, in file order then row order."""

    def __init__(
        self,
        files: Sequence[str | os.PathLike[str]],
        *,
        config: PromptDatasetConfig,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        if not files:
            raise ValueError("PromptDataset needs at least one data file (data.train_files / data.val_files)")
        self.config = config
        self.tokenizer = tokenizer
        self.use_chat_template = config.apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.items: list[PromptItem] = []
        total = 0
        for source in map(str, files):
            stem = source_stem(source)
            for row_no, row in read_source(source):
                total += 1
                item = self._item(f"{source} row {row_no}", stem, row)
                if len(item.prompt_ids) <= config.max_prompt_length:
                    self.items.append(item)
        dropped = total - len(self.items)
        if dropped:
            logger.warning(
                "dropped %d of %d prompts longer than %d tokens (data.max_prompt_length)",
                dropped, total, config.max_prompt_length,
            )
        if not self.items:
            raise ValueError(f"no prompts left in {[str(f) for f in files]}: all {total} rows are empty "
                             f"or longer than data.max_prompt_length={config.max_prompt_length} tokens")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    def _item(self, where: str, stem: str, row: Row) -> PromptItem:
        cfg = self.config
        prompt = _lookup(row, cfg.prompt_key, where=where, config_key="data.prompt_key")
        ground_truth = None
        if cfg.ground_truth_key is not None:
            value = _lookup(row, cfg.ground_truth_key, where=where, config_key="data.ground_truth_key")
            ground_truth = value if isinstance(value, str) else str(value)
        used = {cfg.prompt_key.split(".")[0], (cfg.ground_truth_key or "").split(".")[0], "data_source"}
        meta = SampleMeta(
            ground_truth=ground_truth,
            data_source=str(row.get("data_source") or stem),
            extra={k: v for k, v in row.items() if k not in used},
        )
        return PromptItem(prompt_ids=self._tokenize(prompt, where=where), meta=meta)

    def _tokenize(self, prompt: Any, *, where: str) -> list[int]:
        key = self.config.prompt_key
        if isinstance(prompt, str):
            if not self.use_chat_template:
                return list(self.tokenizer(prompt)["input_ids"])
            messages = [{"role": "user", "content": prompt}]
        elif _is_messages(prompt):
            if not self.use_chat_template:
                raise ValueError(
                    f"{where}: {key!r} is a list of chat messages, but "
                    + ("data.apply_chat_template is false" if not self.config.apply_chat_template
                       else "the tokenizer has no chat template")
                    + "; give plain-text prompts or a tokenizer with a chat template"
                )
            messages = prompt
        else:
            raise ValueError(f"{where}: {key!r} (data.prompt_key) must be a string or a list of "
                             f"{{'role', 'content'}} messages, got {type(prompt).__name__}: {prompt!r:.80}")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _lookup(row: Row, key: str, *, where: str, config_key: str) -> Any:
    """``row[key]`` where ``key`` may be a dotted path; errors name the file, row, key and config key."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value or value[part] is None:
            keys = sorted(value) if isinstance(value, dict) else []
            raise ValueError(f"{where}: missing key {key!r} ({config_key}); the row has keys {keys}")
        value = value[part]
    return value


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ) and bool(value)
