"""The partial-rollout check every engine with ``supports_abort`` passes against its real engine
(``test_sglang_engine.py``, ``test_vllm_engine.py``; the ``hf`` engine's exact version is in
``test_partial_rollout.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from hybridrl.interfaces import Generation, SamplingParams
from hybridrl.rollout.partial import Interrupt, generate_continued

PARAMS = SamplingParams(temperature=1.0, n=2, max_new_tokens=96)


def interrupted_generation(engine: Any, prompts: Sequence[list[int]], *, started: threading.Event,
                           weights: list[tuple[str, torch.Tensor]]) -> tuple[list[Generation], int]:
    """Generate ``prompts`` on a thread; once ``started`` (the engine was asked to generate) and a few steps later,
    pause, stream ``weights`` as a new version and resume. The samples spanning both versions (each continued to its
    end) and that version; checks that every sample finished and that those cut short hold the old version's
    tokens, then the new one's. On a loaded machine the pause can come before the engine sampled anything (every
    sample then runs on the new version alone): it is tried again, pausing later, up to three times."""
    for delay_s in (0.05, 0.3, 1.0):
        started.clear()
        spanning, version = _interrupt_once(engine, prompts, started=started, weights=weights, delay_s=delay_s)
        if spanning:
            break
    assert spanning, f"no sample was cut short by a pause {delay_s} s after the generation started"
    assert engine.generate(prompts[:1], PARAMS, seeds=[1])[0].finish_reason in ("stop", "length")  # resumed
    return spanning, version


def _interrupt_once(engine: Any, prompts: Sequence[list[int]], *, started: threading.Event,
                    weights: list[tuple[str, torch.Tensor]], delay_s: float) -> tuple[list[Generation], int]:
    interrupt, out = Interrupt(engine), []
    worker = threading.Thread(target=lambda: out.append(generate_continued(
        engine, range(len(prompts)), prompts, PARAMS, seeds=list(range(len(prompts))), max_new_tokens=None,
        interrupt=interrupt)))
    version = engine.version + 1
    worker.start()
    assert started.wait(60)
    time.sleep(delay_s)  # a few decoding steps
    with interrupt.paused():
        engine.update_weights([weights], version=version)
    worker.join(120)
    gens = out[0]
    assert interrupt.interruptions == 1 and len(gens) == len(prompts) * PARAMS.n
    assert all(g.finish_reason in ("stop", "length") and len(g.token_ids) == len(g.logprobs) for g in gens)
    spanning = [g for g in gens if g.token_versions and len(set(g.token_versions)) > 1]
    for g in spanning:  # the old version's tokens, then the new one's; the sample counts as old
        cut = g.token_versions.index(version)
        assert g.token_versions == [version - 1] * cut + [version] * (len(g.token_ids) - cut) and cut > 0
        assert g.weight_version == version - 1
    return spanning, version
