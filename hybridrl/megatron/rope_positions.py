"""RoPE at explicit position ids on Megatron's ``GPTModel`` (a workaround for one upstream behaviour).

megatron-core 0.16.1, ``models/gpt/gpt_model.py`` (``GPTModel._preprocess``): with
``position_embedding_type="rope"`` the rotary embedding is computed from the sequence length alone,
``self.rotary_pos_emb(rotary_seq_len)``, i.e. every row gets positions ``arange(S)``; the
``position_ids`` argument only feeds learned absolute embeddings (and mrope). Megatron's own way to
restart positions inside a row is the THD packed format (``packed_seq_params`` with ``cu_seqlens``),
which only Transformer Engine's attention takes. A row that holds one prompt and several responses
(:mod:`hybridrl.megatron.prefix_grouper`) needs every response to continue at the prompt's end, so
inside :func:`positioned_rope` the model's rotary module returns ``emb[position_ids]`` — shape
``[S, B, 1, D]`` instead of ``[S, 1, 1, D]``, which Megatron's ``apply_rotary_pos_emb`` (bshd, unfused)
broadcasts over the heads exactly as it does the shared one. Outside it the module is untouched.

``tests/megatron/test_prefix_grouper.py::test_megatron_still_ignores_position_ids_for_rope`` fails
once upstream applies ``position_ids`` to RoPE itself (then this module can go).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hybridrl.megatron.model import unwrap_model


@contextmanager
def positioned_rope(model: torch.nn.Module, position_ids_BS: torch.Tensor) -> Iterator[None]:
    """Inside: ``model``'s RoPE (a GPTModel, possibly wrapped) rotates row ``b``'s token ``s`` by
    ``position_ids_BS[b, s]``."""
    rope = getattr(unwrap_model(model), "rotary_pos_emb", None)
    if rope is None:  # multi-latent attention keeps a rotary table per layer (validation refuses it, given the model)
        raise ValueError("shared-prompt rows need the model's one rotary table, which a multi-latent-attention model "
                         "does not have; set actor_rollout_ref.actor.use_prefix_grouper=false")
    cached = type(rope).forward  # Megatron's lru-cached table of positions arange(n)
    table_len = int(position_ids_BS.max()) + 1

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None) -> torch.Tensor:
        emb_N11D = cached(rope, max(max_seq_len, table_len), offset, packed_seq, cp_group)
        return emb_N11D[:, 0, 0][position_ids_BS.T].unsqueeze(2)  # [S, B, 1, D]

    rope.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's
    try:
        yield
    finally:
        del rope.forward
