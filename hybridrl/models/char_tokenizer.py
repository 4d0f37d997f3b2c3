"""A char-level tokenizer that survives ``AutoTokenizer.from_pretrained`` unchanged.

It is a ``Qwen2Tokenizer`` (byte-level BPE) with one token per printable ASCII char plus tab and
newline, and **no merges**, so every char of :data:`CHARS` is exactly one token and decoding is exact.
Why not a plain char/WordLevel tokenizer: when ``config.json`` says ``qwen2``/``qwen3``, transformers
5.x always loads ``Qwen2Tokenizer`` and rebuilds the pre-tokenizer from the vocab, so a foreign
tokenizer comes back changed (spaces silently dropped). A merge-free ``Qwen2Tokenizer`` is what that
rebuild produces anyway; ``tokenizer_config.json`` names it explicitly, so a ``llama`` config loads the
same class. Vocab entries are the byte-level spellings of the chars (space is ``Ġ``, newline ``Ċ``).

Special tokens come after the chars: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos).
Chars outside :data:`CHARS` have no token and are dropped by the encoder (Qwen2's BPE has no unk).
"""

from __future__ import annotations

import string

from transformers import Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

# printable ASCII (digits, letters, punctuation, space) plus "\t" and "\n"; no "\r", "\x0b", "\x0c"
CHARS: str = "".join(c for c in string.printable if c not in "\r\x0b\x0c")
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN = IM_END
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)

# Qwen-style ChatML without a default system message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def char_vocab() -> dict[str, int]:
    """Byte-level spelling of each char of :data:`CHARS` → id, then the special tokens."""
    byte_to_unicode = bytes_to_unicode()
    vocab = {byte_to_unicode[ord(c)]: i for i, c in enumerate(CHARS)}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return vocab


def make_char_tokenizer(*, model_max_length: int) -> Qwen2Tokenizer:
    tokenizer = Qwen2Tokenizer(
        vocab=char_vocab(),
        merges=[],
        unk_token=None,  # type: ignore[arg-type]  # merge-free BPE: no unk, unknown chars are dropped
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
