"""``actor_rollout_ref.actor.megatron.fused_lm_head``: the upstream gap it works around and its config checks.
That the RL step with it equals the plain one is tests/ops/test_policy_fused.py (TP=2, vocab padding) and
tests/parallel/test_rl_step_layouts.py ("lmhead": PP=2 with tied embeddings, CP=2)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate

A = "actor_rollout_ref"


def test_megatron_still_returns_only_logits() -> None:
    """Upstream: GPTModel.forward has no argument for the last stage's hidden states, so
    hybridrl/megatron/hidden_states.py flips its post_process flag; fails once such an argument exists."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    params = set(inspect.signature(GPTModel.forward).parameters)
    assert not {p for p in params if "hidden" in p and p != "hidden_states"}, params
    assert "post_process" in inspect.signature(GPTModel.__init__).parameters


def _validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> str:
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path))  # nothing built: model/data checks are pending
    return validate(compose_config(["recipe=grpo_tiny", f"{A}.actor.megatron.fused_lm_head=true", *overrides]),
                    world_size=2, before_bootstrap=True).render()


def test_config_accepts_it_with_the_fused_kernels_on_or_automatic(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _validate(tmp_path, monkeypatch)
    _validate(tmp_path, monkeypatch, f"{A}.actor.megatron.use_fused_kernels=true")


@pytest.mark.parametrize(("overrides", "says"), [
    ([f"{A}.actor.megatron.use_fused_kernels=false"], "use_fused_kernels=false"),
    ([f"{A}.{r}.megatron.{k}" for r in ("actor", "ref")
      for k in ("tensor_model_parallel_size=2", "sequence_parallel=true")], "sequence_parallel=true"),
])
def test_config_refuses_what_it_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str],
                                           says: str) -> None:
    with pytest.raises(ConfigError) as e:
        _validate(tmp_path, monkeypatch, *overrides)
    assert f"{A}.actor.megatron.fused_lm_head=True" in str(e.value) and says in str(e.value)
