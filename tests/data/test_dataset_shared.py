"""Start-up that scales: every row tokenized once per run (shared by the ranks), the length filter exact.

The reference in each test is what the dataset did before (every rank reading and tokenizing every row in
file order, keeping a prompt iff it has ≤ ``max_prompt_length`` tokens), computed here independently.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from hybridrl.data import dataset as dataset_module
from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
from hybridrl.data.rows import Row, write_rows
from hybridrl.models.char_tokenizer import make_char_tokenizer

WORKER = str(Path(__file__).with_name("shared_dataset_worker.py"))
MAX = 30  # the worker's data.max_prompt_length


def reference(tok: PreTrainedTokenizerBase, files: list[tuple[str, list[Row]]], max_len: int) -> list[tuple]:
    kept = []
    for stem, rows in files:
        for row in rows:
            text = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                           tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= max_len:
                extra = {k: v for k, v in row.items() if k not in ("prompt", "ground_truth", "data_source")}
                kept.append((ids, str(row["ground_truth"]), row.get("data_source") or stem, extra))
    return kept


def three_files(tmp: Path, *, bad_row: int | None = None) -> tuple[list[str], list[tuple[str, list[Row]]]]:
    """Three files (parquet, jsonl, parquet) of prompts whose lengths straddle MAX; ``bad_row`` of the last
    file loses its ground truth."""
    tok = make_char_tokenizer(model_max_length=512)
    empty = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False)
    overhead = len(tok(empty, add_special_tokens=False)["input_ids"])
    parts: list[tuple[str, list[Row]]] = []
    for f, n in (("a", 7), ("b", 5), ("c", 9)):
        rows: list[Row] = [{"prompt": "x" * (MAX - overhead - 2 + (i % 5)), "ground_truth": i, "id": f"{f}{i}"}
                           for i in range(n)]  # lengths MAX-2 .. MAX+2: the boundary on both sides
        if f == "b":
            rows[1]["data_source"] = "hand"
        parts.append((f, rows))
    if bad_row is not None:
        del parts[2][1][bad_row]["ground_truth"]
    paths = [str(write_rows(rows, tmp / f"{f}.{'jsonl' if f == 'b' else 'parquet'}")) for f, rows in parts]
    return paths, parts


@pytest.mark.parametrize("chunk", [2, 4096])
def test_filter_is_exact_and_counted(tmp_path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataset_module, "CHUNK", chunk)  # rows read in chunks that cross file boundaries
    tok = make_char_tokenizer(model_max_length=512)
    paths, parts = three_files(tmp_path)
    ds = PromptDataset(paths, config=PromptDatasetConfig(max_prompt_length=MAX), tokenizer=tok)
    want = reference(tok, parts, MAX)
    got = [(ds[i].prompt_ids, ds[i].meta.ground_truth, ds[i].meta.data_source, dict(ds[i].meta.extra))
           for i in range(len(ds))]
    assert got == want
    assert {len(ids) for ids, *_ in got} == {MAX - 2, MAX - 1, MAX}  # the boundary itself is kept
    assert ds.filter_metrics == {"data/prompts_total": 21.0, "data/prompts_kept": float(len(want)),
                                 "data/prompts_dropped": float(21 - len(want))}
    assert ds[-1] == ds[len(ds) - 1] and ds.items == [ds[i] for i in range(len(ds))]
    with pytest.raises(IndexError):
        ds[len(ds)]


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, 3])
def test_ranks_share_the_tokenization_and_hold_the_same_prompts(torchrun, tmp_path: Path, nproc: int) -> None:
    paths, parts = three_files(tmp_path)
    torchrun([WORKER, str(tmp_path), *paths], nproc=nproc)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    want = reference(make_char_tokenizer(model_max_length=512), parts, MAX)
    for res in results:
        assert [(ids, gt, src, extra) for ids, (gt, src, extra) in zip(res["ids"], res["meta"], strict=True)] == want
        assert res["metrics"]["data/prompts_kept"] == len(want)
    counts = [res["tokenized"] for res in results]
    assert sum(counts) == 21 and max(counts) - min(counts) <= 1  # each row once, split evenly


@pytest.mark.distributed
def test_a_bad_row_in_one_ranks_share_fails_every_rank(torchrun, tmp_path: Path) -> None:
    paths, _ = three_files(tmp_path, bad_row=7)  # global row 19 of 21: rank 1's share
    torchrun([WORKER, str(tmp_path), *paths], nproc=2)
    for r in range(2):
        error = json.loads((tmp_path / f"rank{r}.json").read_text())["error"]
        assert error.startswith(f"{paths[2]} row 7: missing key 'ground_truth' (data.ground_truth_key)"), error
