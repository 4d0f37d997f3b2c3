"""The fault suite's tiny model, task and uninterrupted reference run (one per worker that needs them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from faults.runs import run_to_end, train_args

from hybridrl.bootstrap import write_arithmetic_task
from hybridrl.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("faults")
    make_tiny_model(tmp / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    write_arithmetic_task(tmp / "train.parquet")
    return tmp


@pytest.fixture(scope="session")
def reference(tiny: Path) -> Path:
    """The uninterrupted 6-step 2-rank run, never checkpointing (trainer.save_freq's default): checkpoints take
    nothing from the RNG streams, so any interrupted-and-resumed run must log exactly its metrics."""
    out = tiny / "reference"
    run_to_end(train_args(tiny, out))
    return out
