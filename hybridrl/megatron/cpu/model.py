"""CPU adaptations of the model's forward and backward: attention mask, pipeline, tied embeddings, CP RoPE, the local
core attention under multi-latent attention."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.pipeline_parallel import schedules

from hybridrl.megatron.cpu.proxies import (
    _MARK,
    _tensor_cuda_is_identity,
    _TorchWithCpuFactories,
    _TorchWithoutCudaStreams,
    cuda_available,
)
from hybridrl.megatron.packed_attention import PackedDotProductAttention

# --- explicit arguments (preferred: no patch) ---------------------------------------------------


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The causal mask to pass to ``GPTModel.forward(attention_mask=...)``; None on CUDA.

    Works around ``transformer/utils.py:get_default_causal_mask``, which Megatron's local
    ``FusedScaleMaskSoftmax`` calls when no mask is given and which allocates with ``device="cuda"``.
    Shape ``[1, 1, s, s]``, True = masked (Megatron's convention), broadcast over batch and heads.
    """
    if cuda_available():
        return None
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def cpu_model_parallel_kwargs() -> dict[str, Any]:
    """``ModelParallelConfig`` fields to set on CPU (empty on CUDA).

    - ``batch_p2p_comm=False``: with it True, ``pipeline_parallel/p2p_communication.py``
      (``P2PCommunicator._communicate``) calls ``torch.cuda.synchronize()`` after
      ``batch_isend_irecv`` when ``batch_p2p_sync`` is True, and unconditionally in
      ``_communicate_shapes`` (variable sequence lengths). Worse, the interleaved schedule's gradients
      come out silently wrong on gloo: at PP = 2 the previous and next stage are the same rank, and
      ``_batched_p2p_ops`` posts one batch as (send_prev, recv_prev, send_next, recv_next), which gloo
      pairs with the peer's batch in posting order, so an activation and a gradient between the same
      two ranks are swapped. ``_p2p_ops`` (unbatched) orders them by rank parity and, at PP = 2, sends
      the two directions over two different process groups.
    - ``batch_p2p_sync=False``: the flag that guards that synchronize, for anyone who turns
      ``batch_p2p_comm`` back on.
    """
    if cuda_available():
        return {}
    return {"batch_p2p_comm": False, "batch_p2p_sync": False}


class MLADotProductAttention(PackedDotProductAttention):
    """Megatron's local ``DotProductAttention`` as multi-latent attention's core attention (the local spec's, CPU).

    Works around ``transformer/multi_latent_attention.py`` (``MultiLatentAttention.__init__``), which builds its
    core attention with ``k_channels=`` and ``v_channels=`` (query/key heads are nope + rope wide, values
    ``v_head_dim``): TE's attention takes them, the local ``DotProductAttention.__init__`` does not (``TypeError:
    unexpected keyword argument 'k_channels'``), so ``get_gpt_layer_local_spec(multi_latent_attention=True)`` cannot
    be built. It needs nothing else: the scores' scale is the ``softmax_scale`` MLA passes, and the context's width
    is ``kv_channels`` × heads, so the config's ``kv_channels`` must be ``v_head_dim``
    (:func:`hybridrl.megatron.model.transformer_config` sets it). Installed by
    :func:`hybridrl.megatron.model.layer_spec` in place of the spec's core attention, not patched;
    ``tests/megatron/test_deepseek_v3.py`` fails once the local attention takes the two arguments."""

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert v_channels in (None, self.hidden_size_per_attention_head), (
            f"kv_channels={self.hidden_size_per_attention_head} must be MLA's v_head_dim={v_channels}")


# --- patches ------------------------------------------------------------------------------------


