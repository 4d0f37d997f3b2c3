"""Issue 40: a newcomer's first mistakes each get one clear line naming the file, row or key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.cli import main
from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError, DataError
from hybridrl.config.plugin_kwargs import resolve_plugin_kwargs
from hybridrl.config.validate import validate
from hybridrl.data.rows import read_rows
from hybridrl.models.tiny import make_tiny_model

AOR = "actor_rollout_ref"
MT = f"{AOR}.rollout.multi_turn"
REPO = Path(__file__).resolve().parents[2]
LATIN1 = '{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "caf\u00e9 1+2=", "ground_truth": "3"}\n'.encode(
    "latin-1")  # é at line 2, column 16


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    tmp = tmp_path_factory.mktemp("mistakes")
    model = make_tiny_model(tmp / "model", hidden=32, layers=2, heads=4, kv_heads=2, max_positions=512)
    return [f"{AOR}.model.path={model}", f"{AOR}.rollout.n=4", "data.train_batch_size=8",
            f"{AOR}.actor.ppo_mini_batch_size=4", f"{AOR}.actor.ppo_micro_batch_size_per_gpu=4",
            "data.max_prompt_length=32", "data.max_response_length=16", "trainer.total_training_steps=10"]


def problems(base: list[str], *overrides: str) -> list[str]:
    try:
        validate(compose_config([*base, *overrides]))
    except ConfigError as e:
        return [str(i) for i in e.issues]
    return []


def test_data_files_are_checked_before_anything_is_built(base: list[str], tmp_path: Path) -> None:
    """Schema and bytes, not rows: a non-UTF-8 jsonl (by line and column), an empty file, a missing prompt or
    ground-truth column (jsonl: its first row; parquet: its schema), a file that is not parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {"latin1.jsonl": LATIN1, "empty.jsonl": b"", "blank.jsonl": b"\n\n",
             "no_prompt.jsonl": b'{"question": "1+1=", "ground_truth": "2"}\n', "garbage.parquet": b"not parquet"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "ground_truth": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), tmp_path / "no_prompt.parquet")
    pq.write_table(pa.table({"prompt": ["1+1="], "reward_model": [{"ground_truth": "2"}]}), tmp_path / "nested.parquet")

    def only(name: str, *overrides: str) -> str:
        [found] = problems(base, f"data.train_files=[{tmp_path / name}]", *overrides)
        assert found.startswith(f"data.train_files[0]='{tmp_path / name}': "), found
        return found.split("': ", 1)[1]

    assert only("latin1.jsonl") == (f"line 2: not UTF-8 (byte 0xe9 at column 16; jsonl is UTF-8: re-encode the file, "
                                    f"e.g. iconv -f latin1 -t utf-8 {tmp_path / 'latin1.jsonl'} > "
                                    f"{tmp_path / 'latin1.utf8.jsonl'})")
    assert only("empty.jsonl") == "has no rows: the file is empty"
    assert only("blank.jsonl") == "has no rows: every line is blank"
    assert only("no_prompt.jsonl") == ("line 1, the first row, has no key 'prompt' (data.prompt_key); its keys: "
                                       "['ground_truth', 'question']")
    assert only("empty.parquet") == "has no rows (its columns: ['prompt', 'ground_truth'])"
    assert only("garbage.parquet").startswith("not a readable parquet file (ArrowInvalid: ")
    found = problems(base, f"data.train_files=[{tmp_path / 'no_prompt.parquet'}]")
    assert found == [f"data.train_files[0]='{tmp_path / 'no_prompt.parquet'}': has no column {k!r} ({key}); its "
                     "columns: ['question', 'answer']" for k, key in (("prompt", "data.prompt_key"),
                                                                       ("ground_truth", "data.ground_truth_key"))]
    assert problems(base, f"data.train_files=[{tmp_path / 'nested.parquet'}]",
                    "data.ground_truth_key=reward_model.ground_truth") == []  # a dotted key into a struct column
    assert "has no column 'reward_model.answer'" in only("nested.parquet", "data.ground_truth_key=reward_model.answer")
    # the command line says the same, naming the key, and no traceback
    code = main(["validate", *base, f"data.val_files=[{tmp_path / 'empty.jsonl'}]",
                 f"data.train_files=[{tmp_path / 'latin1.jsonl'}]"])
    assert code == 2


