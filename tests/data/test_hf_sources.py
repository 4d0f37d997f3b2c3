"""``hf://`` entries in data.train_files / data.val_files: parsed, checked without network, read through
``datasets`` (a local dataset directory here), and named by index in config errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from data.fixtures import GSM8K_ANSWERS, GSM8K_ROWS, gsm8k_rows, offline_datasets, write_hf_dataset
from transformers import PreTrainedTokenizerBase

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate
from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
from hybridrl.data.prepare import PrepareConfig, prepare
from hybridrl.data.sources import HFSource, parse_hf, read_source, source_problem, source_stem
from hybridrl.models.char_tokenizer import make_char_tokenizer
from hybridrl.models.tiny import make_tiny_model

AOR = "actor_rollout_ref"


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_datasets(monkeypatch, tmp_path / "hf-cache")


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local dataset directory of prepared GSM8K rows: train (12 rows), test (4 rows)."""
    tmp = tmp_path_factory.mktemp("hf")
    train = [{"prompt": r["question"], "ground_truth": a, "level": i} for i, (r, a) in
             enumerate(zip(GSM8K_ROWS, GSM8K_ANSWERS, strict=True))]
    test = [{"prompt": r["question"], "ground_truth": r["answer"].rpartition("#### ")[2], "level": 0}
            for r in gsm8k_rows(4)]
    return write_hf_dataset(tmp / "gsm8k_local", {"train": train, "test": test})


@pytest.mark.parametrize(("source", "parsed"), [
    ("hf://openai/gsm8k", HFSource(name="openai/gsm8k")),
    ("hf://openai/gsm8k:test", HFSource(name="openai/gsm8k", split="test")),
    ("hf://openai/gsm8k:main:test[:50]", HFSource(name="openai/gsm8k", config="main", split="test[:50]")),
    ("hf:///data/x-y/gsm8k:validation", HFSource(name="/data/x-y/gsm8k", split="validation")),
])
def test_parse(source: str, parsed: HFSource) -> None:
    assert parse_hf(source) == parsed
    assert parse_hf(str(parsed)) == parsed  # str() spells the split out: hf://NAME[:CONFIG]:SPLIT


def test_rows_through_datasets_and_prompt_dataset(local: Path) -> None:
    rows = list(read_source(f"hf://{local}:test"))
    assert [n for n, _ in rows] == [0, 1, 2, 3] and set(rows[0][1]) == {"prompt", "ground_truth", "level"}
    assert source_stem(f"hf://{local}/:test") == "gsm8k_local"
    tok: PreTrainedTokenizerBase = make_char_tokenizer(model_max_length=1024)
    cfg = PromptDatasetConfig(apply_chat_template=False, max_prompt_length=1024)
    ds = PromptDataset([f"hf://{local}", f"hf://{local}:test[:2]"], config=cfg, tokenizer=tok)
    assert len(ds) == 14
    assert tok.decode(ds[0].prompt_ids) == GSM8K_ROWS[0]["question"]
    assert (ds[1].meta.ground_truth, ds[1].meta.data_source, ds[1].meta.extra) == ("1248", "gsm8k_local", {"level": 1})


def test_prepared_hf_rows_keep_their_data_source(tmp_path: Path, local: Path) -> None:
    out = tmp_path / "out"
    prepare(out, PrepareConfig(task="jsonl", sources={"train": [f"hf://{local}"], "test": [f"hf://{local}:test"]},
                               question_key="prompt", answer_key="ground_truth", data_source="arith"))
    again = write_hf_dataset(tmp_path / "prepared", {"train": [r for _, r in read_source(str(out / "train.parquet"))]})
    ds = PromptDataset([f"hf://{again}"], config=PromptDatasetConfig(max_prompt_length=1024),
                       tokenizer=make_char_tokenizer(model_max_length=1024))
    assert {it.meta.data_source for it in ds.items} == {"arith"}
    assert [it.meta.ground_truth for it in ds.items] == GSM8K_ANSWERS


def test_source_problems_without_network(tmp_path: Path, local: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for ok in ("hf://openai/gsm8k:main:train", "hf://gsm8k", f"hf://{local}:test", "a/b.parquet", "c.jsonl"):
        assert source_problem(ok) is None, ok  # no hub request: hub ids are only checked for their form
    bad = {
        "hf://": "is not hf://NAME[:CONFIG][:SPLIT]",
        "hf://openai/gsm8k:main:train:x": "is not hf://NAME[:CONFIG][:SPLIT]",
        f"hf://{tmp_path}/missing:train": "no local dataset directory",
        "hf://open ai/gsm8k": "is neither a hub id (owner/name) nor an existing directory",
        "data.csv": "unsupported file type '.csv'; valid: a .parquet or .jsonl file, or hf://NAME",
        "openai/gsm8k:train": "unsupported file type",  # no guessing: datasets need the hf:// prefix
    }
    for source, message in bad.items():
        assert message in (source_problem(source) or ""), source
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert "needs the optional `datasets` package: pip install 'hybridrl[data]'" in (source_problem("hf://x/y") or "")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    tmp = tmp_path_factory.mktemp("validate")
    model = make_tiny_model(tmp / "model", hidden=32, layers=2, heads=4, kv_heads=2, max_positions=512)
    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    return [f"{AOR}.model.path={model}", f"{AOR}.model.build_if_missing=null", "data.build_if_missing=null",
            f"data.train_files=[{data}]", f"{AOR}.rollout.n=4", "data.train_batch_size=8",
            f"{AOR}.actor.ppo_mini_batch_size=4", f"{AOR}.actor.ppo_micro_batch_size_per_gpu=4",
            "data.max_prompt_length=32", "data.max_response_length=16", f"trainer.output_dir={tmp / 'run'}"]


def data_issues(base: list[str], *overrides: str) -> list[str]:
    try:
        validate(compose_config([*base, *overrides]), world_size=1)
    except ConfigError as e:
        return [str(i) for i in e.issues if i.key.startswith("data.")]
    return []


def test_validation_accepts_hf_names_and_names_bad_entries_by_index(base: list[str], local: Path) -> None:
    assert data_issues(base, f"data.train_files=[hf://{local}:train,hf://openai/gsm8k:main:train]",
                       "data.val_files=['hf://openai/gsm8k:main:test[:100]']") == []
    found = data_issues(base, f"data.train_files=[hf://{local}:train,hf://./nope:test,gsm8k.csv]",
                        "data.val_files=[openai/gsm8k:test]")
    assert [f.split("=")[0] for f in found] == ["data.train_files[1]", "data.train_files[2]", "data.val_files[0]"]
    assert "no local dataset directory './nope'; valid: a .parquet or .jsonl file, or hf://NAME[:CONFIG][:SPLIT]" \
        in found[0]
    assert "unsupported file type '.csv'" in found[1] and "unsupported file type ''" in found[2]
    found = data_issues(base, "data.train_files=[hf://openai/gsm8k:main:train]", "data.build_if_missing=arithmetic")
    assert len(found) == 1 and found[0].startswith("data.train_files[0]='hf://openai/gsm8k:main:train': a HF "
                                                   "dataset is read, never built: set data.build_if_missing=null")
