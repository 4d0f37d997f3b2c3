"""W2 of ``vs_trl.py``: a ~4× wider tiny model whose response lengths have a long tail, and its task.

Model: a random Qwen2 (hidden 512, 8 layers, 8 heads / 4 KV groups, untied embeddings, the char
vocabulary of the tiny recipes: 100 ids). No SFT (it would cost tens of CPU-minutes at this width):
the **length distribution is forced by the stop ids**. A random model's next-token distribution is
near-uniform (logit std ≈ 0.02·√512 ≈ 0.45), and ``generation_config.json`` here lists three stop ids
(``<|im_end|>``, ``<|endoftext|>``, ``<|im_start|>``), so every step stops with probability ≈ 3/100 that
varies from context to context: lengths are roughly geometric with mean ≈ 33 — many responses of a
few tokens, a tail past 150, and now and then one cut at ``MAX_RESPONSE`` = 256.

Task: the arithmetic prompts of the tiny recipes; the reward is 1 when the response contains
``KEYWORD`` (the ``keyword`` reward manager, mode ``any``; TRL gets the same rule as a function), about
a quarter of the samples at these lengths, so GRPO groups have signal.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL = dict(arch="qwen2", hidden=512, layers=8, heads=8, kv_heads=4, max_positions=512, tie=False, seed=0)
STOP_IDS = [99, 97, 98]  # <|im_end|>, <|endoftext|>, <|im_start|> of the char tokenizer
MAX_RESPONSE = 256
KEYWORD = "7"
PROMPTS, N = 32, 8


def make_w2_model(out: Path) -> Path:
    """The W2 start model at ``out`` (kept if it is there)."""
    from hybridrl.models.tiny import make_tiny_model

    if not (out / "config.json").exists():
        make_tiny_model(out, **MODEL)  # type: ignore[arg-type]
        gen_path = out / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        gen["eos_token_id"] = STOP_IDS
        gen["pad_token_id"] = 97
        gen_path.write_text(json.dumps(gen, indent=2) + "\n")
    return out


def keyword_reward(completions: list[str], **_: object) -> list[float]:
    """TRL's side of the reward: the ``keyword`` manager's rule (mode any, case-insensitive)."""
    return [float(KEYWORD.lower() in c.lower()) for c in completions]
