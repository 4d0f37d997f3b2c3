"""Prompt datasets: rows from parquet/jsonl files or HF datasets → tokenized prompts with their ground truth.

A row's prompt is a string or a list of chat messages (``[{"role": ..., "content": ...}]``, verl's
layout). With ``apply_chat_template`` and a tokenizer that has a chat template, a string becomes one
user message and the template is applied with the generation prompt (no extra special tokens are
added: the template has them). Otherwise a string prompt is tokenized as is, with the tokenizer's
usual special tokens (e.g. BOS). Keys may be dotted paths into nested columns
(``reward_model.ground_truth``). A row's ``data_source`` column (default: the file's stem) and its other
columns go to :class:`SampleMeta` (``data_source``, ``extra``). Entries are files or ``hf://`` names (see
:mod:`hybridrl.data.sources`).

Start-up that scales with the dataset: the rows are tokenized once per run, not once per rank. Under
``torch.distributed`` each rank tokenizes a contiguous 1/world share of the rows and the token arrays are
all-gathered (over gloo, :mod:`hybridrl.distributed.host_group`), so every rank ends with the same compact int32 arrays
(:class:`TokenTable`) instead of a Python list per prompt; a row's metadata is read from its table when the
row is drawn (parquet: from the Arrow table, never turned into one dict per row up front). The length
filter is exact — a prompt is kept iff its token count is ≤ ``max_prompt_length``, as before — and is
counted: one warning with the number dropped and :attr:`PromptDataset.filter_metrics`
(``data/prompts_{total,kept,dropped}``, logged with the run's first step). Every row is checked by
:meth:`PromptDataset._item` while it is tokenized (a missing key or a bad prompt is an error naming the file
and row, raised on every rank at once); rows and prompt order are those of reading every row in turn.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from hybridrl.batch import SampleMeta
from hybridrl.config.errors import DataError
from hybridrl.data.rows import TRUNCATIONS, Row
from hybridrl.data.sources import is_hf, read_source, source_stem
from hybridrl.distributed import host_group
from hybridrl.tracking import say

logger = logging.getLogger(__name__)

CHUNK = 4096  # rows turned into dicts at a time
PROGRESS_EVERY_S = 10.0


@dataclass(slots=True, kw_only=True)
class PromptDatasetConfig:
    prompt_key: str = "prompt"  # column holding a string or a list of chat messages
    ground_truth_key: str | None = "ground_truth"  # None: the rows carry no reference answer
    apply_chat_template: bool = True  # when the tokenizer has a chat template
    max_prompt_length: int = 64  # tokens; longer prompts are dropped (or cut: filter_overlong_prompts=False)
    filter_overlong_prompts: bool = True  # verl's key: drop a longer prompt; false: cut it as `truncation` says
    truncation: str = "error"  # verl's: error | left (keep its last tokens) | right (its first) | middle (both ends)
    # OpenAI function schemas the chat template renders into the prompt (a multi-turn rollout's tools)
    tools: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length} must be >= 1")
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"data.truncation={self.truncation!r}; valid: {', '.join(TRUNCATIONS)}")


@dataclass(slots=True, kw_only=True, frozen=True)
class PromptItem:
    prompt_ids: list[int]
    meta: SampleMeta


class RowTable:
    """The rows of one data entry by row number: parquet stays an Arrow table (a row becomes a dict only
    when drawn); jsonl and ``hf://`` rows are read as :func:`read_source` reads them."""

    def __init__(self, source: str) -> None:
        self.source, self.stem = source, source_stem(source)
        self._arrow: pa.Table | None = None
        self._rows: list[Row] = []
        if not is_hf(source) and source.endswith(".parquet"):
            if not os.path.isfile(source):
                raise FileNotFoundError(f"data file {source!r} does not exist")
            self._arrow = pq.read_table(source)
        else:
            self._rows = [row for _, row in read_source(source)]

    def __len__(self) -> int:
        return self._arrow.num_rows if self._arrow is not None else len(self._rows)

    def row(self, i: int) -> Row:
        return self._arrow.slice(i, 1).to_pylist()[0] if self._arrow is not None else self._rows[i]

    def rows(self, start: int, stop: int) -> list[Row]:
        return self._arrow.slice(start, stop - start).to_pylist() if self._arrow is not None \
            else self._rows[start:stop]


@dataclass(slots=True, kw_only=True, frozen=True)
class TokenTable:
    """Token ids of many prompts in two arrays: prompt ``i`` is ``ids[offsets[i]:offsets[i + 1]]``."""

    ids: np.ndarray  # [sum of lengths] int32
    offsets: np.ndarray  # [n + 1] int64, offsets[0] = 0

    @classmethod
    def from_lengths(cls, ids: np.ndarray, lengths: np.ndarray) -> TokenTable:
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(ids=ids, offsets=offsets)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, i: int) -> list[int]:
        return self.ids[self.offsets[i]:self.offsets[i + 1]].tolist()

    def select(self, keep: np.ndarray) -> TokenTable:
        """The prompts where the boolean mask ``keep`` is true, in order."""
        lengths = self.lengths
        return TokenTable.from_lengths(self.ids[np.repeat(keep, lengths)], lengths[keep])


