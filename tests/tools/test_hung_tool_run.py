"""A real multi-turn run (launch/train.py under torchrun, hf engine) whose only tool, a third party's installed as a
package would be, never returns: every call is answered "took longer than" at ``multi_turn.tool_timeout_s=3`` and
counted, and the run goes on. Up to 64 hung calls over 2 steps on a tool runner of 32 workers: before the fix each call
kept its worker for good and the run stalled for good once 32 had hung (in the second step).

The policy is a tiny random model taught in a few seconds (teacher forcing, below) to answer every turn with the
call ``<tool_call>{"name": "h"}</tool_call>``: 16 episodes a step, each calling twice (the third and last turn's
call is not run), so up to 32 calls a step. Time: ~60 s on 2 cores: ~20 s teaching the model, a launch of ~30 s
(4 rounds of a 3 s timeout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.plugins import installed_plugin

from hybridrl.bootstrap import write_arithmetic_task
from hybridrl.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3
CALL = '<tool_call>{"name": "h"}</tool_call>'

HANG_TOOL = """
import time
from dataclasses import dataclass
from typing import Any, ClassVar


class Hang:
    @dataclass(kw_only=True, slots=True)
    class Config:
        pass

    schema: ClassVar[dict[str, Any]] = {"type": "function", "function": {
        "name": "h", "description": "never returns", "parameters": {"type": "object", "properties": {}}}}

    def __init__(self, config=None, **ctx):
        pass

    def __call__(self, arguments):
        time.sleep(10**6)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed_plugin(tmp_path_factory.mktemp("hang_tool"), "hang_tool", "hybridrl.tools",
                            {"hang": "hang_tool:Hang"}, HANG_TOOL)


def caller(model_dir: Path, prompts: list[str]) -> Path:
    """Teach the model at ``model_dir`` to answer the first and the later turns of an episode with :data:`CALL`
    (the loss on the call's ids alone, the contexts as the rollout renders them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    target = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rows = []
    for p in prompts:
        first = [{"role": "user", "content": p}]
        later = [*first, {"role": "assistant", "content": CALL},
                 {"role": "tool", "content": f"Error: tool 'h' took longer than {TIMEOUT_S} s"}]
        for messages in (first, later):
            context = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(context, add_special_tokens=False)["input_ids"]
            rows.append((ids + target, [-100] * len(ids) + target))
    width = max(len(ids) for ids, _ in rows)
    ids_BT = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in rows])
    labels_BT = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask_BT = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 threads on 2 shared cores: several times slower
    try:
        for _ in range(200):
            loss = model(input_ids=ids_BT, attention_mask=mask_BT, labels=labels_BT).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 2e-3:
                break
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 0.01, loss.item()  # every id of the call nearly certain at temperature 1
    model.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import pandas as pd

    tmp = tmp_path_factory.mktemp("hung_tool_run")
    make_tiny_model(tmp / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=512)
    write_arithmetic_task(tmp / "train.parquet")
    torch.manual_seed(0)
    caller(tmp / "model", list(pd.read_parquet(tmp / "train.parquet")["prompt"][:8]))
    return tmp


@pytest.mark.distributed
def test_a_tool_that_never_returns_costs_its_timeout_and_the_run_goes_on(run_dir: Path, site: Path) -> None:
    out = run_dir / "out"
    mt = "actor_rollout_ref.rollout.multi_turn"
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}", str(REPO / "launch" / "train.py"), "recipe=grpo_tiny",
            f"actor_rollout_ref.model.path={run_dir / 'model'}", "actor_rollout_ref.model.build_if_missing=null",
            f"data.train_files=[{run_dir / 'train.parquet'}]", "data.val_files=[]", "data.build_if_missing=null",
            "data.apply_chat_template=true", "data.max_prompt_length=32", "data.max_response_length=256",
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "trainer.total_training_steps=2",
            "trainer.test_freq=0", "trainer.val_before_train=false", "reward.name=keyword",
            "+reward.kwargs.keywords=[h]", "actor_rollout_ref.rollout.temperature=0.2",  # the call, rarely garbled
            f"{mt}.enable=true", f"{mt}.tools=[hang]", f"{mt}.max_assistant_turns=3",
            f"{mt}.tool_timeout_s={TIMEOUT_S}", f"trainer.output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    print(f"2 steps with a tool that never returns (timeout {TIMEOUT_S} s): {took:.0f} s in all, steps "
          f"{[round(r['timing/step'], 1) for r in steps]} s, timeouts "
          f"{[r['multi_turn/tool_timeouts'] for r in steps]} of {[r['multi_turn/tool_calls'] for r in steps]} calls")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # every call an error; nearly all of them the hung tool's (a sampled call may come out garbled)
        assert r["multi_turn/tool_errors"] == r["multi_turn/tool_calls"] < 2 * r["multi_turn/tool_timeouts"], r
        assert r["multi_turn/turns_mean"] > 2, r
        # two rounds of calls, each answered at its limit: the timeouts, not the hung threads, set the pace
        assert 2 * TIMEOUT_S <= r["timing/step"] < 2 * TIMEOUT_S + 60, r
    assert sum(r["multi_turn/tool_timeouts"] for r in steps) > 32  # more hung calls than the runner's 32 workers


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
