"""``optim.override_optimizer_config``: one set of rules, checked without torch (static validation) and raised by the
runner; what they accept goes to Megatron's OptimizerConfig verbatim (verl's Qwen3-VL-8B script: CPU offload)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate
from hybridrl.megatron.optimizer_overrides import host_fraction, optimizer_config_notes, optimizer_config_problems

KEY = "actor_rollout_ref.actor.optim"
MKEY = "actor_rollout_ref.actor.megatron"
OVR = f"{KEY}.override_optimizer_config"
VERL = {"optimizer_offload_fraction": 1, "overlap_cpu_optimizer_d2h_h2d": True, "use_precision_aware_optimizer": True,
        "optimizer_cpu_offload": True}  # verl's run_qwen3_vl-8b-megatron.sh
QWEN7B = Path(__file__).resolve().parents[2] / "recipes" / "model_configs" / "qwen2.5-7b.json"


def problems(overrides: dict[str, Any], *, optimizer: str = "adam", distributed: bool = True,
             device: str | None = "cuda", te: bool | None = None) -> list[tuple[str, object, str]]:
    return optimizer_config_problems(optimizer, overrides, key=KEY, megatron_key=MKEY,
                                     distributed_optimizer=distributed, device_type=device, transformer_engine=te)


@pytest.mark.parametrize("overrides", [
    {}, VERL, {**VERL, "use_precision_aware_optimizer": False, "pin_cpu_grads": False, "pin_cpu_params": False},
    {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.25, "use_torch_optimizer_for_cpu_offload": True},
])
def test_verls_offload_settings_are_accepted_on_a_gpu(overrides: dict[str, Any]) -> None:
    assert problems(overrides) == []


def test_fields_hybridrl_sets_are_refused_naming_the_key_that_sets_them() -> None:
    got = {k: m for k, _, m in problems({"lr": 1e-5, "use_distributed_optimizer": True, "bf16": True, "adam_beta2": 0.9,
                                         "min_lr": 0.0})}
    assert got == {f"{OVR}.lr": f"set by {KEY}.lr, not here",
                   f"{OVR}.use_distributed_optimizer": f"set by {MKEY}.use_distributed_optimizer, not here",
                   f"{OVR}.bf16": f"set by {MKEY}.dtype, not here",
                   f"{OVR}.adam_beta2": f"set by {KEY}.adam_beta2, not here",
                   f"{OVR}.min_lr": f"set by {KEY}.lr_decay_style (hybridrl decays to 0), not here"}


@pytest.mark.parametrize(("overrides", "key", "words"), [
    ({"optimizer_offload_fraction": 1.5, "optimizer_cpu_offload": True}, f"{OVR}.optimizer_offload_fraction",
     "[0, 1]"),
    ({"optimizer_offload_fraction": True, "optimizer_cpu_offload": True}, f"{OVR}.optimizer_offload_fraction",
     "[0, 1]"),
    ({"optimizer_cpu_offload": "yes"}, f"{OVR}.optimizer_cpu_offload", "true or false"),
    ({"use_distributed_optimizer_typo": 1}, f"{OVR}.use_distributed_optimizer_typo", "optimizer_cpu_offload"),
    ({"store_param_remainders": False}, f"{OVR}.store_param_remainders", "not a supported override"),
])
def test_a_bad_value_or_an_unknown_field_is_named(overrides: dict[str, Any], key: str, words: str) -> None:
    ((k, value, message),) = problems(overrides)
    assert k == key and value == overrides[key.rsplit(".", 1)[1]] and words in message


def test_the_precision_aware_optimizer_needs_adam_the_distributed_optimizer_and_cuda_or_te() -> None:
    aware = {"use_precision_aware_optimizer": True}
    assert {k for k, _, _ in problems(aware, optimizer="sgd", distributed=False)} == {
        f"{KEY}.optimizer", f"{MKEY}.use_distributed_optimizer"}
    ((key, _, message),) = problems(aware, device="cpu")
    assert key == f"{OVR}.use_precision_aware_optimizer" and "CUDA" in message and "FusedAdam" in message
    ((key, _, message),) = problems(aware, te=False)
    assert key == f"{OVR}.use_precision_aware_optimizer" and "Transformer Engine" in message
    assert problems({**aware, "optimizer_cpu_offload": True}, te=False) == []  # the offload's optimizer instead
    assert problems(aware, te=None) == []  # a plan for another machine: its TE is not known here


def test_cpu_offload_is_refused_on_cpu_naming_the_upstream_reason() -> None:
    got = {k: m for k, _, m in problems(VERL, device="cpu")}
    assert set(got) == {f"{OVR}.optimizer_cpu_offload", f"{OVR}.use_precision_aware_optimizer"}
    assert "HybridDeviceOptimizer" in got[f"{OVR}.optimizer_cpu_offload"]
    assert problems({"optimizer_cpu_offload": False, "pin_cpu_grads": False}, device="cpu") == []


def test_the_offloads_settings_without_the_offload_are_a_note_and_the_fraction_counts_only_with_it() -> None:
    assert optimizer_config_notes(VERL, key=KEY) == []
    (note,) = optimizer_config_notes({"optimizer_offload_fraction": 0.5, "pin_cpu_grads": False}, key=KEY)
    assert note.startswith(f"{OVR}: optimizer_offload_fraction=0.5, pin_cpu_grads=False do nothing")
    assert host_fraction(VERL) == 1.0 and host_fraction({"optimizer_offload_fraction": 0.5}) == 0.0
    assert host_fraction({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 2}) == 0.0  # refused anyway


def test_validation_refuses_the_offload_on_a_cpu_run_and_plans_it_for_gpus() -> None:
    offload = [f"+{OVR}.{k}={v}" for k, v in VERL.items()] + [f"{MKEY}.use_distributed_optimizer=true",
                                                               f"{MKEY}.dtype=bfloat16"]
    with pytest.raises(ConfigError) as e:
        validate(compose_config(["recipe=grpo_qwen7b", "trainer.device=cpu", *offload]), model_config=QWEN7B)
    assert {i.key for i in e.value.issues} == {f"{OVR}.optimizer_cpu_offload", f"{OVR}.use_precision_aware_optimizer"}
    plan = validate(compose_config(["recipe=grpo_qwen7b", *offload]), model_config=QWEN7B)
    assert plan.memory is not None and plan.memory.host_fraction == 1.0 and plan.memory.optimizer == 0
    assert "in host memory, not counted" in plan.render()


def test_the_critics_optimizer_takes_the_same_key_and_rules() -> None:
    with pytest.raises(ConfigError) as e:
        validate(compose_config(["recipe=ppo_megatron_trainer", "actor_rollout_ref.model.path=/m",
                                 "actor_rollout_ref.rollout.name=vllm", "trainer.device_memory_gb=1000",
                                 f"{MKEY}.use_distributed_optimizer=false",
                                 "+critic.optim.override_optimizer_config.lr=1",
                                 "+critic.optim.override_optimizer_config.use_precision_aware_optimizer=true"]),
                 model_config=QWEN7B)
    got = {i.key: i.message for i in e.value.issues}
    assert got == {"critic.optim.override_optimizer_config.lr": "set by critic.optim.lr, not here",
                   f"{MKEY}.use_distributed_optimizer": "critic.optim.override_optimizer_config."
                   "use_precision_aware_optimizer=true needs Megatron's distributed optimizer: set it to true"}, got


def test_the_rules_import_neither_torch_nor_megatron() -> None:
    code = ("import sys; import hybridrl.megatron.optimizer_overrides; "
            "print([m for m in ('torch', 'megatron') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_runner_hands_the_overrides_to_megatrons_optimizer_config(tmp_path: Path) -> None:
    """On CPU: an accepted field reaches the OptimizerConfig Megatron's optimizer was built from; the offload itself
    is refused by the runner with validation's words, before Megatron's CUDA-only optimizer is constructed."""
    from hybridrl.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "m", hidden=32, layers=2, heads=4, kv_heads=2, max_positions=64)
    code = f"""
import pytest
from hybridrl.config.schema import MegatronConfig, OptimConfig
from hybridrl.megatron.parallel import ParallelConfig, init_parallel
from hybridrl.megatron.policy import MegatronPolicy
init_parallel(ParallelConfig())
given = dict(pin_cpu_grads=False, optimizer_offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=True)
policy = MegatronPolicy(model_dir={str(model)!r}, megatron=MegatronConfig(),
                        optim=OptimConfig(override_optimizer_config=given), total_steps=2, pad_token_id=0)
config = policy.optimizer.config
assert (config.pin_cpu_grads, config.optimizer_offload_fraction, config.overlap_cpu_optimizer_d2h_h2d) == \
    (False, 0.5, True), config
with pytest.raises(ValueError, match="optimizer_cpu_offload=True: needs CUDA"):
    MegatronPolicy(model_dir={str(model)!r}, megatron=MegatronConfig(),
                   optim=OptimConfig(override_optimizer_config=dict(optimizer_cpu_offload=True)), total_steps=2,
                   pad_token_id=0)
print("OK")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
