"""Partial rollouts (``async_training.partial_rollout``): a weight update interrupts the engine's in-flight
generations, and each unfinished sample continues on the new weights from the tokens it has.

On an engine rank two threads meet here (:mod:`hybridrl.rollout.disaggregated`): the generating thread runs the
queued batches, the command thread takes weight updates. :class:`Interrupt` is their handshake:

1. the command thread enters :meth:`Interrupt.paused`: it calls the engine's ``abort()`` (the running ``generate``
   returns within one decoding step, each unfinished sample with ``finish_reason="abort"`` and its tokens so far)
   and waits until no ``generate`` is running;
2. it updates the weights in place; nothing generates meanwhile;
3. it leaves: ``resume()``, and the generating thread goes on — :func:`generate_continued` feeds every aborted
   sample back as a context of prompt + its tokens, capped at the tokens it has left, one sample each.

A sample's pieces are joined: ``token_ids`` and ``logprobs`` (each token's log-prob under the version that sampled
it: the behaviour policy the rollout correction compares with), ``token_versions`` (one per token) and
``weight_version`` = the oldest of them (what the staleness bound counts, :mod:`hybridrl.rollout.staleness`). With
``mask_stale_prefix`` the rollout then keeps the tokens of older versions out of the loss
(:func:`mask_stale_prefix`).

As slime's partial rollout (aborted samples go back with their output and continue) and AReaL's interruptible
generation; deviation: a sample continues inside the same batch, so a batch's samples stay together and the
trainer's view of a step does not change. A continued piece draws from a seed made of the sample's own seed, its
index and its length so far, so the run is reproducible given where the interruptions fell.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from hybridrl.interfaces import Generation, SamplingParams
from hybridrl.rollout.colocated import generate_share
from hybridrl.seeds import prompt_seed


class Interrupt:
    """Pause/resume between an engine's generating thread and the thread that updates its weights."""

    def __init__(self, engine: Any) -> None:
        if not getattr(engine, "supports_abort", False):
            raise TypeError(f"{type(engine).__name__} cannot be interrupted (no supports_abort): partial rollouts "
                            "need an engine with abort() and resume()")
        self.engine = engine
        self._cv = threading.Condition()
        self._paused = self._active = False
        self.interruptions = 0  # pauses that found a generation running
        self.waited_s = 0.0  # the generating thread's time held back by pauses

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Around each ``generate`` call: waits while a pause holds, then marks a generation running."""
        start = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: not self._paused)
            self._active = True
        self.waited_s += time.perf_counter() - start
        try:
            yield
        finally:
            with self._cv:
                self._active = False
                self._cv.notify_all()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Interrupt the running generation (if any) and hold the next one back until the block ends."""
        with self._cv:
            self._paused = True
            self.interruptions += self._active
            self.engine.abort()
            # again while it runs: an abort can land between a call's check and its requests reaching the engine
            while not self._cv.wait_for(lambda: not self._active, timeout=0.5):
                self.engine.abort()
        try:
            yield
        finally:
            with self._cv:
                self.engine.resume()
                self._paused = False
                self._cv.notify_all()


def generate_continued(engine: Any, share: range, contexts: Sequence[list[int]], params: SamplingParams, *,
                       seeds: Sequence[int], max_new_tokens: Sequence[int] | None,
                       interrupt: Interrupt) -> list[Generation]:
    """:func:`~hybridrl.rollout.colocated.generate_share`, continuing each sample a pause cut short until every
    sample finished (``stop`` or ``length``)."""
    with interrupt.generating():
        gens = generate_share(engine, share, contexts, params, seeds=seeds, max_new_tokens=max_new_tokens)
    index: dict[int, int] = {}
    sample_of = []  # each sample's index j within its prompt's group
    for g in gens:
        sample_of.append(index.get(g.prompt_index, 0))
        index[g.prompt_index] = sample_of[-1] + 1
    one = dataclasses.replace(params, n=1)
    while todo := [k for k, g in enumerate(gens) if g.finish_reason == "abort"]:
        cap = [params.max_new_tokens if max_new_tokens is None else max_new_tokens[gens[k].prompt_index]
               for k in todo]
        ctx = [list(contexts[gens[k].prompt_index]) + gens[k].token_ids for k in todo]
        left = [c - len(gens[k].token_ids) for c, k in zip(cap, todo, strict=True)]
        keys = [prompt_seed(prompt_seed(seeds[gens[k].prompt_index], sample_of[k]), len(gens[k].token_ids))
                for k in todo]
        with interrupt.generating():
            more = engine.generate(ctx, one, seeds=keys, max_new_tokens=left)
        for k, piece in zip(todo, more, strict=True):
            gens[k] = joined(gens[k], piece)
    return gens


def joined(head: Generation, tail: Generation) -> Generation:
    """``head`` (cut short) continued by ``tail``; each token keeps the version that sampled it. The routed experts
    are the tail's (its prompt held the head's tokens, so it ran every position again) unless it ran none."""
    versions = [*(head.token_versions or [head.weight_version] * len(head.token_ids)),
                *(tail.token_versions or [tail.weight_version] * len(tail.token_ids))]
    routed = tail.routed_experts
    if routed is None or (head.routed_experts is not None and len(routed) < len(head.routed_experts)):
        routed = head.routed_experts
    return dataclasses.replace(
        head, token_ids=head.token_ids + tail.token_ids, logprobs=head.logprobs + tail.logprobs,
        finish_reason=tail.finish_reason, token_versions=versions, routed_experts=routed,
        weight_version=min(versions, default=tail.weight_version))  # no token yet: the version it continues on


def mask_stale_prefix(g: Generation) -> Generation:
    """``async_training.mask_stale_prefix``: the tokens sampled by an older version than the sample's last get
    loss mask 0 (slime's ``--mask-offpolicy-in-partial-rollout``); a sample of one version is unchanged."""
    if not g.token_versions or min(g.token_versions) == max(g.token_versions):
        return g
    last = g.token_versions[-1]
    own = g.loss_mask or [1] * len(g.token_ids)
    return dataclasses.replace(g, loss_mask=[m if v == last else 0 for m, v in zip(own, g.token_versions,
                                                                                       strict=True)])
