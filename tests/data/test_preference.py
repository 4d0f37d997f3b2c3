"""Preference pairs: ``hybridrl prepare preference``, ``PreferenceDataset``, the arithmetic pairs."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from hybridrl.cli import main as cli_main
from hybridrl.data.preference import (
    PreferenceDataset,
    PreferenceDatasetConfig,
    arithmetic_preference_rows,
    wrong_answer,
)
from hybridrl.data.prepare import PrepareConfig, prepare
from hybridrl.data.rows import Row, read_rows, write_rows
from hybridrl.models.char_tokenizer import make_char_tokenizer

SOURCE = [
    {"prompt": "1+2=", "chosen": "3", "rejected": "4", "id": 7},  # plain strings, an extra column
    {"prompt": [{"role": "user", "content": "2+2="}],  # TRL's conversational layout
     "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}], "id": 8},
    {"prompt": "3+3=",  # UltraFeedback-binarized: the prompt's turn repeated before the reply
     "chosen": [{"role": "user", "content": "3+3="}, {"role": "assistant", "content": "6"}],
     "rejected": [{"role": "user", "content": "3+3="}, {"role": "assistant", "content": "9"}], "id": 9},
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return make_char_tokenizer(model_max_length=4096)


def _rows(path: Path) -> list[Row]:
    return [r for _, r in read_rows(path)]


def test_prepare_preference_writes_the_pair_layout(tmp_path: Path) -> None:
    src = write_rows(SOURCE, tmp_path / "pairs.jsonl")
    test = write_rows(SOURCE[:1], tmp_path / "held_out.jsonl")
    rc = cli_main(["prepare", "preference", str(tmp_path / "out"), "--from", str(src), "--from", f"test={test}"])
    assert rc == 0
    train = _rows(tmp_path / "out" / "train.parquet")
    assert [(r["prompt"], r["chosen"], r["rejected"], r["id"]) for r in train] == [
        ([{"role": "user", "content": "1+2="}], "3", "4", 7),
        ([{"role": "user", "content": "2+2="}], "4", "5", 8),
        ([{"role": "user", "content": "3+3="}], "6", "9", 9),
    ]
    assert {r["data_source"] for r in train} == {"preference"} and "ground_truth" not in train[0]
    assert len(_rows(tmp_path / "out" / "test.parquet")) == 1


def test_prepare_preference_text_prompts_and_template(tmp_path: Path) -> None:
    src = write_rows(SOURCE[:1] + SOURCE[2:], tmp_path / "pairs.jsonl")
    splits = prepare(tmp_path / "out", PrepareConfig(task="preference", sources={"train": [str(src)]}, test_size=1,
                                                     prompt_format="text", template="Q: {question}"))
    assert sorted(r["prompt"] for rows in splits.values() for r in rows) == ["Q: 1+2=", "Q: 3+3="]


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "1+2=", "chosen": "3"}, r"row 1: 'rejected' must be a non-empty string or a list of chat messages "
                                        r"ending with the assistant's reply, got missing"),
    ({"prompt": "1+2=", "chosen": "", "rejected": "4"}, r"row 1: 'chosen' must be a non-empty string"),
    ({"chosen": "3", "rejected": "4"}, r"row 1: no prompt: 'prompt' \(--question-key\)"),
    ({"prompt": "1+2=", "chosen": [{"role": "user", "content": "9+9="}, {"role": "assistant", "content": "3"}],
      "rejected": "4"}, r"row 1: 'chosen' has turns before its last assistant message that are not the prompt's"),
    ({"prompt": "1+2=", "chosen": [{"role": "user", "content": "3"}], "rejected": "4"},
     r"row 1: 'chosen' must be a non-empty string or a list of chat messages ending with the assistant's reply"),
])
def test_a_bad_row_is_an_error_naming_file_and_row(tmp_path: Path, row: Row, message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    src = write_rows([SOURCE[0], row], tmp_path / "pairs.jsonl")
    rc = cli_main(["prepare", "preference", str(tmp_path / "out"), "--from", str(src), "--test-size", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{src} row 1" in err
    assert re.search(message, err), err
    assert not (tmp_path / "out" / "train.parquet").exists()


def test_dataset_reads_prepared_pairs(tmp_path: Path, tok: PreTrainedTokenizerBase) -> None:
    path = write_rows([{"prompt": "1+2=", "chosen": "3", "rejected": "4", "note": "x"}], tmp_path / "pairs.parquet")
    ds = PreferenceDataset([path], tokenizer=tok, config=PreferenceDatasetConfig(apply_chat_template=False))
    item = ds[0]
    assert tok.decode(item.prompt_ids) == "1+2="
    assert item.meta.ground_truth == "3" and item.meta.extra["rejected"] == "4" and item.meta.extra["note"] == "x"
    other = write_rows([{"q": "12+34=", "good": "46", "bad": "47"}], tmp_path / "renamed.jsonl")
    ds = PreferenceDataset([other], tokenizer=tok, config=PreferenceDatasetConfig(
        prompt_key="q", chosen_key="good", rejected_key="bad", apply_chat_template=False))
    assert ds[0].meta.ground_truth == "46" and ds[0].meta.extra["bad"] == "47"


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "1+2=", "chosen": "3"}, r"row 1: 'rejected' \(data.rejected_key\) must be a non-empty string, "
                                        r"got missing; the row has keys \['chosen', 'prompt'\]"),
    ({"prompt": "1+2=", "chosen": [{"role": "assistant", "content": "3"}], "rejected": "4"},
     r"row 1: 'chosen' \(data.chosen_key\) must be a non-empty string, got list .*hybridrl prepare preference"),
    ({"chosen": "3", "rejected": "4"}, r"row 1: missing key 'prompt' \(data.prompt_key\)"),
])
def test_dataset_bad_row_names_file_row_and_key(tmp_path: Path, tok: PreTrainedTokenizerBase, row: Row,
                                               message: str) -> None:
    path = write_rows([{"prompt": "1+2=", "chosen": "3", "rejected": "4"}, row], tmp_path / "pairs.jsonl")
    with pytest.raises(ValueError, match=message) as e:
        PreferenceDataset([path], tokenizer=tok, config=PreferenceDatasetConfig(apply_chat_template=False))
    assert f"{path} row 1" in str(e.value)


def test_wrong_answers_are_wrong_and_plausible() -> None:
    rng = random.Random(0)
    for n in range(0, 199):
        wrong = wrong_answer(str(n), rng)
        assert wrong != str(n) and int(wrong) >= 0 and abs(len(wrong) - len(str(n))) <= 1, (n, wrong)


def test_arithmetic_pairs_keep_prompt_answer_and_columns() -> None:
    rows = [{"prompt": "12+34=", "ground_truth": "46", "data_source": "arithmetic"}] * 3
    pairs = arithmetic_preference_rows(rows, seed=0)
    assert all(p["prompt"] == "12+34=" and p["chosen"] == "46" and p["rejected"] != "46" for p in pairs)
    assert all(p["ground_truth"] == "46" and p["data_source"] == "arithmetic" for p in pairs)
    assert pairs == arithmetic_preference_rows(rows, seed=0)  # seeded
