"""One rank of tests/data/test_dataset_shared.py: build a PromptDataset under torch.distributed (gloo) and
write what it holds — or the error it raised — and how many rows this rank tokenized, to OUT/rank<r>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
from hybridrl.models.char_tokenizer import make_char_tokenizer


class CountingDataset(PromptDataset):
    """Counts the rows this rank checks and tokenizes (the subclass hook ``_item``, as PreferenceDataset uses)."""

    tokenized = 0

    def _item(self, where, stem, row):  # type: ignore[no-untyped-def]
        CountingDataset.tokenized += 1
        return super()._item(where, stem, row)


def main(out: Path, files: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        ds = CountingDataset(files, config=PromptDatasetConfig(max_prompt_length=30),
                             tokenizer=make_char_tokenizer(model_max_length=512))
        result = {"ids": [ds[i].prompt_ids for i in range(len(ds))],
                  "meta": [[ds[i].meta.ground_truth, ds[i].meta.data_source, dict(ds[i].meta.extra)]
                           for i in range(len(ds))], "metrics": ds.filter_metrics}
    except ValueError as e:
        result = {"error": str(e)}
    result["tokenized"] = CountingDataset.tokenized
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
