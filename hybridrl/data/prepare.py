"""``hybridrl prepare gsm8k|math|jsonl|multimodal|preference OUT_DIR``: a task's data → ``OUT_DIR/{train,test}.parquet``
(the ``multimodal`` task's rows also carry their images).

``preference`` writes DPO pairs instead (``prompt``, ``chosen``, ``rejected``, ``data_source``, the other
columns; see :mod:`hybridrl.data.preference`); the rest of this docstring is about the prompt tasks.

Each output row is what :class:`hybridrl.data.dataset.PromptDataset` reads by default:

- ``prompt``: ``[{"role": "user", "content": TEXT}]`` (``--prompt-format chat``, default) or ``TEXT``
  (``text``), where TEXT is the question put into the instruction template (verl's defaults below;
  ``--no-template``: the question as is);
- ``ground_truth``: the final answer as a string (GSM8K: after ``####``; MATH: the given ``answer``
  column (MATH-500) or else the last ``\\boxed{}`` of the solution; jsonl: the answer column as is);
- ``images`` (``multimodal``: a geo3k-style source whose question holds one ``<image>`` per image): the row's
  ``--images-key`` column (paths, relative ones from the source file's directory, or ``{"bytes"}``/``{"path"}``
  entries) as verl's parquet holds images, ``[{"bytes": the file's bytes, "path": its path}]``, each checked to
  open (:mod:`hybridrl.data.images`);
- ``data_source``: ``gsm8k``, ``math``, or ``--data-source`` (jsonl, multimodal; default: the first source's stem);
- every other column of the source row, unchanged (GSM8K's ``question`` and full ``answer`` solution,
  MATH's ``problem``, ``level``, ``type``, ``solution``); they reach the reward as ``SampleMeta.extra``.

Sources: ``--from [train=|test=]SOURCE`` (repeatable; a bare SOURCE is train data), where SOURCE is
anything ``data.train_files`` accepts: a ``.jsonl``/``.parquet`` file in the dataset's own format or
``hf://NAME[:CONFIG][:SPLIT]``. Without a test source, ``--test-size N|FRACTION`` splits the train rows
(seeded by ``--seed``; both splits keep the source order). Without any ``--from``, the task's public
dataset is loaded through ``datasets`` (``--hf-name``/``--hf-config``; its ``train`` and ``test`` splits).

A row without a question is an error naming the source and row; so is a row whose final answer
cannot be extracted, unless ``--skip-bad`` (then such rows are skipped and counted in a warning).
OUT_DIR must be new or empty unless ``--overwrite`` (which replaces train.parquet and test.parquet
and leaves its other files alone); each file is written to a temporary name and renamed into place.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from hybridrl.data.answers import gsm8k_answer, last_boxed
from hybridrl.data.rows import Row, write_rows
from hybridrl.data.sources import HFSource, is_hf, read_source, source_problem, source_stem

SPLITS = ("train", "test")
LAYOUT = ("prompt", "ground_truth", "data_source")  # the columns this module writes; the rest are the source's
DEFAULT_TEMPLATE = "default"  # PrepareConfig.template: the task's own template
PromptFormat = Literal["chat", "text"]


def _raw_answer(row: Row, key: str) -> str | None:
    text = str(row[key]).strip()
    return text or None


def _math_answer(row: Row, key: str) -> str | None:
    given = row.get("answer")  # MATH-500 gives the answer; Hendrycks MATH only the solution
    if given is not None and str(given).strip():
        return str(given).strip()
    return last_boxed(str(row[key]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    name: str  # the rows' data_source
    question_key: str
    answer_key: str
    answer_rule: str  # where the final answer is, for error messages
    ground_truth: Callable[[Row, str], str | None]  # (row, answer_key) -> answer, None when there is none
    template: str | None  # verl's instruction; None: the raw question
    hf_name: str | None  # the public dataset (online mode)
    hf_config: str | None = None
    # a whole-row conversion instead of question/answer extraction (preference pairs); None: the latter
    convert: Callable[..., Row] | None = None
    images: bool = False  # the rows carry images (PrepareConfig.images_key), embedded as verl's parquet holds them


def _preference_row(row: Row, **kwargs: str | None) -> Row:
    from hybridrl.data.preference import preference_row  # imports transformers: only for this task

    return preference_row(row, **kwargs)  # type: ignore[arg-type]


TASKS: dict[str, Task] = {t.name: t for t in (
    Task(name="gsm8k", question_key="question", answer_key="answer", answer_rule="a GSM8K solution ends with '#### N'",
         ground_truth=lambda row, key: gsm8k_answer(str(row[key])),
         template='{question} Let\'s think step by step and output the final answer after "####".',
         hf_name="openai/gsm8k", hf_config="main"),
    Task(name="math", question_key="problem", answer_key="solution",
         answer_rule="a MATH solution has a \\boxed{...} answer (or the row an 'answer' column)",
         ground_truth=_math_answer,
         template="{question} Let's think step by step and output the final answer within \\boxed{}.",
         hf_name="DigitalLearningGmbH/MATH-lighteval"),
    Task(name="jsonl", question_key="question", answer_key="answer", answer_rule="a non-empty answer column",
         ground_truth=_raw_answer, template=None, hf_name=None),
    Task(name="multimodal", question_key="problem", answer_key="answer", answer_rule="a non-empty answer column",
         ground_truth=_raw_answer, template=None, hf_name=None, images=True),
    Task(name="preference", question_key="prompt", answer_key="chosen",
         answer_rule="non-empty 'chosen' and 'rejected' responses", ground_truth=_raw_answer, template=None,
         hf_name=None, convert=_preference_row),
)}


@dataclass(slots=True, kw_only=True)
class PrepareConfig:
    task: str  # a key of TASKS
    sources: dict[str, list[str]] = field(default_factory=dict)  # split -> files / hf:// names; {}: the HF dataset
    test_size: float | None = None  # split the train rows: N rows (>= 1) or a fraction in (0, 1)
    seed: int = 0  # of the --test-size split
    template: str | None = DEFAULT_TEMPLATE  # must hold {question}; DEFAULT_TEMPLATE: the task's; None: raw question
    prompt_format: PromptFormat = "chat"
    question_key: str | None = None  # None: the task's
    answer_key: str | None = None  # None: the task's
    data_source: str | None = None  # None: the task's name (jsonl, multimodal: the first source's stem)
    images_key: str = "images"  # multimodal: the source column holding a row's images
    hf_name: str | None = None  # None: the task's public dataset
    hf_config: str | None = None
    skip_bad: bool = False  # skip rows without a final answer (counted) instead of failing
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r} is unknown; valid: {', '.join(TASKS)}")
        if self.template is not None and self.template != DEFAULT_TEMPLATE and "{question}" not in self.template:
            raise ValueError(f"--template {self.template!r} must contain the placeholder {{question}}")
        if self.prompt_format not in ("chat", "text"):
            raise ValueError(f"--prompt-format {self.prompt_format!r}; valid: chat, text")
        if bad := [s for s in self.sources if s not in SPLITS]:
            raise ValueError(f"--from {bad[0]}=...: unknown split; valid: {', '.join(SPLITS)} (or no prefix: train)")
        if self.test_size is not None:
            if not self.sources or self.sources.get("test"):
                raise ValueError("--test-size splits the train rows of --from SOURCE; it cannot be used with "
                                 "--from test=... or without --from (the HF dataset's test split is used)")
            if not (0 < self.test_size < 1 or (self.test_size >= 1 and float(self.test_size).is_integer())):
                raise ValueError(f"--test-size {self.test_size}: give a row count (>= 1) or a fraction in (0, 1)")
        elif self.sources and not self.sources.get("test"):
            raise ValueError("no test data: add --from test=SOURCE, or --test-size N|FRACTION to split the train rows")
        if self.sources and not self.sources.get("train"):
            raise ValueError("no train data: add --from train=SOURCE (a bare --from SOURCE is train data)")
        if not self.sources and self.hf_name is None and TASKS[self.task].hf_name is None:
            raise ValueError(f"task {self.task!r} has no public dataset: give --from SOURCE (files or hf://NAME)")

    def resolved_sources(self) -> dict[str, list[str]]:
        if self.sources:
            return {split: list(self.sources.get(split, [])) for split in SPLITS}
        task = TASKS[self.task]
        name = self.hf_name or task.hf_name
        config = self.hf_config if self.hf_name else (self.hf_config or task.hf_config)
        assert name is not None  # __post_init__
        return {split: [str(HFSource(name=name, config=config, split=split))] for split in SPLITS}


def prepare(out_dir: str | os.PathLike[str], config: PrepareConfig) -> dict[str, list[Row]]:
    """Write ``out_dir/{train,test}.parquet``; return the rows of each split."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"OUT_DIR {out} is a file; choose a directory")
    if out.is_dir() and any(out.iterdir()) and not config.overwrite:
        held = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise FileExistsError(f"OUT_DIR {out} is not empty ({held}); choose a new directory or pass --overwrite "
                              "(replaces train.parquet and test.parquet, leaves other files)")
    sources = config.resolved_sources()
    option = "--from " if config.sources else ""
    for src in (s for split in SPLITS for s in sources[split]):  # every source, before reading any
        if (problem := source_problem(src)) is not None:
            raise ValueError(f"{option}{src}: {problem}")
        if not is_hf(src) and not Path(src).is_file():
            raise FileNotFoundError(f"{option}{src}: file does not exist")
    task = TASKS[config.task]
    data_source = config.data_source or (source_stem(sources["train"][0]) if task.name in ("jsonl", "multimodal")
                                         else task.name)
    splits = {split: [row for src in sources[split] for row in _convert_source(src, split, task, data_source, config)]
              for split in SPLITS}
    if config.test_size is not None:
        splits["train"], splits["test"] = _split_off(splits["train"], config.test_size, seed=config.seed)
    for split, rows in splits.items():
        if not rows:
            raise ValueError(f"no {split} rows in {sources[split] or sources['train']}")
    _write_atomically(out, splits)
    return splits