def test_a_non_utf8_jsonl_names_its_line_when_read(tmp_path: Path) -> None:
    """Reading rows (a run, ``hybridrl prepare jsonl``): a DataError naming the file, line and byte."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(LATIN1)
    with pytest.raises(DataError, match=rf"^{path} line 2: not UTF-8 \(byte 0xe9 at column 16; "):
        list(read_rows(path))
    r = subprocess.run([sys.executable, "-m", "hybridrl.cli", "prepare", "jsonl", str(tmp_path / "out"),
                        "--from", str(path), "--test-size", "1", "--question-key", "prompt",
                        "--answer-key", "ground_truth"],
                       capture_output=True, text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]  # after the progress bar
    assert r.returncode == 2 and last.startswith(f"hybridrl prepare: {path} line 2: not UTF-8 (byte 0xe9 "), r.stderr


def test_multi_turn_settings_with_multi_turn_off_are_refused_naming_both_keys(base: list[str],
                                                                               tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    found = problems(base, f"data.train_files=[{data}]", f"{MT}.environment=openai_agent",
                     f"+{MT}.environment_kwargs.command=[python,agent.py]")
    assert found == [f"{MT}.enable=False: but {MT}.environment='openai_agent', {MT}.environment_kwargs={{'command': "
                     f"['python', 'agent.py']}} are settings of the multi-turn rollout, which is off (no tool or "
                     f"environment would run; their rewards would be 0): set {MT}.enable=true, or drop them"]
    [one] = problems(base, f"data.train_files=[{data}]", f"{MT}.tools=[calculator]")
    assert one.startswith(f"{MT}.enable=False: but {MT}.tools=['calculator'] is a setting of the multi-turn")
    assert problems(base, f"data.train_files=[{data}]", f"{MT}.enable=true", f"{MT}.tools=[calculator]") == []
    # a multi-turn recipe's limits, timeouts and format are harmless with it off: only a chosen plugin is refused
    assert problems(base, f"data.train_files=[{data}]", f"{MT}.max_assistant_turns=3", f"{MT}.tool_timeout_s=5",
                    f"{MT}.format=hermes") == []


def test_swapping_a_plugin_by_its_key_leaves_the_recipes_kwargs_with_their_plugin() -> None:
    """The recipe's kwargs are per plugin: another environment / estimator gets none of them; flat keys (verl's
    ``+reward.kwargs.x=``) are the chosen plugin's and win over its block; unlisted tools' kwargs are dropped."""
    cfg = compose_config(["recipe=grpo_multiturn_tiny", f"{MT}.environment=openai_agent",
                          f"+{MT}.environment_kwargs.command=[python,my_agent.py]"])
    resolve_plugin_kwargs(cfg)
    assert cfg.actor_rollout_ref.rollout.multi_turn.environment_kwargs == {"command": ["python", "my_agent.py"]}
    kept = compose_config(["recipe=grpo_multiturn_tiny", f"{MT}.tools=[python]",
                           f"+{MT}.tool_kwargs.calculator.max_digits=9", f"+{MT}.tool_kwargs.python.timeout_s=2"])
    resolve_plugin_kwargs(kept)
    resolve_plugin_kwargs(kept)  # idempotent: validation runs twice in a run
    m = kept.actor_rollout_ref.rollout.multi_turn
    assert m.environment_kwargs == {"max_tries": 2} and m.tool_kwargs == {"python": {"timeout_s": 2}}
    ppo = compose_config(["recipe=ppo_tiny", "algorithm.adv_estimator=reinforce_pp"])
    resolve_plugin_kwargs(ppo)
    assert ppo.algorithm.adv_estimator_kwargs == {}
    gae = compose_config(["recipe=ppo_tiny", "+algorithm.adv_estimator_kwargs.lam=0.9"])
    resolve_plugin_kwargs(gae)
    assert gae.algorithm.adv_estimator_kwargs == {"gamma": 1.0, "lam": 0.9}


def run_train(args: list[str], *, torchrun: int | None = None, debug: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDRL_DEBUG"}
    if debug:
        env["HYBRIDRL_DEBUG"] = "1"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun)] if torchrun \
        else [sys.executable]
    return subprocess.run([*launcher, str(REPO / "launch" / "train.py"), *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=REPO)


@pytest.mark.slow
def test_a_config_error_ends_the_run_in_one_line_and_debug_keeps_the_traceback(tmp_path: Path) -> None:
    bad = ["recipe=grpo_tiny", f"{MT}.environment=arithmetic_feedback", f"trainer.output_dir={tmp_path}"]
    r = run_train(bad)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"  - {MT}.enable=False: but {MT}.environment="), r.stderr
    r = run_train(bad, debug=True)
    assert r.returncode == 1 and "Traceback" in r.stderr and "hybridrl.config.errors.ConfigError" in r.stderr


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [None, 2])
def test_a_prompt_too_long_at_run_time_ends_the_run_with_its_line(tmp_path: Path, ranks: int | None) -> None:
    """What only reading rows finds (a prompt over data.max_prompt_length with data.truncation=error): the message
    is the last thing the rank prints, no traceback; under torchrun it is the last line of torchrun's summary too."""
    model = make_tiny_model(tmp_path / "model", hidden=32, layers=2, heads=4, kv_heads=2, max_positions=512)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "ground_truth": "2"}) + "\n" for p in ["1+1="] * 3 + ["9" * 40]))
    r = run_train([f"{AOR}.model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]",
                   "data.max_prompt_length=16", "data.apply_chat_template=false", "data.filter_overlong_prompts=false",
                   "data.truncation=error",
                   "data.train_batch_size=2", f"{AOR}.rollout.n=2", f"{AOR}.actor.ppo_mini_batch_size=2",
                   f"{AOR}.actor.ppo_micro_batch_size_per_gpu=2", "trainer.total_training_steps=1",
                   "trainer.device=cpu", "trainer.logger=[console]", f"trainer.output_dir={tmp_path / 'out'}",
                   "actor_rollout_ref.model.build_if_missing=null", "data.build_if_missing=null",
                   f"trainer.n_gpus_per_node={ranks or 1}"], torchrun=ranks)
    line = f"hybridrl: {data} row 3: the prompt has"
    lines = r.stderr.strip().splitlines()
    frames = [x for x in lines if x.strip().startswith("File ") and ("hybridrl/" in x or "launch/" in x)]
    assert r.returncode != 0 and "[rank" not in r.stderr and not frames, r.stderr[-3000:]
    if ranks is None:
        assert r.returncode == 2 and lines[-1].startswith(line), r.stderr[-3000:]
        assert "data.truncation=error; set data.filter_overlong_prompts=true" in lines[-1]
    else:  # torchrun's own summary comes after: its root cause's "traceback :" line is ours, then its border
        assert sum(x.startswith(line) for x in lines) == 1, r.stderr[-3000:]
        assert lines[-2].strip().startswith(f"traceback : {line}") and set(lines[-1]) == {"="}, r.stderr[-3000:]


def test_a_refused_sample_count_is_not_used_in_the_same_report(base: list[str], tmp_path: Path) -> None:
    """``rollout.n=0`` is refused, and no follow-on line does batch arithmetic with a stand-in n=1 (it said "32
    prompts × rollout.n=1 = 32 samples must split into micro-batches of 64")."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    found = problems(base, f"data.train_files=[{data}]", f"{AOR}.rollout.n=0",
                     f"{AOR}.actor.ppo_micro_batch_size_per_gpu=8")
    assert f"{AOR}.rollout.n=0: must be ≥ 1" in found
    assert not any("rollout.n=1" in line for line in found), found
