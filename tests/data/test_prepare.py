"""``hybridrl prepare``: source rows → the project's row layout; answers, templates, splits, no clobbering,
row errors, and the prepared files through PromptDataset."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from data.fixtures import (
    GENERIC_ANSWERS,
    GSM8K_ANSWERS,
    GSM8K_ROWS,
    MATH500_ANSWERS,
    MATH_ANSWERS,
    MATH_ROWS,
    gsm8k_rows,
    offline_datasets,
    write_generic_source,
    write_gsm8k_source,
    write_hf_dataset,
    write_math500_source,
    write_math_source,
)
from transformers import PreTrainedTokenizerBase

from hybridrl.cli import main as cli_main
from hybridrl.data.answers import gsm8k_answer
from hybridrl.data.collate import collate_prompts
from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
from hybridrl.data.prepare import TASKS, PrepareConfig, prepare
from hybridrl.data.rows import Row, read_rows, write_rows
from hybridrl.models.char_tokenizer import make_char_tokenizer

GSM8K_TEMPLATE = TASKS["gsm8k"].template or ""


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return make_char_tokenizer(model_max_length=4096)


@pytest.fixture
def gsm8k(tmp_path: Path) -> dict[str, list[str]]:
    """GSM8K sources: the 12 hand-written rows (train, jsonl) and 5 synthetic ones (test, parquet)."""
    return {"train": [str(write_gsm8k_source(tmp_path / "src" / "train.jsonl"))],
            "test": [str(write_gsm8k_source(tmp_path / "src" / "test.parquet", n=5, seed=1))]}


def written(out: Path, split: str) -> list[Row]:
    return [row for _, row in read_rows(out / f"{split}.parquet")]


def test_fixture_gsm8k_rows_are_correct() -> None:
    """Every calculator annotation ``<<expr=value>>`` of the fixtures holds, and ``####`` repeats the last one."""
    rows = [*GSM8K_ROWS, *gsm8k_rows(300, seed=0)]
    assert gsm8k_rows(300, seed=0)[-1] == rows[-1] and gsm8k_rows(5, seed=1) != gsm8k_rows(5, seed=2)
    assert len({r["question"] for r in rows}) == len(rows)
    for row in rows:
        steps = re.findall(r"<<([^=>]+)=([^>]+)>>", row["answer"])
        assert steps and all(eval(expr) == float(value) for expr, value in steps), row
        assert float(gsm8k_answer(row["answer"]) or "nan") == float(steps[-1][1]), row
        assert all(c.isascii() and (c.isprintable() or c == "\n") for c in row["question"] + row["answer"])


