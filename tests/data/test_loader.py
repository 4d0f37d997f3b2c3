"""collate_prompts and PromptLoader: left padding, metadata, per-rank batches, resume."""

from __future__ import annotations

from pathlib import Path

from hybridrl.batch import SampleMeta
from hybridrl.data.collate import collate_prompts
from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig, PromptItem
from hybridrl.data.loader import PromptLoader
from hybridrl.data.rows import write_rows
from hybridrl.data.sampler import SamplerConfig
from hybridrl.models.char_tokenizer import make_char_tokenizer


def test_collate_left_pads() -> None:
    items = [PromptItem(prompt_ids=[5, 6, 7], meta=SampleMeta(ground_truth="a")),
             PromptItem(prompt_ids=[8], meta=SampleMeta(ground_truth="b"))]
    batch = collate_prompts(items, [4, 9], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.index.tolist() == [4, 9] and len(batch) == 2
    assert batch.token_lists() == [[5, 6, 7], [8]]
    assert [m.ground_truth for m in batch.meta] == ["a", "b"]


def test_loader_gives_each_rank_its_share_and_resumes(tmp_path: Path) -> None:
    tok = make_char_tokenizer(model_max_length=64)
    rows = [{"prompt": f"{i}+{i}=", "ground_truth": str(2 * i)} for i in range(12)]
    f = write_rows(rows, tmp_path / "train.jsonl")
    ds = PromptDataset([f], config=PromptDatasetConfig(apply_chat_template=False), tokenizer=tok)
    cfg = SamplerConfig(train_batch_size=4, seed=2)
    loaders = [PromptLoader(ds, sampler=cfg, dp_rank=r, dp_size=2) for r in range(2)]
    first = [next(iter(ld)) for ld in loaders]
    assert all(len(b) == 2 for b in first)
    assert set(first[0].index.tolist()).isdisjoint(first[1].index.tolist())
    for b in first:
        for ids, meta in zip(b.token_lists(), b.meta, strict=True):
            a = tok.decode(ids).split("+")[0]
            assert meta.ground_truth == str(2 * int(a))
        assert (b.input_ids[b.attention_mask == 0] == tok.pad_token_id).all()

    resumed = PromptLoader(ds, sampler=cfg, dp_rank=0, dp_size=2)
    resumed.load_state_dict(loaders[0].state_dict())
    rest = [b.index.tolist() for b in loaders[0]]  # its epoch continues after the first batch
    assert [b.index.tolist() for b in resumed] == rest and len(rest) == len(loaders[0]) - 1