def _convert_source(src: str, split: str, task: Task, data_source: str, config: PrepareConfig) -> Iterable[Row]:
    question_key = config.question_key or task.question_key
    answer_key = config.answer_key or task.answer_key
    template = task.template if config.template == DEFAULT_TEMPLATE else config.template
    skipped: list[int] = []
    total = 0
    for row_no, row in tqdm(read_source(src), desc=f"{split}: {src}", unit=" rows", mininterval=2.0, file=sys.stderr):
        total += 1
        where = f"{src} row {row_no}"
        if task.convert is not None:
            yield task.convert(row, where=where, prompt_key=question_key, template=template,
                               prompt_format=config.prompt_format, data_source=data_source)
            continue
        question = row.get(question_key)
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: no question: {question_key!r} (--question-key) is missing or empty; "
                             f"the row has keys {sorted(row)}")
        if row.get(answer_key) is None:
            raise ValueError(f"{where}: no answer column {answer_key!r} (--answer-key); the row has keys {sorted(row)}")
        ground_truth = task.ground_truth(row, answer_key)
        if ground_truth is None:
            if not config.skip_bad:
                raise ValueError(f"{where}: no final answer in {answer_key!r} ({task.answer_rule}): "
                                 f"{str(row[answer_key])[-80:]!r}; fix the row or pass --skip-bad to skip such rows")
            skipped.append(row_no)
            continue
        text = template.replace("{question}", question) if template is not None else question
        prompt = [{"role": "user", "content": text}] if config.prompt_format == "chat" else text
        images = _images(row, text, src=src, where=where, key=config.images_key) if task.images else {}
        yield {"prompt": prompt, "ground_truth": ground_truth, "data_source": data_source, **images,
               **{k: v for k, v in row.items() if k not in LAYOUT and not (task.images and k == config.images_key)}}
    if skipped:
        print(f"warning: skipped {len(skipped)} of {total} rows of {src} without a final answer ({task.answer_rule}); "
              f"rows {', '.join(map(str, skipped[:10]))}{', ...' if len(skipped) > 10 else ''}", file=sys.stderr)