def test_cli_end_to_end(tmp_path: Path, gsm8k: dict[str, list[str]]) -> None:
    out = tmp_path / "gsm8k"
    cmd = [sys.executable, "-m", "hybridrl.cli", "prepare", "gsm8k", str(out),
           "--from", f"train={gsm8k['train'][0]}", "--from", f"test={gsm8k['test'][0]}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert f"train: 12 rows -> {out / 'train.parquet'}" in r.stdout
    assert f"test: 5 rows -> {out / 'test.parquet'}" in r.stdout
    assert "first train prompt:\n[user] Maya buys 3 packs" in r.stdout and "\nits ground truth: 7\n" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["test.parquet", "train.parquet"]  # no temporary files left
    assert [row["ground_truth"] for row in written(out, "train")] == GSM8K_ANSWERS


def test_gsm8k_row_layout(tmp_path: Path, gsm8k: dict[str, list[str]]) -> None:
    splits = prepare(tmp_path / "out", PrepareConfig(task="gsm8k", sources=gsm8k))
    assert {k: len(v) for k, v in splits.items()} == {"train": 12, "test": 5}
    train = written(tmp_path / "out", "train")
    assert train == splits["train"]
    first = train[0]
    assert list(first) == ["prompt", "ground_truth", "data_source", "question", "answer"]
    assert first["prompt"] == [{"role": "user", "content": GSM8K_ROWS[0]["question"] + " Let's think step by step "
                                                           'and output the final answer after "####".'}]
    assert first["data_source"] == "gsm8k"
    assert first["answer"] == GSM8K_ROWS[0]["answer"]  # the full solution is kept
    assert [r["ground_truth"] for r in train] == GSM8K_ANSWERS
    test_rows = gsm8k_rows(5, seed=1)
    assert [r["ground_truth"] for r in written(tmp_path / "out", "test")] == [gsm8k_answer(r["answer"])
                                                                              for r in test_rows]


def test_math_and_math500_layouts(tmp_path: Path) -> None:
    train = str(write_math_source(tmp_path / "math.jsonl"))
    test = str(write_math500_source(tmp_path / "math500.parquet"))
    splits = prepare(tmp_path / "out", PrepareConfig(task="math", sources={"train": [train], "test": [test]}))
    assert [r["ground_truth"] for r in splits["train"]] == MATH_ANSWERS
    assert [r["ground_truth"] for r in splits["test"]] == MATH500_ANSWERS  # the answer column wins over \boxed
    row = written(tmp_path / "out", "train")[0]
    assert row["prompt"][0]["content"] == (MATH_ROWS[0]["problem"] + " Let's think step by step and output the final "
                                           "answer within \\boxed{}.")
    assert (row["data_source"], row["level"], row["type"]) == ("math", "Level 1", "Algebra")
    assert row["solution"] == MATH_ROWS[0]["solution"]
    row = written(tmp_path / "out", "test")[1]
    assert (row["subject"], row["level"], row["unique_id"]) == ("Prealgebra", 1, "test/prealgebra/2.json")


def test_generic_jsonl_keys_and_data_source(tmp_path: Path) -> None:
    src = str(write_generic_source(tmp_path / "times.jsonl", question_key="q", answer_key="a"))
    out = tmp_path / "out"
    splits = prepare(out, PrepareConfig(task="jsonl", sources={"train": [src]}, test_size=2, question_key="q",
                                        answer_key="a"))
    rows = splits["train"] + splits["test"]
    assert sorted(r["ground_truth"] for r in rows) == sorted(GENERIC_ANSWERS)  # int answers become strings
    assert {r["data_source"] for r in rows} == {"times"}  # default: the source's stem
    assert rows[0]["prompt"] == [{"role": "user", "content": rows[0]["q"]}]  # jsonl: no template by default
    assert {"q", "a", "id", "topic"} <= set(rows[0])
    named = prepare(tmp_path / "named", PrepareConfig(task="jsonl", sources={"train": [src]}, test_size=2,
                                                      question_key="q", answer_key="a", data_source="mult"))
    assert {r["data_source"] for r in named["train"]} == {"mult"}


def test_templates_and_prompt_formats(tmp_path: Path, gsm8k: dict[str, list[str]]) -> None:
    question = GSM8K_ROWS[0]["question"]

    def first_prompt(name: str, **kw: object) -> object:
        return prepare(tmp_path / name, PrepareConfig(task="gsm8k", sources=gsm8k, **kw))["train"][0]["prompt"]  # type: ignore[arg-type]

    assert first_prompt("raw", template=None) == [{"role": "user", "content": question}]
    assert first_prompt("text", prompt_format="text") == GSM8K_TEMPLATE.replace("{question}", question)
    assert first_prompt("custom", template="Q: {question}\nA: {}", prompt_format="text") == f"Q: {question}\nA: {{}}"
    with pytest.raises(ValueError, match=r"--template 'Solve it\.' must contain the placeholder \{question\}"):
        PrepareConfig(task="gsm8k", sources=gsm8k, template="Solve it.")


def test_test_size_split_is_seeded_and_keeps_order(tmp_path: Path) -> None:
    src = str(write_gsm8k_source(tmp_path / "all.jsonl", n=40, seed=3))

    def split(name: str, size: float, seed: int = 0) -> dict[str, list[Row]]:
        return prepare(tmp_path / name, PrepareConfig(task="gsm8k", sources={"train": [src]}, test_size=size,
                                                      seed=seed))

    a, b, c, frac = split("a", 10), split("b", 10), split("c", 10, seed=1), split("frac", 0.25)
    assert (len(a["train"]), len(a["test"])) == (30, 10) and (len(frac["train"]), len(frac["test"])) == (30, 10)
    assert a == b and a["test"] != c["test"]
    questions = [r["question"] for r in gsm8k_rows(40, seed=3)]
    for part in a.values():  # disjoint, complete, each in source order
        idx = [questions.index(r["question"]) for r in part]
        assert idx == sorted(idx)
    assert sorted(r["question"] for p in a.values() for r in p) == sorted(questions)
    with pytest.raises(ValueError, match="both splits need at least one"):
        split("all", 40)


def test_source_and_split_options_are_checked(gsm8k: dict[str, list[str]]) -> None:
    with pytest.raises(ValueError, match=r"no test data: add --from test=SOURCE, or --test-size"):
        PrepareConfig(task="gsm8k", sources={"train": gsm8k["train"]})
    with pytest.raises(ValueError, match="cannot be used with --from test="):
        PrepareConfig(task="gsm8k", sources=gsm8k, test_size=3)
    with pytest.raises(ValueError, match=r"--from dev=\.\.\.: unknown split; valid: train, test"):
        PrepareConfig(task="gsm8k", sources={"dev": gsm8k["train"], **gsm8k})
    with pytest.raises(ValueError, match="task 'jsonl' has no public dataset: give --from SOURCE"):
        PrepareConfig(task="jsonl")
    with pytest.raises(ValueError, match="task 'gsm9k' is unknown; valid: gsm8k, math, jsonl"):
        PrepareConfig(task="gsm9k")


def test_never_clobbers_without_overwrite(tmp_path: Path, gsm8k: dict[str, list[str]]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"out is not empty \(notes\.txt\); choose a new directory or pass "
                                              r"--overwrite"):
        prepare(out, PrepareConfig(task="gsm8k", sources=gsm8k))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    write_rows([{"stale": 1}], out / "train.parquet")
    prepare(out, PrepareConfig(task="gsm8k", sources=gsm8k, overwrite=True))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "test.parquet", "train.parquet"]
    assert len(written(out, "train")) == 12 and (out / "notes.txt").read_text() == "mine"


