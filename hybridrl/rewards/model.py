"""Reward manager ``model``: a reward model (an HF ``*ForSequenceClassification`` with one label) scores
each (prompt, response).

    score_i = score_scale · RM(x_i)[last non-pad token] + score_bias

``RM(x)`` is the checkpoint's one logit, pooled as transformers pools it: at the rightmost token that
is not the RM's ``pad_token_id`` (the call passes right-padded ids and the attention mask, so a
sample scores the same alone or in a micro-batch, up to float rounding). ``correct_B``: score >
``correct_threshold`` when it is set, else None (accuracy then counts score > 0). Per-sample info:
``truncated`` (the sample was longer than ``max_length`` RM tokens).

Text, not token ids, crosses from the policy to the RM, since their tokenizers may differ: the
policy tokenizer (ctx ``tokenizer``) decodes, the RM's own tokenizer (saved with the checkpoint)
re-tokenizes.
- ``apply_chat_template`` and an RM tokenizer with a chat template: the RM reads one user turn (the
  prompt) and one assistant turn (the response decoded without special tokens), in its own template.
- otherwise: the RM reads the decoded prompt + response, special tokens included, as is (with the
  policy's tokenizer this gives back the policy's own ids).

How it departs from verl's reward-model worker (which re-templates the dataset's raw chat messages):
the batch carries token ids only, so the user message is recovered from the decoded prompt by
stripping the policy template's text around a single user message (a prompt that was not made that
way — no template, a system turn, several turns — is passed whole, decoded without special tokens).
A response cut at ``max_response_length`` gets the RM template's end-of-turn like a finished one.
Over ``max_length``, the first tokens are dropped (the prompt's start; the response's too when it
alone is longer). The RM stays on the trainer's device (ctx ``device``) for the whole run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import RewardOutput
from hybridrl.rewards.response_text import decode, response_tokens

CONFIG_KEY = "reward.kwargs"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_MARKER = "hybridrl-user-message-8c1f"  # stands in for the user message when reading a chat template


class ModelReward:
    @dataclass(slots=True, kw_only=True)
    class Config:
        path: str  # HF checkpoint dir of the reward model (*ForSequenceClassification, num_labels=1) + its tokenizer
        micro_batch_size: int = 8  # samples per RM forward
        max_length: int | None = None  # RM tokens per sample, the first ones dropped; null: max_position_embeddings
        apply_chat_template: bool = True  # user + assistant turns in the RM's chat template (when it has one)
        dtype: Literal["float32", "bfloat16"] = "float32"  # of the RM's weights and forward
        score_scale: float = 1.0  # score = logit · score_scale + score_bias
        score_bias: float = 0.0
        correct_threshold: float | None = None  # correct_B = score > this; null: the reward has no correctness

        def __post_init__(self) -> None:
            if not isinstance(self.path, str) or not self.path:
                raise ValueError(f"{CONFIG_KEY}.path={self.path!r} must name the reward model's HF checkpoint dir")
            if self.micro_batch_size < 1:
                raise ValueError(f"{CONFIG_KEY}.micro_batch_size={self.micro_batch_size} must be ≥ 1")
            if self.max_length is not None and self.max_length < 1:
                raise ValueError(f"{CONFIG_KEY}.max_length={self.max_length} must be ≥ 1 or null "
                                 "(the reward model's max_position_embeddings)")
            if self.dtype not in DTYPES:
                raise ValueError(f"{CONFIG_KEY}.dtype={self.dtype!r}; valid: {', '.join(DTYPES)}")
            for name in ("score_scale", "score_bias", "correct_threshold"):
                value = getattr(self, name)
                if value is not None and not math.isfinite(value):
                    raise ValueError(f"{CONFIG_KEY}.{name}={value} must be a finite number")

    def __init__(self, config: Config, *, tokenizer: PreTrainedTokenizerBase, device: torch.device | str = "cpu",
                 **ctx: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer  # the policy's
        self.device = torch.device(device)
        self.rm_tokenizer, model = load_reward_model(config.path, dtype=DTYPES[config.dtype])
        self.pad_id = int(model.config.pad_token_id)
        self.max_length = int(config.max_length or model.config.max_position_embeddings)
        self.model = cast(torch.nn.Module, model)  # (transformers' decorated `.to` confuses type checkers)
        self.model.to(self.device).eval()
        self.chat = config.apply_chat_template and bool(getattr(self.rm_tokenizer, "chat_template", None))
        self.user_frame = chat_frame(tokenizer)

    def __call__(self, batch: RolloutBatch) -> RewardOutput:
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch.prompt_ids, batch.prompt_mask, strict=True)]
        encoded = [self.encode(p, r) for p, r in zip(prompts, response_tokens(batch), strict=True)]
        c = self.config
        scores_B = self.logits([ids for ids, _ in encoded]) * c.score_scale + c.score_bias
        scores_B = scores_B.to(batch.response_ids.device)
        correct_B = None if c.correct_threshold is None else scores_B > c.correct_threshold
        return RewardOutput(scores_B=scores_B, correct_B=correct_B, info={"truncated": [cut for _, cut in encoded]})

    def encode(self, prompt_ids: list[int], response_ids: list[int]) -> tuple[list[int], bool]:
        """One sample's RM token ids (the last ``max_length``) and whether any were dropped."""
        if self.chat:
            response = decode(self.tokenizer, response_ids, skip_special_tokens=True)
            messages = [{"role": "user", "content": self.user_message(prompt_ids)},
                        {"role": "assistant", "content": response}]
            text = self.rm_tokenizer.apply_chat_template(messages, tokenize=False)
        else:
            text = decode(self.tokenizer, prompt_ids + response_ids)
        ids: list[int] = list(self.rm_tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids[-self.max_length:], len(ids) > self.max_length

    def user_message(self, prompt_ids: list[int]) -> str:
        """The prompt's user message: its decoded text inside the policy template's frame, else all of it."""
        text = decode(self.tokenizer, prompt_ids)
        if self.user_frame is not None:
            before, after = self.user_frame
            if text.startswith(before) and text.endswith(after) and len(text) >= len(before) + len(after):
                return text[len(before):len(text) - len(after)]
        return decode(self.tokenizer, prompt_ids, skip_special_tokens=True)

    @torch.no_grad()
    def logits(self, rows: Sequence[list[int]]) -> torch.Tensor:
        """The RM's logit for each row of token ids, ``micro_batch_size`` rows per forward (float32 [B])."""
        out = [torch.zeros(0)]
        for start in range(0, len(rows), self.config.micro_batch_size):
            chunk = rows[start:start + self.config.micro_batch_size]
            ids_BL = torch.full((len(chunk), max(len(r) for r in chunk)), self.pad_id, dtype=torch.long)
            mask_BL = torch.zeros_like(ids_BL)
            for b, row in enumerate(chunk):  # right padding: a row's real tokens keep positions 0..len-1
                ids_BL[b, :len(row)] = torch.tensor(row, dtype=torch.long)
                mask_BL[b, :len(row)] = 1
            logits_B1 = self.model(input_ids=ids_BL.to(self.device), attention_mask=mask_BL.to(self.device)).logits
            out.append(logits_B1[:, 0].float().cpu())
        return torch.cat(out)


def load_reward_model(path: str, *, dtype: torch.dtype) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """The tokenizer and one-label sequence-classification model at ``path``; errors name the config key."""
    where = f"{CONFIG_KEY}.path={path!r}"
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{where} is not a directory; it must be a reward model's HF checkpoint dir "
                                "(config.json, weights, tokenizer)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where} has no readable HF config.json: {e}") from e
    archs = list(config.architectures or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"{where} holds a {', '.join(archs) or 'model with no `architectures`'} checkpoint, not a "
                         "reward model: expected a *ForSequenceClassification (e.g. Qwen2ForSequenceClassification, "
                         "LlamaForSequenceClassification) with num_labels=1")
    if config.num_labels != 1:
        raise ValueError(f"{where} is a classifier with num_labels={config.num_labels}; a reward model has one "
                         "label (its logit is the score)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where} has no readable tokenizer (the reward model's own is needed): {e}") from e
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    if model.config.pad_token_id is None:  # transformers pools at the last token that is not pad_token_id
        if tokenizer.pad_token_id is None:
            raise ValueError(f"{where}: neither config.json nor the tokenizer sets a pad token id, which batched "
                             "scoring needs (transformers pools the score at the last non-pad token); set "
                             "pad_token_id in config.json")
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model


def chat_frame(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str] | None:
    """The text ``tokenizer``'s chat template puts before and after a single user message (generation prompt
    included); None without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], add_generation_prompt=True,
                                         tokenize=False)
    if not isinstance(text, str) or text.count(_MARKER) != 1:
        return None
    before, after = text.split(_MARKER)
    return before, after


def assistant_turn_end(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The text ``tokenizer``'s chat template puts after an assistant message's content, when the message ends a
    user + assistant conversation (e.g. ``<|im_end|>\n``): how :class:`ModelReward` ends what it scores, and so what
    the reward-model trainer appends to each response. None without a template (or one that drops the marker)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARKER}],
                                         tokenize=False)
    if not isinstance(text, str) or text.count(_MARKER) != 1:
        return None
    return text.split(_MARKER)[1]
