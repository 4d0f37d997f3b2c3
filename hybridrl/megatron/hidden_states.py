"""The last stage's final hidden states, instead of its logits, from Megatron's ``GPTModel`` (a workaround).

megatron-core 0.16.1, ``models/gpt/gpt_model.py``: ``GPTModel.forward`` (``_postprocess``) always applies the
output layer on the last pipeline stage and has no argument to return the hidden states there, which a head
computing log-probs straight from hidden states and the LM-head weight needs
(:func:`hybridrl.ops.lm_head_logprob_entropy`, vocabulary chunk by chunk: the ``[tokens, vocab]`` logits never
exist). ``_postprocess`` returns the hidden states when the model's ``post_process`` flag is False — the
intermediate stages' path — and by then the decoder has applied its final norm (the decoder's own
``post_process``, fixed at construction), so inside :func:`returning_hidden_states` that flag is False.
verl patches ``GPTModel.forward`` for the same purpose.

``tests/megatron/test_fused_lm_head.py::test_megatron_still_returns_only_logits`` fails once upstream's
forward takes an argument for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybridrl.megatron.model import unwrap_model


@contextmanager
def returning_hidden_states(model: torch.nn.Module) -> Iterator[None]:
    """Inside: ``model`` (a GPTModel, possibly wrapped) returns its final-normed hidden states ``[s, b, h]``."""
    gpt = unwrap_model(model)
    was = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = was


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The LM head's weight on the last stage, this TP rank's vocabulary shard ``[V_pad / TP, h]`` (the word
    embedding's when input and output embeddings are tied)."""
    gpt = unwrap_model(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