def test_bad_rows_name_source_and_row(tmp_path: Path, gsm8k: dict[str, list[str]],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    rows = [*GSM8K_ROWS[:3], {"question": "How many?", "answer": "It is 4 apples."}, *GSM8K_ROWS[3:5],
            {"question": "And now?", "answer": "5 more.\n####  "}]
    bad = str(write_rows(rows, tmp_path / "bad.jsonl"))
    sources = {"train": [bad], "test": gsm8k["test"]}
    message = (f"{bad} row 3: no final answer in 'answer' (a GSM8K solution ends with '#### N'): 'It is 4 apples.'; "
               "fix the row or pass --skip-bad")
    with pytest.raises(ValueError, match=re.escape(message)):
        prepare(tmp_path / "out", PrepareConfig(task="gsm8k", sources=sources))
    assert not (tmp_path / "out").exists()  # nothing written
    splits = prepare(tmp_path / "out", PrepareConfig(task="gsm8k", sources=sources, skip_bad=True))
    assert len(splits["train"]) == 5
    assert f"skipped 2 of 7 rows of {bad} without a final answer" in capsys.readouterr().err
    no_question = str(write_rows([{"problem": "What is 1+1?", "answer": "#### 2"}], tmp_path / "nq.jsonl"))
    with pytest.raises(ValueError, match=re.escape(f"{no_question} row 0: no question: 'question' (--question-key) is "
                                                   "missing or empty; the row has keys ['answer', 'problem']")):
        prepare(tmp_path / "nq", PrepareConfig(task="gsm8k", sources={"train": [no_question]}, test_size=0.5,
                                               skip_bad=True))
    math = str(write_rows([{"problem": "1+1?", "solution": "It is 2."}], tmp_path / "m.jsonl"))
    with pytest.raises(ValueError, match=re.escape(f"{math} row 0: no final answer in 'solution' (a MATH solution has "
                                                   "a \\boxed{...} answer")):
        prepare(tmp_path / "m", PrepareConfig(task="math", sources={"train": [math], "test": [math]}))


def test_prepared_files_flow_through_prompt_dataset(tmp_path: Path, gsm8k: dict[str, list[str]],
                                                    tok: PreTrainedTokenizerBase) -> None:
    prepare(tmp_path / "chat", PrepareConfig(task="gsm8k", sources=gsm8k))
    ds = PromptDataset([tmp_path / "chat" / "train.parquet"], config=PromptDatasetConfig(max_prompt_length=1024),
                       tokenizer=tok)
    assert len(ds) == 12
    text = GSM8K_TEMPLATE.replace("{question}", GSM8K_ROWS[0]["question"])
    assert tok.decode(ds[0].prompt_ids) == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    meta = ds[0].meta
    assert (meta.data_source, meta.ground_truth) == ("gsm8k", "7")
    assert meta.extra == {"question": GSM8K_ROWS[0]["question"], "answer": GSM8K_ROWS[0]["answer"]}
    batch = collate_prompts([ds[i] for i in range(3)], [0, 1, 2], pad_token_id=tok.pad_token_id)
    assert [m.data_source for m in batch.meta] == ["gsm8k"] * 3
    assert [m.ground_truth for m in batch.meta] == GSM8K_ANSWERS[:3]

    math = str(write_math_source(tmp_path / "math.parquet"))
    prepare(tmp_path / "text", PrepareConfig(task="math", sources={"train": [math]}, test_size=2, prompt_format="text",
                                             template=None))
    raw = PromptDataset([tmp_path / "text" / "train.parquet"],
                        config=PromptDatasetConfig(apply_chat_template=False, max_prompt_length=1024), tokenizer=tok)
    assert tok.decode(raw[0].prompt_ids) == MATH_ROWS[0]["problem"]
    assert (raw[0].meta.data_source, raw[0].meta.ground_truth) == ("math", MATH_ANSWERS[0])
    assert raw[0].meta.extra["level"] == "Level 1" and raw[0].meta.extra["type"] == "Algebra"


def test_hf_sources_and_the_online_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --from the task's dataset is loaded through ``datasets`` (here a local dataset directory);
    a hub name without network fails at once with a message saying what to do."""
    offline_datasets(monkeypatch, tmp_path / "hf-cache")
    local = write_hf_dataset(tmp_path / "gsm8k_hf", {"train": GSM8K_ROWS[:8], "test": GSM8K_ROWS[8:]})
    splits = prepare(tmp_path / "online", PrepareConfig(task="gsm8k", hf_name=str(local)))
    assert [len(v) for v in splits.values()] == [8, 4]
    assert [r["ground_truth"] for r in splits["test"]] == GSM8K_ANSWERS[8:]
    mixed = prepare(tmp_path / "mixed", PrepareConfig(task="gsm8k", sources={
        "train": [f"hf://{local}:train", f"hf://{local}:test"], "test": [f"hf://{local}:test[:2]"]}))
    assert [len(v) for v in mixed.values()] == [12, 2]
    with pytest.raises(RuntimeError, match=r"cannot load hf://openai/gsm8k:main:train from the HF hub \(no network\?"
                                           r".*point at a local file or dataset directory"):
        prepare(tmp_path / "hub", PrepareConfig(task="gsm8k"))
    assert not (tmp_path / "hub").exists()


def test_cli_errors_exit_2_with_one_line(tmp_path: Path, gsm8k: dict[str, list[str]],
                                         capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope.jsonl"
    assert cli_main(["prepare", "gsm8k", str(tmp_path / "o"), "--from", str(missing), "--test-size", "0.1"]) == 2
    assert capsys.readouterr().err.strip() == f"hybridrl prepare: --from {missing}: file does not exist"
    assert cli_main(["prepare", "gsm8k", str(tmp_path / "o"), "--from", gsm8k["train"][0], "--test-size", "x"]) == 2
    assert "--test-size 'x': give a row count (>= 1) or a fraction in (0, 1)" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if `datasets` were not installed
    assert cli_main(["prepare", "math", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "prepare: hf://DigitalLearningGmbH/MATH-lighteval:train: it needs the optional `datasets` package: " \
           "pip install 'hybridrl[data]'" in err
