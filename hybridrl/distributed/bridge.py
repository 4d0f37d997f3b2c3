"""The bridge of a disaggregated run: a gloo group of trainer rank 0 and the engine ranks, outside Megatron's world.

The trainer ranks form the default process group on their own (Megatron spans exactly them), so the engine ranks
cannot be reached through it. The bridge is a ``ProcessGroupGloo`` made directly over the launch's TCP store
(torchrun's ``MASTER_ADDR``/``MASTER_PORT``, under its own key prefix): bridge rank 0 is trainer rank 0, bridge
rank ``1 + i`` the ``i``-th engine rank. It carries host data only — commands and samples as pickled bytes, weight
buckets as one flat byte tensor each (gloo: tensors on the CPU; a GPU run moves each bucket to host memory, a
cost an NCCL bridge would not have).

Every peer failure (a dead engine rank, a timeout) raises :class:`BridgeError` naming the launch rank at the
other end.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.interfaces import WeightBucket

PREFIX = "hybridrl/bridge"


class BridgeError(RuntimeError):
    pass


class Bridge:
    """``launch_ranks[b]``: the launched world's rank of bridge rank ``b`` (for messages)."""

    def __init__(self, *, rank: int, launch_ranks: list[int], timeout_s: float,
                 store: dist.Store | None = None, prefix: str = PREFIX) -> None:
        self.rank, self.size, self.launch_ranks = rank, len(launch_ranks), launch_ranks
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timeout)
        try:
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, self.size, timeout)
        except RuntimeError as e:
            raise BridgeError(f"launch rank {launch_ranks[rank]}: the bridge to ranks {launch_ranks} did not "
                              f"form within {timeout_s:.0f} s (trainer.dist_timeout_s): {e}") from e

    # ---- objects ----
    def broadcast_object(self, obj: Any = None) -> Any:
        """Bridge rank 0's ``obj``, on every bridge rank."""
        if self.rank == 0:
            data = _bytes(obj)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size, what="a command")
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data, what="a command")
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def send_object(self, obj: Any, *, dst: int) -> None:
        data = _bytes(obj)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        self._wait(lambda: self._pg.send([size], dst, 0), peer=dst, what="send to")
        self._wait(lambda: self._pg.send([data], dst, 1), peer=dst, what="send to")

    def recv_object(self, *, src: int) -> Any:
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(lambda: self._pg.recv([size], src, 0), peer=src, what="receive from")
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(lambda: self._pg.recv([data], src, 1), peer=src, what="receive from")
        return pickle.loads(data.numpy().tobytes())

    # ---- weights ----
    def broadcast_bucket(self, bucket: WeightBucket | None = None) -> WeightBucket | None:
        """Bridge rank 0's weight bucket (None: the stream's end) on every bridge rank: the names, dtypes and
        shapes as an object, the bytes as one flat tensor."""
        meta = None if bucket is None else [(name, t.dtype, tuple(t.shape)) for name, t in bucket]
        meta = self.broadcast_object(meta if self.rank == 0 else None)
        if meta is None:
            return None
        slots, total = _layout(meta)
        flat = torch.empty(total, dtype=torch.uint8)
        if self.rank == 0:
            assert bucket is not None
            for (_, t), (at, n) in zip(bucket, slots, strict=True):
                flat[at:at + n].copy_(t.detach().reshape(-1).cpu().view(torch.uint8))
        self._broadcast(flat, what="a weight bucket")
        if self.rank == 0:
            assert bucket is not None
            return bucket
        return [(name, flat[at:at + n].view(dtype).view(shape))
                for (name, dtype, shape), (at, n) in zip(meta, slots, strict=True)]

    def close(self) -> None:
        self._pg.shutdown()

    # ---- gloo, with the peer named on failure ----
    def _broadcast(self, t: torch.Tensor, *, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        peer = 0 if self.rank else None
        self._wait(lambda: self._pg.broadcast([t], opts), peer=peer, what=f"broadcast {what} with")

    def _wait(self, start: Callable[[], Any], *, peer: int | None, what: str) -> None:
        """``start()`` (a gloo call) and wait for it; gloo raises at either point when a peer is gone."""
        try:
            start().wait()
        except RuntimeError as e:
            there = (f"launch rank {self.launch_ranks[peer]}" if peer is not None
                     else f"the engine ranks {self.launch_ranks[1:]}")
            raise BridgeError(f"launch rank {self.launch_ranks[self.rank]} could not {what} {there} over the "
                              f"disaggregated bridge (did it die, or exceed trainer.dist_timeout_s?): {e}") from e


def _bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _layout(meta: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[tuple[int, int]], int]:
    """Each tensor's ``(byte offset, bytes)`` in a bucket's flat tensor (offsets 16-byte aligned: every slice
    views as its dtype), and the total."""
    slots, at = [], 0
    for _, dtype, shape in meta:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        slots.append((at, n))
        at += -(-n // 16) * 16
    return slots, at
