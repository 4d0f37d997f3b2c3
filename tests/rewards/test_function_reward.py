"""The ``function`` reward: a user's function from a module or a file, per sample or per batch; bad paths are
config errors naming ``reward.kwargs.path``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.registry import PluginConfigError, Registry
from hybridrl.rewards.function import FunctionReward

MakeBatch = Callable[..., RolloutBatch]  # the make_batch fixture of conftest.py

SAMPLE_FNS = """
calls = []

def exact(response, ground_truth, *, data_source, extra, prompt, bonus=0.0):
    calls.append((response, ground_truth, data_source, extra, prompt))
    return {"score": float(response == ground_truth) + bonus, "correct": response == ground_truth, "pred": response}

def length(response, ground_truth, *, data_source, extra, prompt):
    return len(response)

def fails(response, ground_truth, *, data_source, extra, prompt):
    if response == "b":
        raise KeyError("no b")
    return 1.0

def bad_return(response, ground_truth, *, data_source, extra, prompt):
    return "1.0"

def too_few(response):
    return 0.0

NOT_A_FUNCTION = 3
"""

BATCH_FNS = """
import torch
from hybridrl.interfaces import RewardOutput

def as_list(batch, tokenizer):
    return [float(m.sum()) for m in batch.response_mask]

def as_output(batch, tokenizer, scale=1.0):
    return RewardOutput(scores_B=scale * batch.response_mask.sum(-1).float(), info={"n": [1] * len(batch)})
"""


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module ``user_rewards_<id>`` (and the same code as a file, for the file tests)."""
    name = f"user_rewards_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(SAMPLE_FNS)
    (tmp_path / "batch_fns.py").write_text(BATCH_FNS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def build(tok: PreTrainedTokenizerBase, **kwargs: object) -> FunctionReward:
    reward = Registry("reward_managers").build("function", kwargs, key="reward.kwargs", tokenizer=tok)
    assert isinstance(reward, FunctionReward)
    return reward


def test_sample_function_from_a_module(module: str, tok: PreTrainedTokenizerBase, make_batch: MakeBatch) -> None:
    import importlib

    reward = build(tok, path=f"{module}:exact", fn_kwargs={"bonus": 0.5})
    batch = make_batch(["12<eos>", "7"], ["12", "8"])
    batch.meta[0] = SampleMeta(ground_truth="12", data_source="gsm8k", extra={"level": 3})
    out = reward(batch)
    assert out.scores_B.tolist() == [1.5, 0.5]
    assert out.correct_B is not None and out.correct_B.tolist() == [True, False]
    assert out.info == {"pred": ["12", "7"]}  # the response is decoded without special tokens
    calls = importlib.import_module(module).calls
    assert calls[0][2:4] == ("gsm8k", {"level": 3}) and isinstance(calls[0][4], str)  # data_source, extra, prompt


def test_sample_function_from_a_file(module: str, tmp_path: Path, tok: PreTrainedTokenizerBase,
                                     make_batch: MakeBatch) -> None:
    out = build(tok, path=f"{tmp_path / module}.py:length")(make_batch(["abc", "de<eos>"]))
    assert out.scores_B.tolist() == [3.0, 2.0] and out.correct_B is None  # ints are scores; no correctness


def test_a_failing_sample_is_named_and_a_bad_return_is_an_error(module: str, tok: PreTrainedTokenizerBase,
                                                                 make_batch: MakeBatch) -> None:
    with pytest.raises(KeyError) as e:
        build(tok, path=f"{module}:fails")(make_batch(["a", "b", "c"]))
    assert e.value.sample_index == 1  # type: ignore[attr-defined]  # the runner reports it
    with pytest.raises(TypeError, match=rf"{module}:bad_return returned str '1.0'; expected a number or a dict"):
        build(tok, path=f"{module}:bad_return")(make_batch(["a"]))


def test_batch_functions(module: str, tmp_path: Path, tok: PreTrainedTokenizerBase, make_batch: MakeBatch) -> None:
    batch = make_batch(["abc", "de"])
    out = build(tok, path="batch_fns:as_list", granularity="batch")(batch)
    assert out.scores_B.dtype == torch.float32 and out.scores_B.tolist() == [3.0, 2.0]
    out = build(tok, path=f"{tmp_path}/batch_fns.py:as_output", granularity="batch", fn_kwargs={"scale": 2.0})(batch)
    assert out.scores_B.tolist() == [6.0, 4.0] and out.info == {"n": [1, 1]}


@pytest.mark.parametrize(("path", "granularity", "message"), [
    ("no_colon", "sample", "reward.kwargs.path='no_colon': expected 'module.sub:function' or "
                           "'/path/to/file.py:function'"),
    ("/nowhere/r.py:f", "sample", "reward.kwargs.path='/nowhere/r.py:f': no such file '/nowhere/r.py'"),
    ("no_such_module_xyz:f", "sample", "reward.kwargs.path='no_such_module_xyz:f': importing the module "
                                       "'no_such_module_xyz' raised ModuleNotFoundError"),
    ("{m}:missing", "sample", "reward.kwargs.path='{m}:missing': '{m}' has no attribute 'missing'; its functions: "
                              "bad_return, exact, fails, length, too_few"),
    ("{m}:NOT_A_FUNCTION", "sample", "'{m}' has a non-callable int 'NOT_A_FUNCTION'"),
    ("{m}:too_few", "sample", "reward.kwargs.path='{m}:too_few': too_few(response) cannot be called as (response, "
                              "ground_truth, *, data_source, extra, prompt) (granularity='sample')"),
    ("{m}:exact", "batch", "exact(response, ground_truth, *, data_source, extra, prompt, bonus=0.0) cannot be called "
                           "as (batch, tokenizer) (granularity='batch')"),
])
def test_bad_paths_are_config_errors(module: str, tok: PreTrainedTokenizerBase, path: str, granularity: str,
                                     message: str) -> None:
    with pytest.raises(PluginConfigError) as e:
        Registry("reward_managers").make_config(
            "function", {"path": path.format(m=module), "granularity": granularity}, key="reward.kwargs")
    assert str(e.value).startswith("plugin 'function' at reward.kwargs: ")
    assert message.format(m=module) in str(e.value)


def test_a_file_that_fails_to_load_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import not_a_module_abc\n")
    with pytest.raises(PluginConfigError, match="loading the file .* raised ModuleNotFoundError: No module named "
                                                "'not_a_module_abc'"):
        Registry("reward_managers").make_config("function", {"path": f"{tmp_path}/broken.py:f"}, key="reward.kwargs")
