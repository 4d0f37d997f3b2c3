"""The critic reads an HF token-classification checkpoint exactly: its values equal transformers' logits.

A one-label ``Qwen2ForTokenClassification`` (a reward-model-style start) shares a tiny causal LM's trunk and
gets a random ``score`` head (weight and bias); :class:`MegatronCritic` loads it at TP=1, TP=2 and PP=2, and
its value of response token t of each sample must be transformers' logit at the position that predicts it
(prompt + r_<t), as verl's critic reads them. Independent of the Megatron code: the reference is
transformers' own forward over each unpadded sequence.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2ForTokenClassification

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel" / "workers"))
from rl_step import fixed_batch  # noqa: E402

from hybridrl.models.tiny import make_tiny_model  # noqa: E402

WORKER = str(Path(__file__).parent / "workers" / "critic_values.py")


@pytest.fixture(scope="module")
def value_model(tmp_path_factory: pytest.TempPathFactory, discriminate) -> Path:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("critic_values")
    lm_dir = discriminate(make_tiny_model(tmp / "lm", arch="qwen2", hidden=64, layers=4, heads=4, kv_heads=2,
                                          max_positions=128, tie=True, seed=7), seed=7)
    lm = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    config = lm.config
    config.num_labels, config.architectures = 1, ["Qwen2ForTokenClassification"]
    rm = Qwen2ForTokenClassification(config)
    rm.model.load_state_dict(lm.model.state_dict())
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        rm.score.weight.copy_(torch.randn(rm.score.weight.shape, generator=g) * 0.3)
        rm.score.bias.fill_(0.25)
    out = tmp / "rm"
    rm.save_pretrained(out)
    return out


def hf_values(model_dir: Path) -> torch.Tensor:
    rm = Qwen2ForTokenClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = fixed_batch(rm.config.vocab_size, rm.config.pad_token_id)
    values = torch.zeros(batch.response_ids.shape)
    with torch.no_grad():
        for b in range(len(batch)):
            prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()]
            response = batch.response_ids[b][batch.response_mask[b].bool()]
            logits = rm(torch.cat([prompt, response])[None]).logits[0, :, 0]
            values[b, :len(response)] = logits[len(prompt) - 1:len(prompt) - 1 + len(response)]
    return values


@pytest.mark.distributed
def test_critic_values_equal_transformers_token_classification(torchrun, value_model: Path, tmp_path: Path) -> None:
    torchrun([WORKER, str(value_model), str(tmp_path), "tp1pp1cp1"], nproc=1)
    torchrun([WORKER, str(value_model), str(tmp_path), "tp2pp1cp1", "tp1pp2cp1"], nproc=2)
    ref = hf_values(value_model)
    assert float(ref.abs().max()) > 0.1  # the head reads something
    for layout in ("tp1pp1cp1", "tp2pp1cp1", "tp1pp2cp1"):
        diff = float((torch.load(tmp_path / f"{layout}.pt") - ref).abs().max())
        print(f"{layout}: max |V - transformers| = {diff:.1e}")
        assert diff < 2e-5, layout
