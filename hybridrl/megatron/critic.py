"""The value model of PPO (the critic) on Megatron: values of response positions and clipped-value-loss steps.

The critic is a causal-LM trunk with a value head: the HF checkpoint's transformer (embedding, layers, final
norm) as a Megatron ``GPTModel`` on the actor's TP/PP/CP/DP layout (it shares the actor's process groups, like
the ref), whose ``output_layer`` on the last pipeline stage is replaced by :class:`ValueHead`, a
``Linear(hidden, 1)``. Everything else — DDP, optimizer, LR scheduler, micro-batches, Megatron's schedule,
PP broadcast, loss scaling, precision — is :class:`~hybridrl.megatron.runner.MegatronRunner`'s, as for the actor.

The head is a plain, *replicated* Linear rather than a 1-output ``ColumnParallelLinear``: one output can't be
split over TP, and without sequence parallelism every TP rank holds the whole hidden state after the final
norm (the last RowParallelLinear all-reduced it), so every TP rank computes the same values and the same
loss. Its backward is then exact without any TP communication: each rank gets the full ∂L/∂h (what a column-
parallel head's all-reduce would have summed), and the head's own gradient is the same on every TP rank;
Megatron's DDP averages it over DP (×CP) only, and the grad norm counts it once (it has no
``tensor_model_parallel`` tag, so only TP rank 0's copy is counted). With sequence parallelism (GPU, TE only)
the head first gathers the sequence, keeping only this rank's part of the gradient on the way back
(``tensor_parallel_output_grad=False``: each rank's loss is the whole loss) — not testable on CPU.

The model is built untied (``tie_word_embeddings=False``: there is no output embedding to tie to), so no
embedding copy lives on the last stage and no embedding-gradient all-reduce runs between the stages.

Head initialisation: from ``score.weight`` (and ``score.bias``) when the checkpoint has them — an HF
``*ForTokenClassification`` / ``*ForSequenceClassification`` with one label, e.g. a reward model —, else
weight ~ N(0, 0.02²) drawn from ``seed`` (the same on every rank) and bias 0, as transformers initialises
a fresh ``score`` (``initializer_range`` 0.02). The values are read at the positions that predict each
response token — V(prompt + r_<t) for response token t, as verl's critic (``values[:, -T-1:-1]``).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule

from hybridrl.algorithms.value_loss import clipped_value_loss
from hybridrl.batch import RolloutBatch
from hybridrl.hf.arch import HFArch
from hybridrl.hf.tensors import SafetensorsReader
from hybridrl.megatron.config import MegatronConfig, MicroBatching, OptimConfig
from hybridrl.megatron.context_parallel import gather_sequence
from hybridrl.megatron.model import build_model_chunks, unwrap_model
from hybridrl.megatron.runner import Head, MegatronRunner, _Micro, parallel_config
from hybridrl.megatron.weights import load_hf_weights

HEAD_INIT_STD = 0.02  # transformers' default initializer_range


class ValueHead(torch.nn.Module):
    """``GPTModel.output_layer`` of the critic: hidden states ``[s, b, h]`` → values ``[s, b, 1]``, called like
    Megatron's output layer (``weight``/``runtime_gather_output`` are the LM head's and are not used)."""

    def __init__(self, hidden_size: int, *, dtype: torch.dtype, device: torch.device, sequence_parallel: bool,
                 bias: bool = True) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        # the reward model's head has none (transformers' sequence-classification ``score`` is bias-free)
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias else None
        self.sequence_parallel = sequence_parallel  # GPTModel reads it in inference; see the module docstring

    def forward(self, hidden_SBH: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            hidden_SBH = gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False)
        return F.linear(hidden_SBH, self.weight, self.bias), None


class MegatronCritic(MegatronRunner):
    """A value model on Megatron, initialised from an HF causal LM's trunk (and its ``score`` head if any)."""

    def __init__(self, *, model_dir: str, megatron: MegatronConfig, optim: OptimConfig, total_steps: int,
                 pad_token_id: int, seed: int) -> None:
        chunks, arch = build_scalar_head_model(model_dir, megatron, seed=seed)
        super().__init__(chunks, arch=arch, megatron=megatron, optim=optim, total_steps=total_steps,
                         pad_token_id=pad_token_id)

    def _values(self, loss_fn: Head | None, mb: _Micro,
                values_BS1: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        R, s, _ = values_BS1.shape  # s: this CP rank's positions (all S when CP = 1)
        values_BT = mb.rows.at_responses(gather_sequence(values_BS1.float().view(R, s),
                                                         cu_seqlens=mb.rows.cu_seqlens_padded))
        if loss_fn is None:
            return values_BT.sum() * 0.0, {"values": values_BT.detach()}
        return loss_fn(mb, values_BT)

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch, *, batching: MicroBatching) -> torch.Tensor:
        """``values_BT``: V at the position that predicts each response token (0 outside the response mask), on
        every rank of the MP group, on the host."""
        return self._forward_rows(batch, partial(self._values, None), ("values",), batching=batching)[0]

    def train_step(self, batch: RolloutBatch, *, batching: MicroBatching, cliprange: float,
                   loss_agg_mode: str = "token-mean") -> dict[str, float]:
        """One optimizer step of the clipped value loss (:mod:`hybridrl.algorithms.value_loss`) over ``batch``
        (this DP rank's share of a mini-batch, with ``values`` — V_old — and ``returns``); metrics ``vf_loss``
        (the mini-batch loss), ``vf_clipfrac``, ``vpred_mean`` (token means) and the optimizer's."""
        assert batch.values is not None and batch.returns is not None, "the critic trains on values and returns"

        def head_for(normalizer: torch.Tensor) -> Head:
            def loss(mb: _Micro, values_BT: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                b = mb.batch
                assert b.values is not None and b.returns is not None
                return clipped_value_loss(values_BT, b.values, b.returns, b.loss_mask, cliprange=cliprange,
                                          loss_agg_mode=loss_agg_mode, global_normalizer=normalizer)
            return partial(self._values, loss)

        return self._train_step(batch, head_for, batching=batching, loss_agg_mode=loss_agg_mode)


def build_scalar_head_model(model_dir: str, megatron: MegatronConfig, *, seed: int,
                            bias: bool = True) -> tuple[list[MegatronModule], HFArch]:
    """The checkpoint's trunk as Megatron chunks (built untied, loaded) with a :class:`ValueHead` in place of the
    LM head on the last stage, initialised as the module docstring says: the critic's, and the reward model's
    (``bias=False``)."""
    arch = dataclasses.replace(HFArch.from_hf(model_dir), tie_word_embeddings=False)
    chunks = build_model_chunks(arch, parallel_config(megatron), dtype=megatron.dtype,
                                overrides=megatron.override_transformer_config)
    last = unwrap_model(chunks[-1])
    if last.post_process:  # the last chunk of the last stage
        lm_head = last.output_layer
        last.output_layer = ValueHead(arch.hidden_size, dtype=lm_head.weight.dtype, device=lm_head.weight.device,
                                      sequence_parallel=megatron.sequence_parallel, bias=bias)
        del lm_head
    load_hf_weights(chunks, arch, model_dir, skip=("output_layer.",))
    if last.post_process:
        _init_head(last.output_layer, model_dir, seed=seed)
    return chunks, arch


@torch.no_grad()
def _init_head(head: ValueHead, model_dir: str, *, seed: int) -> None:
    with SafetensorsReader(model_dir) as reader:
        if "score.weight" in reader.files:
            weight = reader.read("score.weight")
            if weight.shape != head.weight.shape:
                raise ValueError(f"{model_dir}: score.weight has the shape {tuple(weight.shape)}; a value head needs "
                                 f"{tuple(head.weight.shape)} (one label)")
            head.weight.copy_(weight)
            if "score.bias" in reader.files and head.bias is not None:
                head.bias.copy_(reader.read("score.bias"))
            return
    weight = torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(seed)) * HEAD_INIT_STD
    head.weight.copy_(weight)