def _images(row: Row, text: str, *, src: str, where: str, key: str) -> Row:
    """``{"images": [...]}``: the row's images embedded (module docstring); their number is the question's
    ``<image>`` placeholders'."""
    from hybridrl.data.images import IMAGE_PLACEHOLDER, embed_images  # PIL: only for this task

    images = embed_images(row.get(key), base_dir=None if is_hf(src) else Path(src).parent, where=where,
                          image_key=key)
    if (n := text.count(IMAGE_PLACEHOLDER)) != len(images):
        raise ValueError(f"{where}: the question has {n} {IMAGE_PLACEHOLDER} placeholders but {key!r} (--images-key) "
                         f"holds {len(images)} images; put one {IMAGE_PLACEHOLDER} in the question where each image "
                         "goes")
    return {"images": images}


def _split_off(rows: list[Row], test_size: float, *, seed: int) -> tuple[list[Row], list[Row]]:
    """``(train, test)``: ``test_size`` rows (or that fraction) drawn with ``seed``; both keep ``rows``' order."""
    n_test = int(test_size) if test_size >= 1 else round(len(rows) * test_size)
    if not 1 <= n_test < len(rows):
        raise ValueError(f"--test-size {test_size} takes {n_test} of {len(rows)} rows; both splits need at least one")
    test = set(random.Random(seed).sample(range(len(rows)), n_test))
    return [r for i, r in enumerate(rows) if i not in test], [r for i, r in enumerate(rows) if i in test]


