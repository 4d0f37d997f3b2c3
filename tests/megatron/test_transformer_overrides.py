"""``megatron.dtype`` and ``megatron.override_transformer_config``: one set of rules, checked without torch
(static validation) and raised by the model builder; what they accept, Megatron's TransformerConfig builds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridrl.megatron.transformer_overrides import megatron_config_notes, megatron_config_problems
from hybridrl.models.tiny import make_tiny_model

KEY = "actor_rollout_ref.actor.megatron"
OVR = f"{KEY}.override_transformer_config"

VALID: list[dict[str, Any]] = [
    {},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
    {"recompute_granularity": "selective"},
    {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
    {"recompute_granularity": None},
    {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001},  # verl's MoE scripts' router losses
    {"moe_aux_loss_coeff": 0.0, "moe_router_load_balancing_type": "seq_aux_loss", "moe_z_loss_coeff": None},
    {"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True},  # verl's, on a dense model: nothing to dispatch
    {"moe_token_dispatcher_type": "allgather", "moe_enable_deepep": False},
]
INVALID: list[tuple[dict[str, Any], list[str]]] = [  # overrides, the keys of their problems
    ({"recompute_granularity": "full"}, [f"{OVR}.recompute_method", f"{OVR}.recompute_num_layers"]),
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 0},
     [f"{OVR}.recompute_num_layers"]),
    ({"recompute_granularity": "full", "recompute_method": "random", "recompute_num_layers": 1},
     [f"{OVR}.recompute_method"]),
    ({"recompute_granularity": "partial"}, [f"{OVR}.recompute_granularity"]),
    ({"recompute_granularity": "selective", "recompute_num_layers": 1}, [f"{OVR}.recompute_num_layers"]),
    ({"recompute_granularity": "selective", "recompute_modules": ["layernorm"]}, [f"{OVR}.recompute_modules"]),
    ({"recompute_method": "uniform", "recompute_num_layers": 1},  # Megatron would silently not recompute
     [f"{OVR}.recompute_method", f"{OVR}.recompute_num_layers"]),
    ({"recompute_modules": ["mlp"]}, [f"{OVR}.recompute_modules"]),
    ({"recompute_granuarlity": "full"}, [f"{OVR}.recompute_granuarlity"]),  # a typo: unknown key
    ({"tensor_model_parallel_size": 2, "bf16": True}, [f"{OVR}.tensor_model_parallel_size", f"{OVR}.bf16"]),
    ({"moe_aux_loss_coeff": -0.1, "moe_z_loss_coeff": "1e-3"},
     [f"{OVR}.moe_aux_loss_coeff", f"{OVR}.moe_z_loss_coeff"]),
    ({"moe_router_load_balancing_type": "sinkhorn"}, [f"{OVR}.moe_router_load_balancing_type"]),
    ({"moe_token_dispatcher_type": "all2all"}, [f"{OVR}.moe_token_dispatcher_type"]),
    ({"moe_enable_deepep": True}, [f"{OVR}.moe_enable_deepep"]),  # Megatron: DeepEP under flex only, any model
    ({"moe_enable_deepep": "yes", "moe_token_dispatcher_type": "flex"}, [f"{OVR}.moe_enable_deepep"]),
]


@pytest.mark.parametrize("overrides", VALID)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_valid_settings_have_no_problems(dtype: str, overrides: dict[str, Any]) -> None:
    assert megatron_config_problems(dtype, overrides, key=KEY) == []


@pytest.mark.parametrize(("overrides", "keys"), INVALID)
def test_each_invalid_override_is_named(overrides: dict[str, Any], keys: list[str]) -> None:
    problems = megatron_config_problems("float32", overrides, key=KEY)
    assert [k for k, _, _ in problems] == keys
    assert all(message for _, _, message in problems)


def test_unknown_dtype_lists_the_valid_ones() -> None:
    assert megatron_config_problems("fp8", {}, key=KEY) == [
        (f"{KEY}.dtype", "fp8", "valid: float32, bfloat16, float16")]


def test_owned_keys_say_where_to_set_them() -> None:
    (problem,) = megatron_config_problems("float32", {"params_dtype": "bfloat16"}, key=KEY)
    assert problem == (f"{OVR}.params_dtype", "bfloat16", "set by megatron.dtype, not here")


def test_an_moe_models_dispatcher_must_run_on_the_device_and_a_dense_models_is_a_note() -> None:
    flex = {"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True}
    for dispatcher in ("alltoall", "flex"):
        ((key, value, message),) = megatron_config_problems("float32", {"moe_token_dispatcher_type": dispatcher},
                                                            key=KEY, moe=True, device_type="cpu", deep_ep=False)
        assert (key, value) == (f"{OVR}.moe_token_dispatcher_type", dispatcher) and "needs CUDA" in message
    ((key, _, message),) = megatron_config_problems("bfloat16", flex, key=KEY, moe=True, device_type="cuda",
                                                    deep_ep=False)
    assert key == f"{OVR}.moe_token_dispatcher_type" and "deep_ep" in message
    for moe, device in ((False, "cpu"), (True, "cuda")):  # a dense model; a plan for GPUs (deep_ep not known)
        assert megatron_config_problems("bfloat16", flex, key=KEY, moe=moe, device_type=device, deep_ep=None) == []
    assert megatron_config_problems("float32", {"moe_token_dispatcher_type": "allgather"}, key=KEY, moe=True,
                                    device_type="cpu", deep_ep=False) == []
    (dense,) = megatron_config_notes(flex, key=KEY, moe=False, deep_ep=None)
    assert dense == (f"{OVR}: moe_token_dispatcher_type=flex, moe_enable_deepep=True do nothing: the model is dense "
                     "(no MoE layer to dispatch tokens to)")
    (planned,) = megatron_config_notes(flex, key=KEY, moe=True, deep_ep=None)
    assert "deep_ep" in planned
    assert megatron_config_notes(flex, key=KEY, moe=True, deep_ep=True) == []
    assert megatron_config_notes({}, key=KEY, moe=False, deep_ep=None) == []


def test_an_moe_model_is_built_with_the_configured_dispatcher(tmp_path: Path) -> None:
    from hybridrl.hf.arch import HFArch
    from hybridrl.megatron.model import transformer_config
    from hybridrl.megatron.parallel import ParallelConfig

    moe = HFArch.from_hf(make_tiny_model(tmp_path / "moe", arch="qwen3_moe", layers=2, moe=dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)))
    config = transformer_config(moe, ParallelConfig(), overrides={"moe_token_dispatcher_type": "allgather"})
    assert config.moe_token_dispatcher_type == "allgather"
    with pytest.raises(ValueError, match="megatron.override_transformer_config.moe_token_dispatcher_type='alltoall': "
                                         "needs CUDA"):
        transformer_config(moe, ParallelConfig(), overrides={"moe_token_dispatcher_type": "alltoall"})


def test_rules_import_neither_torch_nor_megatron() -> None:
    code = ("import sys; import hybridrl.megatron.transformer_overrides; "
            "print([m for m in ('torch', 'megatron') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def arch(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from hybridrl.hf.arch import HFArch

    return HFArch.from_hf(make_tiny_model(tmp_path_factory.mktemp("overrides") / "model", layers=4))


@pytest.mark.parametrize("overrides", VALID)
def test_megatron_builds_what_the_rules_accept(arch: Any, overrides: dict[str, Any]) -> None:
    import torch

    from hybridrl.megatron.model import transformer_config
    from hybridrl.megatron.parallel import ParallelConfig

    config = transformer_config(arch, ParallelConfig(), dtype="bfloat16", overrides=overrides)
    assert (config.bf16, config.fp16, config.params_dtype) == (True, False, torch.bfloat16)
    for name, value in overrides.items():
        assert getattr(config, name) == value


@pytest.mark.parametrize(("overrides", "keys"), INVALID)
def test_the_builder_raises_the_same_problems(arch: Any, overrides: dict[str, Any], keys: list[str]) -> None:
    from hybridrl.megatron.model import transformer_config
    from hybridrl.megatron.parallel import ParallelConfig

    with pytest.raises(ValueError) as e:
        transformer_config(arch, ParallelConfig(), overrides=overrides)
    for key in keys:
        assert key.replace(KEY, "megatron") in str(e.value)


def test_layernorm_recompute_still_fails_without_transformer_engine() -> None:
    """Why ``layernorm`` is not a valid recompute module: megatron-core 0.16.1's ``CheckpointWithoutOutput``
    takes ``fp8=False`` for "fp8 on" and then needs Transformer Engine. When this fails, allow it."""
    import torch
    from megatron.core import tensor_parallel

    from hybridrl.megatron.cpu import apply_cpu_adaptations
    from hybridrl.megatron.model import use_transformer_engine

    if use_transformer_engine():
        pytest.skip("Transformer Engine is installed")
    apply_cpu_adaptations()  # the RNG states it saves first
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(NameError, match="FP8GlobalStateManager"):
        tensor_parallel.CheckpointWithoutOutput().checkpoint(lambda t: t * 2, x)
