"""Router replay for an MoE actor (``actor_rollout_ref.actor.router_replay.mode``, verl's key): the trainer's forward
passes route each token through recorded experts instead of choosing their own.

- **R3** (rollout routing replay; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
  Inference Routers", arXiv:2510.11370): the engine records the experts it chose for every position it ran
  (``SamplingParams.return_routed_experts`` → ``RolloutBatch.*_routed_experts``), and the old-log-prob pass and the
  update route through them, so the trainer scores the tokens with the engine's experts.
- **R2** (routing replay; Zheng et al. 2025, GSPO, §5): the old-log-prob pass records the trainer's own routing
  and the update replays it, so every mini-batch of the update routes as π_old did.

A replayed router keeps its own scores s = router(x) and takes the recorded top-k set K instead of topk(s): the
weights are softmax(s_K) (``norm_topk_prob``) or softmax(s)_K, as Megatron's ``RouterReplay`` computes them, so the
router's gradient flows through the replayed experts' weights as usual. Deviation: a position without a record (-1:
padding, a response's last token, which the engine never ran) routes as the trainer would, where Megatron's own
replay needs every position. Megatron's ``RouterReplay`` hooks are used per router (``TopKRouter.router_replay``);
its process-wide instance list is not, so the ref's routers (another model in the same process) are left alone.

Every replayed router also counts the (token, layer) pairs whose own top-k set differs from the replayed one:
``router_replay/engine_mismatch`` (R3, old-log-prob pass: the trainer against the engine) and
``router_replay/update_mismatch`` (the update against the replayed routing), over every rank's tokens.

Layout: a micro-batch's rows are ``[b, S]`` (:mod:`sequences`; one row when packed); a router sees this rank's
positions of them as ``[s·b]`` tokens in Megatron's ``[s, b]`` order — CP's positions (:func:`shard_sequence`), then,
with sequence parallelism, the TP rank's contiguous slice of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hybridrl.batch import RolloutBatch
from hybridrl.megatron.context_parallel import gather_sequence, shard_sequence
from hybridrl.megatron.sequences import PackedRows


class _LayerReplay:
    """One router's replay: Megatron's ``TopKRouter`` calls :meth:`get_replay_topk` for its top-k."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None  # [N, k] long, -1 rows: the router's own choice
        self.record = False
        self.recorded: torch.Tensor | None = None  # [N, k] the experts the last forward used
        self.mismatched: torch.Tensor | int = 0  # counts kept on the device: no host sync per router
        self.compared: torch.Tensor | int = 0

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            if self.record:
                self.recorded = own.detach()
            return probs, own
        if self.target.shape != own.shape:
            raise RuntimeError(f"router replay: {tuple(self.target.shape)} recorded experts for a router that "
                               f"routes {tuple(own.shape)} (tokens, top-k)")
        target = self.target.to(own.device, own.dtype)
        have = target[:, 0] >= 0
        chosen = torch.where(have[:, None], target, own)
        differs = (chosen.sort(-1).values != own.sort(-1).values).any(-1) & have
        self.mismatched = self.mismatched + differs.sum()
        self.compared = self.compared + have.sum()
        if self.record:
            self.recorded = chosen.detach()
        return scores.gather(1, chosen), chosen


def packed_routing(batch: RolloutBatch, rows: PackedRows) -> torch.Tensor:
    """``[R, S, L, k]`` long: the batch's recorded experts in the rows' layout (padded or packed), -1 elsewhere."""
    assert batch.prompt_routed_experts is not None and batch.response_routed_experts is not None
    both = torch.cat([batch.prompt_routed_experts, batch.response_routed_experts], dim=1).long()
    where_BL = rows.token_index_BL(batch.prompt_ids.shape[1]).to(both.device)
    R, S = rows.tokens_BS.shape
    out = torch.full((R * S, *both.shape[2:]), -1, dtype=torch.long, device=both.device)
    real = where_BL >= 0
    out[where_BL[real]] = both[real]
    return out.view(R, S, *both.shape[2:])


