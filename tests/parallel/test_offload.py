"""Memory phases (``hybridrl.megatron.offload``): offload → reload is exact, and RL steps with every
offload key on (actor params/grads/optimizer, ref params) equal the steps without, bit for bit.

On CPU "host" and "device" are the same memory, but the same path runs as on a GPU: each storage is
copied out to a separate host buffer and freed (``resize_(0)``), then restored. The worker
(``workers/offload.py``) runs, at DP=2 with the plain and the distributed optimizer, in fp32 and bf16
(fp32 main params kept by the optimizer), two RL steps through ``ActorRolloutRef``'s phases with
offload off and on, then offload → reload round trips of the trained actor. The bytes each phase moves
are printed (``pytest -s``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.distributed

WORKER = str(Path(__file__).parent / "workers" / "offload.py")
RUNS = ["tp1pp1cp1", "tp1pp1cp1-distopt", "tp1pp1cp1.bfloat16", "tp1pp1cp1-distopt.bfloat16"]  # DP=2 each
# (phase, who, op, kinds) of the first RL step: generate offloads everything, each pass reloads what it
# needs, the ref goes back to the host after its pass; sync_weights finds the params already back. In the
# next step the ref is still on the host when generation starts.
PHASES = [("generate", "actor", "offload", ["params", "grads", "optimizer"]),
          ("generate", "ref", "offload", ["params"]),
          ("old_log_prob", "actor", "reload", ["params"]),
          ("ref_log_prob", "ref", "reload", ["params"]),
          ("ref_log_prob", "ref", "offload", ["params"]),
          ("update_actor", "actor", "reload", ["grads", "optimizer"])]
TWO_STEPS = PHASES + [PHASES[0]] + PHASES[2:]


@pytest.fixture(scope="module")
def results(torchrun: Any, rl_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("offload")
    proc = torchrun([WORKER, str(rl_model), str(out), *RUNS], nproc=2, timeout=600)
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith(("tp", " "))))
    return {run: [torch.load(out / f"{run}-rank{r}.pt") for r in range(2)] for run in RUNS}


@pytest.mark.parametrize("run", RUNS)
def test_round_trip_is_exact(results: dict[str, list[dict]], run: str) -> None:
    for rank in results[run]:
        rt = rank["round_trip"]
        assert rt["grads_nonzero"]  # a trained actor: its main_grads and Adam state hold something
        assert rt["moved"] == rt["back"] == rt["expected"]  # the sizes of Megatron's buffers and state
        assert all(rt["freed"].values()), rt["freed"]  # every storage really freed while offloaded
        assert rt["again"] == {} and rt["again_back"] == {}  # idempotent
        assert rt["bitwise_same_storage"]  # same values, same storage objects and offsets: views intact
        for kind, checks in rt["alone"].items():  # one kind alone frees its own storages, nothing else
            assert all(checks.values()), (kind, checks)


@pytest.mark.parametrize("run", RUNS)
def test_state_stays_on_host_through_generation(results: dict[str, list[dict]], run: str) -> None:
    for rank in results[run]:
        for where, freed in rank["freed"].items():
            assert all(freed.values()), (where, freed)
        assert [(p, who, op, list(moved)) for p, who, op, moved in rank["phases"]] == TWO_STEPS
        assert rank["phases"][len(PHASES)][3] == rank["round_trip"]["expected"]  # step 2: the trained state


@pytest.mark.parametrize("run", RUNS)
def test_rl_steps_with_offload_equal_steps_without(results: dict[str, list[dict]], run: str) -> None:
    for rank in results[run]:
        for off, on in zip(rank["off"], rank["on"], strict=True):
            for key in ("old_logprobs", "ref_logprobs", "entropy"):
                assert torch.equal(off[key], on[key]), key
            assert off["metrics"] == on["metrics"]
            assert off["weights"].keys() == on["weights"].keys()
            for name, w in off["weights"].items():
                assert torch.equal(w, on["weights"][name]), name
        assert len(rank["on"]) == 2 and rank["on"][1]["metrics"][0]["update_skipped"] == 0