class PromptDataset:
    """The kept prompts of ``files``, in file order then row order.

    Under torch.distributed its construction is a collective: every rank builds the same dataset, in the
    same order as its other datasets.
    """

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
        self.tables = [RowTable(str(f)) for f in files]
        self._starts = np.cumsum([0] + [len(t) for t in self.tables])  # global row number of each table's row 0
        total = int(self._starts[-1])
        tokens = self._tokenize_shared(total, names=[str(f) for f in files])
        if not config.filter_overlong_prompts:
            tokens = self._truncate(tokens)
        keep = tokens.lengths <= config.max_prompt_length
        self.rows = np.flatnonzero(keep)  # [kept] global row number of each kept prompt
        self.tokens = tokens.select(keep)
        kept = len(self.rows)
        self.filter_metrics = {"data/prompts_total": float(total), "data/prompts_kept": float(kept),
                               "data/prompts_dropped": float(total - kept)}
        if kept < total:
            logger.warning("dropped %d of %d prompts longer than %d tokens (data.max_prompt_length)",
                           total - kept, total, config.max_prompt_length)
        if not kept:
            raise DataError(f"no prompts left in {[str(f) for f in files]}: all {total} rows are empty "
                             f"or longer than data.max_prompt_length={config.max_prompt_length} tokens")

    def __len__(self) -> int:
        return len(self.rows)

    def _truncate(self, tokens: TokenTable) -> TokenTable:
        """Prompts over ``max_prompt_length`` cut as ``truncation`` says (verl's rule: ``middle`` keeps the first
        ⌊max/2⌋ and the last max − ⌊max/2⌋ tokens); ``error`` names the first such row."""
        limit, lengths = self.config.max_prompt_length, tokens.lengths
        over = np.flatnonzero(lengths > limit)
        if not len(over):
            return tokens
        if self.config.truncation == "error":
            g = int(over[0])
            t = int(np.searchsorted(self._starts, g, side="right")) - 1
            raise DataError(f"{self.tables[t].source} row {g - int(self._starts[t])}: the prompt has {lengths[g]} "
                             f"tokens, over data.max_prompt_length={limit} ({len(over)} such prompts in all), and "
                             "data.truncation=error; set data.filter_overlong_prompts=true (drop them), "
                             "data.truncation=left|right|middle (cut them) or raise data.max_prompt_length")
        keep = np.ones(len(tokens.ids), dtype=bool)
        head = {"left": 0, "right": limit, "middle": limit // 2}[self.config.truncation]
        for i in over:  # drop the tokens between the kept head and the kept tail
            start = int(tokens.offsets[i])
            keep[start + head:start + int(lengths[i]) - (limit - head)] = False
        return TokenTable.from_lengths(tokens.ids[keep], np.minimum(lengths, limit))

    @property
    def items(self) -> list[PromptItem]:
        """Every kept prompt, built now (for small sets and tests; the loader draws them one by one)."""
        return [self[i] for i in range(len(self))]

    def __getitem__(self, index: int) -> PromptItem:
        if not -len(self) <= index < len(self):
            raise IndexError(f"prompt {index} of a dataset of {len(self)}")
        index %= len(self)
        g = int(self.rows[index])
        t = int(np.searchsorted(self._starts, g, side="right")) - 1
        table, row_no = self.tables[t], g - int(self._starts[t])
        meta = self._meta(f"{table.source} row {row_no}", table.stem, table.row(row_no))
        return PromptItem(prompt_ids=self.tokens[index], meta=meta)

    # -- tokenization, once per run ---------------------------------------------------------------------

    def _tokenize_shared(self, total: int, *, names: list[str]) -> TokenTable:
        """Every row's tokens; under torch.distributed each rank tokenizes 1/world of them, then all-gather."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        start, stop = total * rank // world, total * (rank + 1) // world
        if world == 1:
            return self._tokenize_rows(start, stop, total=total, world=world, names=names)
        error, part = None, TokenTable.from_lengths(np.zeros(0, np.int32), np.zeros(0, np.int64))
        try:
            part = self._tokenize_rows(start, stop, total=total, world=world, names=names)
        except Exception as e:  # noqa: BLE001 — a bad row: every rank raises it, none is left waiting in the gather
            error = ("DataError" if isinstance(e, DataError) else type(e).__name__, str(e))
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (error, part.ids, part.lengths), group=host_group.get())
        errors = [e for e, _, _ in gathered if e is not None]
        if errors:  # the first bad row in file order, as one rank reading everything would have found
            kind, message = errors[0]
            if kind == "DataError":  # the input's mistake: one line on every rank (hybridrl/trainers/entry.py)
                raise DataError(message)
            raise (ValueError if kind == "ValueError" else RuntimeError)(
                message if kind == "ValueError" else f"{kind}: {message}")
        return TokenTable.from_lengths(np.concatenate([ids for _, ids, _ in gathered]),
                                       np.concatenate([lengths for _, _, lengths in gathered]))

    def _tokenize_rows(self, start: int, stop: int, *, total: int, world: int, names: list[str]) -> TokenTable:
        """Tokens of global rows ``start..stop-1``, each row checked by :meth:`_item` as it is read."""
        ids = array("i")  # C int: int32 here, as np.frombuffer below assumes
        lengths = np.zeros(stop - start, dtype=np.int64)
        t0 = last = time.perf_counter()
        for i, (where, stem, row) in enumerate(self._rows(start, stop)):
            prompt_ids = self._item(where, stem, row).prompt_ids
            lengths[i] = len(prompt_ids)
            ids.extend(prompt_ids)
            if i % 1000 == 999 and (now := time.perf_counter()) - last > PROGRESS_EVERY_S:
                last, rate = now, (i + 1) / (now - t0)
                say(f"tokenizing {', '.join(names)}: {i + 1}/{stop - start} rows ({100 * (i + 1) // (stop - start)}%) "
                    f"{rate:.0f} rows/s, ETA {(stop - start - i - 1) / rate:.0f} s ({world} ranks share {total} rows)")
        return TokenTable.from_lengths(np.frombuffer(ids, dtype=np.int32) if ids else np.zeros(0, np.int32), lengths)

    def _rows(self, lo: int, hi: int) -> Iterator[tuple[str, str, Row]]:
        """``(where, stem, row)`` of global rows ``lo..hi-1``, read from the tables in chunks."""
        t = int(np.searchsorted(self._starts, lo, side="right")) - 1
        while lo < hi:
            table, first = self.tables[t], int(self._starts[t])
            end = min(hi, int(self._starts[t + 1]), lo + CHUNK)
            for n, row in enumerate(table.rows(lo - first, end - first), start=lo - first):
                yield f"{table.source} row {n}", table.stem, row
            lo = end
            if lo == int(self._starts[t + 1]):
                t += 1

    def _item(self, where: str, stem: str, row: Row) -> PromptItem:
        """One row checked and tokenized (a subclass may check more, then call this)."""
        prompt = _lookup(row, self.config.prompt_key, where=where, config_key="data.prompt_key")
        meta = self._meta(where, stem, row)
        return PromptItem(prompt_ids=self._tokenize(prompt, where=where), meta=meta)

    def _meta(self, where: str, stem: str, row: Row) -> SampleMeta:
        cfg = self.config
        ground_truth = None
        if cfg.ground_truth_key is not None:
            value = _lookup(row, cfg.ground_truth_key, where=where, config_key="data.ground_truth_key")
            ground_truth = value if isinstance(value, str) else str(value)
        used = {cfg.prompt_key.split(".")[0], (cfg.ground_truth_key or "").split(".")[0], "data_source"}
        return SampleMeta(
            ground_truth=ground_truth,
            data_source=str(row.get("data_source") or stem),
            messages=self._messages(_lookup(row, cfg.prompt_key, where=where, config_key="data.prompt_key"))
            if self.use_chat_template else None,
            extra={k: v for k, v in row.items() if k not in used},
        )

    @staticmethod
    def _messages(prompt: Any) -> list[dict[str, Any]] | None:
        """The chat messages the prompt is rendered from (a multi-turn rollout renders its turns after them)."""
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(m) for m in prompt] if _is_messages(prompt) else None

    def _tokenize(self, prompt: Any, *, where: str) -> list[int]:
        key = self.config.prompt_key
        if isinstance(prompt, str):
            if not self.use_chat_template:
                return list(self.tokenizer(prompt)["input_ids"])
            messages = [{"role": "user", "content": prompt}]
        elif _is_messages(prompt):
            if not self.use_chat_template:
                raise DataError(
                    f"{where}: {key!r} is a list of chat messages, but "
                    + ("data.apply_chat_template is false" if not self.config.apply_chat_template
                       else "the tokenizer has no chat template")
                    + "; give plain-text prompts or a tokenizer with a chat template"
                )
            messages = prompt
        else:
            raise DataError(f"{where}: {key!r} (data.prompt_key) must be a string or a list of "
                             f"{{'role', 'content'}} messages, got {type(prompt).__name__}: {prompt!r:.80}")
        text = self.tokenizer.apply_chat_template(messages, tools=list(self.config.tools) or None,  # type: ignore[arg-type]
                                                  add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _lookup(row: Row, key: str, *, where: str, config_key: str) -> Any:
    """``row[key]`` where ``key`` may be a dotted path; errors name the file, row, key and config key."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value or value[part] is None:
            keys = sorted(value) if isinstance(value, dict) else []
            raise DataError(f"{where}: missing key {key!r} ({config_key}); the row has keys {keys}")
        value = value[part]
    return value


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ) and bool(value)