def unpacked_routing(packed_RSLK: torch.Tensor, batch: RolloutBatch,
                     rows: PackedRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`packed_routing`: ``(prompt [b, P, L, k], response [b, T, L, k])`` int16, -1 on padding."""
    P = batch.prompt_ids.shape[1]
    device = packed_RSLK.device
    where_BL = rows.token_index_BL(P).to(device)
    flat = packed_RSLK.reshape(-1, *packed_RSLK.shape[2:]).to(torch.int16)
    both = flat[where_BL.clamp(min=0)].masked_fill((where_BL < 0)[:, :, None, None], -1)
    return both[:, :P], both[:, P:]


class RouterReplay:
    """The replay hooks of one model's routers (every chunk on this rank) and what the runner tells them per
    micro-batch: replay the batch's recorded experts, record the model's own, or neither."""

    def __init__(self, chunks: list[torch.nn.Module], sparse_layers: tuple[bool, ...], *,
                 sequence_parallel: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        slot_of = {layer: sum(sparse_layers[:layer]) for layer in range(len(sparse_layers)) if sparse_layers[layer]}
        self.num_slots = sum(sparse_layers)
        self.sequence_parallel = sequence_parallel
        self.routers: dict[int, list[tuple[int, _LayerReplay]]] = {}  # id(chunk) → (MoE slot, hook)
        for chunk in chunks:
            found = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    hook = _LayerReplay()
                    module.router_replay = hook  # Megatron calls it for every top-k (router.py, moe_utils.py)
                    found.append((slot_of[module.layer_number - 1], hook))  # layer_number: global, 1-based
            self.routers[id(chunk)] = found
        self.replaying = False  # replay the batch's recorded experts (when it has them)
        self.recording = False  # record the model's own
        self._recorded: list[tuple[Any, dict[int, torch.Tensor]]] = []

    # ---- per micro-batch, called by the runner's forward step ----
    def before_forward(self, chunk: torch.nn.Module, batch: RolloutBatch, rows: PackedRows) -> None:
        routing = None
        if self.replaying and batch.prompt_routed_experts is not None:
            routing = packed_routing(batch, rows)
        for slot, hook in self.routers[id(chunk)]:
            hook.target = None if routing is None else self._router_order(routing[:, :, slot], rows)
            hook.record = self.recording

    def after_forward(self, chunk: torch.nn.Module, key: Any, rows: PackedRows) -> None:
        if self.recording:
            got = {}
            for slot, hook in self.routers[id(chunk)]:
                assert hook.recorded is not None, "a router did not run"
                got[slot] = self._from_router_order(hook.recorded, rows)
                hook.recorded = None
            self._recorded.append((key, got))
        for _, hook in self.routers[id(chunk)]:
            hook.target, hook.record = None, False

    def take_recorded(self) -> list[tuple[Any, dict[int, torch.Tensor]]]:
        """What the pass recorded: per micro-batch (its key), each of this rank's MoE slots' ``[b, S, k]``."""
        out, self._recorded = self._recorded, []
        return out

    def take_mismatch(self) -> tuple[float, float]:
        """``(mismatched, compared)`` (token, layer) pairs since the last call, summed over every trainer rank
        (each token once: TP ranks without sequence parallelism route the same tokens, so only TP rank 0
        counts them)."""
        hooks = [h for found in self.routers.values() for _, h in found]
        counted = parallel_state.get_tensor_model_parallel_rank() == 0 or self.sequence_parallel
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        for h in hooks:
            if counted:
                sums += torch.stack([torch.as_tensor(h.mismatched, device=device),
                                     torch.as_tensor(h.compared, device=device)]).double()
            h.mismatched = h.compared = 0
        dist.all_reduce(sums)
        return float(sums[0]), float(sums[1])

    def _router_order(self, x_BSK: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        """``[b, S, k]`` → ``[s·b, k]``: this rank's positions in the order its routers see them."""
        x = shard_sequence(x_BSK, dim=1, cu_seqlens=rows.cu_seqlens_padded).transpose(0, 1)  # [s, b, k]
        if self.sequence_parallel:
            x = x.chunk(parallel_state.get_tensor_model_parallel_world_size(), dim=0)[
                parallel_state.get_tensor_model_parallel_rank()]
        return x.reshape(-1, x.shape[-1])

    def _from_router_order(self, idx_Nk: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        """Inverse of :meth:`_router_order`: ``[s·b, k]`` → ``[b, S, k]``, gathered over sequence parallelism
        and CP."""
        x = idx_Nk.reshape(-1, rows.tokens_BS.shape[0], idx_Nk.shape[-1])  # [s, b, k]
        if self.sequence_parallel:
            group = parallel_state.get_tensor_model_parallel_group()
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, x.contiguous(), group=group)
            x = torch.cat(parts, dim=0)
        return gather_sequence(x.transpose(0, 1).contiguous(), dim=1, cu_seqlens=rows.cu_seqlens_padded)