def _write_atomically(out: Path, splits: Mapping[str, Sequence[Row]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmps = {split: out / f".{split}.tmp-{os.getpid()}.parquet" for split in splits}
    try:
        for split, rows in splits.items():
            write_rows(_same_columns(rows), tmps[split])
        for split, tmp in tmps.items():
            tmp.replace(out / f"{split}.parquet")
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)


def _same_columns(rows: Sequence[Row]) -> list[Row]:
    """Rows of sources with different columns, each with every column (None where absent): parquet
    infers its columns from the first row."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k) for k in columns} for r in rows]


def _parse_sources(values: Sequence[str]) -> dict[str, list[str]]:
    sources: dict[str, list[str]] = {}
    for value in values:
        split, sep, src = value.partition("=")
        if not sep or is_hf(value) or ("/" in split or "." in split):  # a path that holds "="
            split, src = "train", value
        sources.setdefault(split, []).append(src)
    return sources


def main(args: argparse.Namespace) -> int:
    """``hybridrl prepare TASK OUT_DIR ...`` (arguments defined in :mod:`hybridrl.cli`)."""
    try:
        config = PrepareConfig(
            task=args.task, sources=_parse_sources(args.sources or []),
            test_size=_test_size(args.test_size), seed=args.seed,
            template=None if args.no_template else (args.template or DEFAULT_TEMPLATE),
            prompt_format=args.prompt_format, question_key=args.question_key, answer_key=args.answer_key,
            data_source=args.data_source, images_key=args.images_key, hf_name=args.hf_name,
            hf_config=args.hf_config, skip_bad=args.skip_bad, overwrite=args.overwrite,
        )
        splits = prepare(args.out_dir, config)
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        print(f"hybridrl prepare: {e}", file=sys.stderr)
        return 2
    for split, rows in splits.items():
        print(f"{split}: {len(rows):,} rows -> {Path(args.out_dir) / f'{split}.parquet'}")
    first = splits["train"][0]
    prompt = first["prompt"]
    text = prompt if isinstance(prompt, str) else "\n".join(f"[{m['role']}] {m['content']}" for m in prompt)
    answer = (f"its ground truth: {first['ground_truth']}" if "ground_truth" in first and "chosen" not in first
              else f"chosen: {first['chosen']!r}, rejected: {first['rejected']!r}")
    print(f"first train prompt:\n{text}\n{answer}")
    return 0


def _test_size(value: str | None) -> float | None:
    try:
        return None if value is None else float(value)
    except ValueError:
        raise ValueError(f"--test-size {value!r}: give a row count (>= 1) or a fraction in (0, 1)") from None
