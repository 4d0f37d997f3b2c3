"""The engines the runtime starts are the ones ``hybridrl validate`` prints — or the layout is rejected.

For each layout of the table, the plan comes from ``hybridrl validate`` (its printed engine lines are
parsed) and the runtime's :class:`ColocatedEngines` is built from it on that many gloo ranks
(``workers/placement.py``, one torchrun launch per world size): each rank reports the engine it
started (device, TP size), which prompts that engine generated, and the samples it got back. Checked:
started engines == printed engines; the engines' shares cover the batch once; every rank holds exactly
its DP rank's prompts, all ``n`` samples each, in order (model-parallel peers alike).
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest

from hybridrl.config.compose import compose_config
from hybridrl.config.dry_run import main as validate_cli
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate
from hybridrl.models.tiny import make_tiny_model

AOR = "actor_rollout_ref"
WORKER = str(Path(__file__).parent / "workers" / "placement.py")
ROLLOUT_TP = f"{AOR}.rollout.tensor_model_parallel_size"


def actor(tp: int = 1, pp: int = 1, cp: int = 1) -> list[str]:
    m = f"{AOR}.actor.megatron"
    return [f"{m}.tensor_model_parallel_size={tp}", f"{m}.pipeline_model_parallel_size={pp}",
            f"{m}.context_parallel_size={cp}"]


# name -> (world size, overrides, keys a rejection names (None: accepted)); cuda layouts are planned for a
# GPU machine (--model-config), as `hybridrl validate --model-config` does on this CPU box
LAYOUTS: dict[str, tuple[int, list[str], list[str] | None]] = {
    "actor TP1×DP8, rollout TP2": (8, [*actor(), f"{ROLLOUT_TP}=2", f"{AOR}.rollout.name=sglang"], None),
    "actor TP4×DP2, rollout TP2": (8, [*actor(tp=4), f"{ROLLOUT_TP}=2", f"{AOR}.rollout.name=sglang"], None),
    "actor PP2×TP2, rollout TP2": (4, [*actor(tp=2, pp=2), f"{ROLLOUT_TP}=2", f"{AOR}.rollout.name=sglang"], None),
    "actor TP2×PP2×DP2, rollout TP1": (8, [*actor(tp=2, pp=2), "trainer.device=cuda"], None),
    "actor CP2×DP2, rollout TP1": (4, [*actor(cp=2), "trainer.device=cuda"], None),
    "2 nodes × 4, rollout TP4": (8, [*actor(tp=2), "trainer.nnodes=2", f"{ROLLOUT_TP}=4",
                                     f"{AOR}.rollout.name=sglang"], None),
    "README example (CPU, actor TP2, ref follows)": (2, [*actor(tp=2), f"{AOR}.actor.use_kl_loss=true",
                                                         "trainer.device=cpu"], None),
    "2 nodes × 4, rollout TP8 (spans nodes)": (8, [*actor(), "trainer.nnodes=2", f"{ROLLOUT_TP}=8",
                                                   f"{AOR}.rollout.name=sglang"], [ROLLOUT_TP]),
    "world 6, rollout TP4": (6, [*actor(), f"{ROLLOUT_TP}=4", f"{AOR}.rollout.name=sglang",
                                 "data.train_batch_size=6", f"{AOR}.actor.ppo_mini_batch_size=6"], [ROLLOUT_TP]),
    "hf engine, rollout TP2": (2, [*actor(), f"{ROLLOUT_TP}=2"], [ROLLOUT_TP]),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A model every layout splits (4 heads, 4 KV heads, 4 layers) and a data file."""
    tmp = tmp_path_factory.mktemp("placement")
    model = make_tiny_model(tmp / "model", hidden=32, layers=4, heads=4, kv_heads=4, max_positions=64)
    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    return {"model": model, "data": data, "tmp": tmp}


def overrides(run: dict[str, Path], extra: list[str]) -> list[str]:
    """8 prompts × 2 samples; one mini-batch; micro-batches of 2 samples (fits DP up to 8)."""
    return [f"{AOR}.model.path={run['model']}", f"data.train_files=[{run['data']}]", f"{AOR}.rollout.n=2",
            "data.train_batch_size=8", f"{AOR}.actor.ppo_mini_batch_size=8",
            f"{AOR}.actor.ppo_micro_batch_size_per_gpu=2", "data.max_prompt_length=16",
            "data.max_response_length=16", "trainer.total_training_steps=2", *extra]


def printed_engines(text: str) -> list[dict[str, object]]:
    return [{"ranks": json.loads(m[1]), "devices": m[2].split(", ")}
            for m in re.findall(r"^\s+engine (\d+): ranks (\[[\d, ]+\]) devices \[(.*)\]$", text, re.M)]


@pytest.mark.distributed
def test_started_engines_are_the_printed_ones(run: dict[str, Path], torchrun,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    by_world: dict[int, list[tuple[str, object]]] = {}
    printed: dict[str, list[dict[str, object]]] = {}
    for name, (world, extra, rejected_keys) in LAYOUTS.items():
        planning = "trainer.device=cpu" not in extra
        model_config = run["model"] / "config.json" if planning else None
        args = overrides(run, extra)
        code = validate_cli(args, world_size=world, model_config=model_config)
        out = capsys.readouterr()
        if rejected_keys is not None:
            assert code == 2, (name, out.out)
            with pytest.raises(ConfigError) as e:
                validate(compose_config(args), world_size=world, model_config=model_config)
            assert sorted({i.key for i in e.value.issues}) == rejected_keys, (name, str(e.value))
            continue
        assert code == 0, (name, out.err)
        printed[name] = printed_engines(out.out)
        plan = validate(compose_config(args), world_size=world, model_config=model_config)
        by_world.setdefault(world, []).append((name, plan))
    for world, plans in by_world.items():
        out_dir = run["tmp"] / f"world{world}"
        out_dir.mkdir()
        (out_dir / "plans.pkl").write_bytes(pickle.dumps(plans))
        torchrun([WORKER, str(out_dir / "plans.pkl"), str(out_dir)], nproc=world, timeout=240)
        reports = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
        for k, (name, plan) in enumerate(plans):
            started = [(r, *rep[k]["started"]) for r, rep in enumerate(reports) if rep[k]["started"]]
            # (leader rank, its device, TP size): what started == what was printed
            assert [(r, s["device"], s["tp_size"]) for r, s in started] == [
                (e["ranks"][0], e["devices"][0], len(e["ranks"])) for e in printed[name]], name
            assert all(len(e["devices"]) == len(e["ranks"]) for e in printed[name])
            asked = [p for _, s in started for p in s["asked"]]
            assert asked == list(range(plan.batch.prompts_per_step)), (name, asked)  # each prompt once
            n = plan.batch.n
            for r, rep in enumerate(reports):
                dp = plan.dp_rank_of(r)
                mine = plan.batch.dp_prompts(dp)
                assert rep[k]["got"] == [[p, j] for p in mine for j in range(n)], (name, r)
