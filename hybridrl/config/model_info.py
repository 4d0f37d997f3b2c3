"""What static validation needs to know about an HF checkpoint, read from files only (no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_config_json(cls, path: Path) -> ModelInfo:
        raw = json.loads(path.read_text())
        heads = int(raw["num_attention_heads"])
        return cls(
            model_type=str(raw.get("model_type", "?")),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            hidden_size=int(raw["hidden_size"]),
            vocab_size=int(raw["vocab_size"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )


def inspect_model_dir(path: str, *, tokenizer_path: str | None = None) -> tuple[ModelInfo | None, list[str]]:
    """Return the model's info (None when unreadable) and every problem found with the directory."""
    d = Path(path)
    if not d.is_dir():
        return None, [f"directory {d} does not exist (an HF checkpoint: config.json + *.safetensors + tokenizer)"]
    problems: list[str] = []
    info: ModelInfo | None = None
    cfg = d / "config.json"
    if not cfg.is_file():
        problems.append(f"{cfg} is missing")
    else:
        try:
            info = ModelInfo.from_config_json(cfg)
        except (KeyError, ValueError, TypeError) as e:
            problems.append(f"{cfg} is not a usable HF config ({type(e).__name__}: {e})")
        else:
            if info.model_type not in SUPPORTED_MODEL_TYPES:
                problems.append(
                    f"{cfg}: model_type {info.model_type!r} is not supported; supported: "
                    f"{', '.join(SUPPORTED_MODEL_TYPES)}"
                )
    if not (d / "model.safetensors").is_file() and not (d / "model.safetensors.index.json").is_file():
        has_bin = any(d.glob("*.bin"))
        problems.append(
            f"{d} holds no model.safetensors or model.safetensors.index.json"
            + (" (only *.bin weights: hybridrl reads safetensors; re-save with safe_serialization=True)"
               if has_bin else "")
        )
    tok = Path(tokenizer_path) if tokenizer_path else d
    if not any((tok / f).is_file() for f in _TOKENIZER_FILES):
        problems.append(f"{tok} holds no tokenizer (one of {', '.join(_TOKENIZER_FILES)})")
    return info, problems
