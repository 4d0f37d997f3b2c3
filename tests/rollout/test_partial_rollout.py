"""Partial rollouts (``hybridrl/rollout/partial.py``, the ``hf`` engine's abort/resume): a weight update
interrupts a running generation, which continues on the new weights; each token keeps the version — and the
log-prob — of the weights that sampled it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridrl.interfaces import Generation, SamplingParams
from hybridrl.models.tiny import make_tiny_model
from hybridrl.rollout.engines.hf import HFRolloutEngine
from hybridrl.rollout.partial import Interrupt, generate_continued, joined, mask_stale_prefix

PARAMS = SamplingParams(temperature=1.0, n=2, max_new_tokens=12)
PROMPTS = [[5, 6, 7], [8, 9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("partial") / "model", hidden=32, layers=2, heads=4, kv_heads=2,
                           max_positions=64)


def engine(model_dir: Path) -> HFRolloutEngine:
    return HFRolloutEngine(HFRolloutEngine.Config(max_batch_size=2), model_path=str(model_dir))  # two chunks


def _no_eos(e: HFRolloutEngine) -> None:
    e.eos_ids = []  # every sample runs to its cap: the interruption always finds them unfinished


def test_abort_returns_what_each_sample_has_and_resume_ends_it(model_dir: Path) -> None:
    e = engine(model_dir)
    _no_eos(e)
    e.abort()  # before the call: nothing is decoded, every sample comes back empty, cut short
    cut = e.generate(PROMPTS, PARAMS, seeds=[1, 2])
    assert [(g.token_ids, g.finish_reason) for g in cut] == [([], "abort")] * 4
    e.resume()
    full = e.generate(PROMPTS, PARAMS, seeds=[1, 2], max_new_tokens=[12, 0])
    assert [(len(g.token_ids), g.finish_reason) for g in full] == [(12, "length")] * 2 + [(0, "length")] * 2


def _interrupt_after(e: HFRolloutEngine, calls: int) -> tuple[threading.Event, threading.Event]:
    """The engine's forward blocks at call ``calls`` (having signalled ``reached``) until ``abort()`` is called:
    the interruption lands after exactly ``calls`` decoding steps."""
    reached, aborted = threading.Event(), threading.Event()
    forward, abort, count = e.model.forward, e.abort, [0]

    def counting(*a, **kw):  # type: ignore[no-untyped-def]
        count[0] += 1
        if count[0] == calls:
            reached.set()
            assert aborted.wait(30)
        return forward(*a, **kw)

    def signalled() -> None:
        abort()
        aborted.set()

    e.model.forward, e.abort = counting, signalled  # type: ignore[method-assign]
    return reached, aborted


def test_an_interrupted_sample_continues_on_the_new_weights_token_by_token(model_dir: Path) -> None:
    e = engine(model_dir)
    _no_eos(e)
    interrupt = Interrupt(e)
    reached, _ = _interrupt_after(e, 3)
    noise: dict[int, torch.Tensor] = {}  # one per storage: tied weights stay tied
    new = {n: p.detach() + noise.setdefault(p.data_ptr(), 0.05 * torch.randn_like(p)) for n, p in e.params.items()}
    out: list[list[Generation]] = []
    worker = threading.Thread(target=lambda: out.append(generate_continued(
        e, range(2), PROMPTS, PARAMS, seeds=[1, 2], max_new_tokens=None, interrupt=interrupt)))
    worker.start()
    assert reached.wait(60)
    with interrupt.paused():  # the first chunk stops after 3 tokens; the second never starts on version 0
        e.update_weights([list(new.items())], version=1)
    worker.join(60)
    gens = out[0]
    assert interrupt.interruptions == 1
    assert [g.prompt_index for g in gens] == [0, 0, 1, 1]
    assert all(len(g.token_ids) == 12 and g.finish_reason == "length" for g in gens)
    assert [g.token_versions for g in gens[:2]] == [[0] * 3 + [1] * 9] * 2  # 3 tokens on the old weights
    assert [g.token_versions for g in gens[2:]] == [[1] * 12] * 2  # its chunk was cut before its first token
    assert [g.weight_version for g in gens] == [0, 0, 1, 1]  # the oldest token's version: what staleness counts
    # each token's log-prob is that of the weights that sampled it (the behaviour policy)
    old = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    updated = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    updated.load_state_dict({n: t for n, t in new.items()}, strict=False)
    for g in gens:
        ids = torch.tensor([PROMPTS[g.prompt_index] + g.token_ids])
        P = len(PROMPTS[g.prompt_index])
        with torch.no_grad():
            by_version = {v: torch.log_softmax(m(ids).logits[0, P - 1:-1].float(), -1)
                          .gather(-1, ids[0, P:, None]).squeeze(-1) for v, m in ((0, old), (1, updated))}
        want = torch.stack([by_version[v][t] for t, v in enumerate(g.token_versions or [])])
        torch.testing.assert_close(torch.tensor(g.logprobs), want, atol=1e-4, rtol=0)


def test_joining_keeps_each_pieces_version_and_the_stale_prefix_can_be_masked() -> None:
    head = Generation(prompt_index=0, token_ids=[1, 2], logprobs=[-1.0, -2.0], finish_reason="abort",
                      weight_version=3)
    whole = joined(joined(head, Generation(prompt_index=0, token_ids=[3], logprobs=[-3.0], finish_reason="abort",
                                           weight_version=4)),
                   Generation(prompt_index=0, token_ids=[4, 5], logprobs=[-4.0, -5.0], finish_reason="stop",
                              weight_version=5))
    assert (whole.token_ids, whole.logprobs, whole.token_versions) == ([1, 2, 3, 4, 5], [-1.0, -2.0, -3.0, -4.0,
                                                                                         -5.0], [3, 3, 4, 5, 5])
    assert (whole.weight_version, whole.finish_reason) == (3, "stop")
    assert mask_stale_prefix(whole).loss_mask == [0, 0, 0, 1, 1]
    # nothing sampled before the cut: the sample is as new as the weights it was generated on
    empty = Generation(prompt_index=0, token_ids=[], logprobs=[], finish_reason="abort", weight_version=3)
    assert joined(empty, head).weight_version == 3 and joined(empty, whole).token_versions == [3, 3, 4, 5, 5]
    fresh = joined(empty, Generation(prompt_index=0, token_ids=[9], logprobs=[-1.0], finish_reason="stop",
                                     weight_version=6))
    assert (fresh.weight_version, mask_stale_prefix(fresh).loss_mask) == (6, None)  # one version: unmasked


def test_a_continued_sample_keeps_the_routing_of_its_last_piece_that_ran_anything() -> None:
    """R3 router replay: the continuation's prompt held the head's tokens, so its routed experts cover them too; a
    continuation cut before its first forward ran nothing and the head's stay."""
    def routed(n: int) -> torch.Tensor:
        return torch.zeros(n, 1, 2, dtype=torch.int16)

    head = Generation(prompt_index=0, token_ids=[1, 2], logprobs=[-1.0, -2.0], finish_reason="abort",
                      weight_version=3, routed_experts=routed(3 + 2 - 1))
    tail = Generation(prompt_index=0, token_ids=[3, 4], logprobs=[-3.0, -4.0], finish_reason="stop",
                      weight_version=4, routed_experts=routed(3 + 4 - 1))
    assert len(joined(head, tail).routed_experts) == 6
    idle = Generation(prompt_index=0, token_ids=[], logprobs=[], finish_reason="abort", weight_version=4)
    assert len(joined(head, idle).routed_experts) == 4


def test_an_engine_without_abort_is_refused() -> None:
    class Plain:
        pass

    with pytest.raises(TypeError, match="cannot be interrupted"):
        Interrupt(Plain())
