"""What the end-to-end tests share: the tiny model and task every run starts from, and the overrides that point
``launch/train.py`` at them (nothing bootstrapped); runs read back through their metrics.jsonl."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridrl.bootstrap import write_arithmetic_task
from hybridrl.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("e2e")
    model = make_tiny_model(tmp / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    train, test = tmp / "train.parquet", tmp / "test.parquet"
    write_arithmetic_task(train, test)
    return {"model": model, "train": train, "test": test, "tmp": tmp}


def base_overrides(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """grpo_tiny on the ``tiny`` model and data (nothing bootstrapped), writing to ``out``."""
    return ["recipe=grpo_tiny", f"actor_rollout_ref.model.path={tiny['model']}",
            "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{tiny['train']}]",
            f"data.val_files=[{tiny['test']}]", "data.build_if_missing=null", f"trainer.output_dir={out}", *extra]


def overrides(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return base_overrides(tiny, out, "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
                          "data.val_batch_size=64", "trainer.total_training_steps=3", "trainer.test_freq=3", *extra)


def chatty(model: Path, out: Path) -> Path:
    """A copy of the random tied-embedding ``model`` that ends its turns often (P(EOS) ≈ 0.1–0.2 a token): a common
    direction u in every token's embedding (so every hidden state leans along u), and more of it in EOS's row, whose
    logit (tied: the same row) then stands out."""
    shutil.copytree(model, out)
    state = load_file(out / "model.safetensors")
    emb = state["model.embed_tokens.weight"]
    u = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
    emb += 0.1 * u / u.norm()
    emb[json.loads((out / "config.json").read_text())["eos_token_id"]] += 1.0 * u / u.norm()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


# multi-turn episodes of up to 3 answers within 96 tokens (arithmetic_feedback), the calculator offered
MULTI_TURN = ("data.apply_chat_template=true", "data.max_prompt_length=32", "data.max_response_length=96",
              "actor_rollout_ref.rollout.multi_turn.enable=true",
              "actor_rollout_ref.rollout.multi_turn.tools=[calculator]",
              "actor_rollout_ref.rollout.multi_turn.environment=arithmetic_feedback",
              "+actor_rollout_ref.rollout.multi_turn.environment_kwargs.max_tries=3")


def read_metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
