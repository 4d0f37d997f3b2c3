"""A real byte-level BPE tokenizer trained here, offline, on the project's own text (no model hub).

The tiny real-task recipe needs what a user's model has: merges learnt from text, several characters per
token, a chat template. :func:`train_bpe_tokenizer` trains BPE merges with the ``tokenizers`` library
using Qwen2's own pre-tokenization (its split regex, then byte-level), and returns a ``Qwen2Tokenizer``
over them — so ``AutoTokenizer.from_pretrained`` of a ``qwen2`` checkpoint loads it back unchanged (see
:mod:`hybridrl.models.char_tokenizer` for why it has to be that class). The byte alphabet is always in the
vocabulary: any text encodes. Special tokens follow the merges: ``<|endoftext|>`` (pad),
``<|im_start|>``, ``<|im_end|>`` (eos), with the same ChatML template as the char tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from hybridrl.models.char_tokenizer import CHAT_TEMPLATE, EOS_TOKEN, IM_START, PAD_TOKEN, SPECIAL_TOKENS


def train_bpe_tokenizer(texts: Iterable[str], *, vocab_size: int, model_max_length: int) -> Qwen2Tokenizer:
    """BPE merges learnt from ``texts`` up to ``vocab_size`` tokens (256 bytes + merges), then the specials."""
    if vocab_size <= 256:
        raise ValueError(f"vocab_size={vocab_size} must exceed the 256 byte tokens")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    state = bpe.get_vocab()  # token -> id, bytes first
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in _merges(bpe)]
    vocab = dict(sorted(state.items(), key=lambda kv: kv[1]))
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None,  # type: ignore[arg-type]
                               eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, additional_special_tokens=[IM_START],
                               model_max_length=model_max_length)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _merges(bpe: Tokenizer) -> list[str | tuple[str, str]]:
    """The learnt merges, in order (read from the model's JSON: the Python API does not expose them)."""
    import json

    return json.loads(bpe.to_str())["model"]["merges"]