def use_mla_without_transformer_engine() -> None:
    """Let ``MLASelfAttention`` be built where Transformer Engine is missing (CPU).

    ``transformer/multi_latent_attention.py`` sets its ``HAVE_TE = True`` once
    ``from megatron.core.extensions.transformer_engine import TELinear`` imports — which it does without TE, whose
    classes are then ``MagicMock`` stand-ins — and ``MultiLatentAttention.__init__`` runs ``HAVE_TE and
    isinstance(self.linear_proj, TELinear)`` → ``TypeError: isinstance() arg 2 must be a type``. The module's flag is
    set to what the extension module itself says (its ``HAVE_TE``: False without TE), which skips only that
    fp8/fp4 branch. Installed by :func:`hybridrl.megatron.model.layer_spec` for an MLA model on the local spec;
    ``tests/megatron/test_deepseek_v3.py`` fails once upstream's flag is right without it."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


def use_cpu_in_pipeline_schedules() -> None:
    """Send ``pipeline_parallel/schedules.py``'s literal ``device="cuda"`` tensors to CPU.

    ``forward_backward_no_pipelining`` and both pipelined schedules start with
    ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`` → ``AssertionError:
    Torch not compiled with CUDA enabled`` (or ``RuntimeError`` about CUDA). The module's ``torch``
    name is replaced by a proxy whose ``zeros`` maps ``"cuda"`` to ``"cpu"``; everything else is torch.
    """
    if not isinstance(schedules.torch, _TorchWithCpuFactories):
        schedules.torch = _TorchWithCpuFactories()  # type: ignore[assignment]


def use_cpu_in_tied_embedding_setup() -> None:
    """Keep the tied output weight on CPU while Megatron syncs it across pipeline stages.

    ``models/common/language_module/language_module.py``:
    ``LanguageModule.setup_embeddings_and_output_layer`` (run by ``GPTModel.__init__``) does
    ``weight.data = weight.data.cuda()`` before all-reducing the shared embedding over the embedding
    group when PP > 1 and embeddings are tied → ``AssertionError: Torch not compiled with CUDA
    enabled``. The method is wrapped so that ``Tensor.cuda`` is the identity during that call only.
    """
    method = LanguageModule.setup_embeddings_and_output_layer
    if getattr(method, _MARK, False):
        return

    def setup_embeddings_and_output_layer(self: LanguageModule) -> None:
        with _tensor_cuda_is_identity():
            method(self)

    setattr(setup_embeddings_and_output_layer, _MARK, True)
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer  # type: ignore[method-assign]


def _pos_emb_on_this_cp_rank_cpu(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """Upstream ``get_pos_emb_on_this_cp_rank`` with its chunk index made on ``pos_emb``'s device."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def use_cpu_in_cp_rope() -> None:
    """Slice the RoPE table for this CP rank without pinned memory or ``.cuda()``.

    ``models/common/embeddings/rope_utils.py``: ``get_pos_emb_on_this_cp_rank`` (called by
    ``RotaryEmbedding.forward`` when CP > 1) builds its index with ``torch.tensor(..., device="cpu",
    pin_memory=True).cuda(non_blocking=True)`` → ``RuntimeError: pin_memory=True requires a CUDA or
    other accelerator backend ...``. The modules that imported the function by name get
    :func:`_pos_emb_on_this_cp_rank_cpu`, which selects the same chunks (r and 2·CP−1−r).
    """
    from megatron.core.models.common.embeddings import (
        rope_utils,
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )

    if getattr(rotary_pos_embedding.get_pos_emb_on_this_cp_rank, _MARK, False):
        return
    setattr(_pos_emb_on_this_cp_rank_cpu, _MARK, True)
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank_cpu  # type: ignore[attr-defined]


def use_cpu_in_p2p_shape_exchange() -> None:
    """Let the pipeline exchange activation shapes on CPU (variable shapes between micro-batches).

    ``pipeline_parallel/p2p_communication.py``: with ``config.variable_seq_lengths`` (set by the policy
    when token-budget micro-batches differ in shape), ``P2PCommunicator._communicate_shapes`` sends
    each activation's shape before the activation and then calls ``torch.cuda.synchronize()``
    unconditionally (unlike ``_communicate``, where ``batch_p2p_sync`` guards it) → ``AssertionError:
    Torch not compiled with CUDA enabled`` at the first send. The module's ``torch`` becomes the proxy
    whose ``cuda.synchronize`` does nothing (the requests were already waited on).
    """
    from megatron.core.pipeline_parallel import p2p_communication

    if not isinstance(p2p_communication.torch, _TorchWithoutCudaStreams):
        p2p_communication.torch = _TorchWithoutCudaStreams()  # type: ignore[assignment]
