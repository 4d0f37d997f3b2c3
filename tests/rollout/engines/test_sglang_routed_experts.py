"""The sglang engine's R3 rows (GPU only: an MoE model is refused on CPU, so the engine is not started here).

SGLang returns a finished sample's routing as ``meta_info["routed_experts"]``: base64 of an int32
``[prompt + output − 1, num_hidden_layers, top-k]`` tensor's bytes (``DetokenizerManager._b64_encode_per_request``
of ``RoutedExpertsCapturer.get_topk``'s rows). The rows here are made the same way and become
``Generation.routed_experts`` — int16, the MoE layers only — and a wrong size is an error, not a misaligned replay.
"""

from __future__ import annotations

import json
from pathlib import Path

import pybase64
import pytest
import torch

from hybridrl.cli import main
from hybridrl.config import check_rollout
from hybridrl.rollout.engines import sglang_compat
from hybridrl.rollout.engines.routed_rows import moe_layers
from hybridrl.rollout.engines.sglang import SGLangEngineError, SGLangRolloutEngine

AOR = "actor_rollout_ref"
REPO = Path(__file__).resolve().parents[3]
A3B = str(REPO / "recipes" / "model_configs" / "qwen3-30b-a3b.json")
NO_RECOMPUTE = [f"~{AOR}.actor.megatron.override_transformer_config.{k}"
                for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")]


def engine(layers: list[int], top_k: int, **config: object) -> SGLangRolloutEngine:
    e = object.__new__(SGLangRolloutEngine)  # the conversion reads only the MoE layers and their top-k
    e.config = SGLangRolloutEngine.Config(**config)  # type: ignore[arg-type]
    e.moe_layers, e.routed_top_k = layers, top_k
    e.describe = lambda: "test"  # type: ignore[method-assign]
    return e


def sglang_encoded(rows: torch.Tensor) -> str:
    """As SGLang 0.5.21's detokenizer sends a request's routed experts."""
    return pybase64.b64encode(rows.to(torch.int32).numpy().tobytes()).decode("utf-8")


def test_every_layers_rows_become_the_moe_layers_int16_rows() -> None:
    rows = torch.arange(5 * 4 * 2, dtype=torch.int32).reshape(5, 4, 2)  # 5 positions, 4 decoder layers, top-2
    out = engine([0, 1, 2, 3], 2)._routed_experts(sglang_encoded(rows), positions=5)
    assert out.dtype == torch.int16 and torch.equal(out, rows.to(torch.int16))
    dense_first = engine([1, 3], 2)._routed_experts(sglang_encoded(rows), positions=5)  # layers 0, 2 dense
    assert torch.equal(dense_first, rows[:, [1, 3]].to(torch.int16))
    moe_only = rows[:, :2]  # an engine that sends the MoE layers' rows alone: kept as they are
    assert torch.equal(engine([1, 3], 2)._routed_experts(sglang_encoded(moe_only), positions=5),
                       moe_only.to(torch.int16))


def test_misaligned_rows_are_refused() -> None:
    rows = torch.zeros(4, 2, 2, dtype=torch.int32)
    with pytest.raises(SGLangEngineError, match=r"hold 16 values; expected \[5 positions .*top-2\]"):
        engine([0, 1], 2)._routed_experts(sglang_encoded(rows), positions=5)
    with pytest.raises(SGLangEngineError, match=r"SGLang's routed experts cover 2 layers; the model's MoE layers "
                                                r"are \[1, 3, 5\]"):
        engine([1, 3, 5], 2)._routed_experts(sglang_encoded(rows), positions=4)
    with pytest.raises(SGLangEngineError, match=r"hold 0 values; expected \[3 positions"):
        engine([0], 2)._routed_experts(sglang_encoded(torch.zeros(0)), positions=3)
    with pytest.raises(SGLangEngineError, match="no routed experts for a finished sample"):
        engine([0], 2)._routed_experts(None, positions=4)


def test_a_finished_sample_carries_its_rows_and_an_aborted_one_none() -> None:
    e = engine([0, 1], 2)
    e.version, e._abort = 0, type("Flag", (), {"is_set": lambda self: True})()
    rows = torch.randint(0, 8, (3 + 2 - 1, 2, 2), dtype=torch.int32)
    meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-0.5, 7, None), (-0.25, 8, None)],
            "weight_version": "0", "routed_experts": sglang_encoded(rows)}
    made = e._generation(0, {"output_ids": [7, 8], "meta_info": meta}, routed_prompt_len=3)
    assert torch.equal(made.routed_experts, rows.to(torch.int16))
    aborted = e._generation(0, {"output_ids": [7, 8], "meta_info": meta | {"finish_reason": {"type": "abort"},
                                                                            "routed_experts": None}}, 3)
    assert aborted.finish_reason == "abort" and aborted.routed_experts is None


def test_moe_layers_of_both_layouts(tmp_path: Path) -> None:
    config = json.loads((REPO / "tests" / "gpu" / "tiny-qwen3-moe.json").read_text())
    for name, mlp_only, want in [("all", [], [0, 1, 2, 3]), ("dense_first", [0, 2], [1, 3])]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config | {"mlp_only_layers": mlp_only}))
        assert moe_layers(str(tmp_path / name), error=SGLangEngineError) == want


def test_the_server_records_routing_only_when_asked() -> None:
    def args(**config: object) -> dict[str, object]:
        e = engine([0], 2, **config)
        e.device, e.model_path, e.tp_size, e.gpu_memory_utilization = torch.device("cuda", 0), "m", 1, 0.5
        e.memory_saver = True
        return e._server_args()

    assert args(return_routed_experts=True)["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in args()


def test_r3_with_sglang_validates_on_a_gpu_and_is_refused_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """R3 turns the engine's return_routed_experts on (derived.py); a GPU plan validates; on CPU the refusal says
    why (SGLang's CPU MoE path, sglang_compat item 10) before any model exists."""
    key = f"{AOR}.actor.router_replay.mode"
    capsys.readouterr()
    code = main(["validate", "recipe=grpo_qwen3_30b_a3b", "--model-config", A3B, f"{key}=R3",
                 f"{AOR}.rollout.name=sglang", *NO_RECOMPUTE])
    assert code == 0, capsys.readouterr().err
    code = main(["validate", "recipe=grpo_moe_tiny", f"{AOR}.rollout.name=sglang"])  # the recipe's R3, on CPU
    err = capsys.readouterr().err
    assert code == 2 and sglang_compat.ROUTED_EXPERTS_CPU in err, err
    with pytest.raises(ValueError, match="needs a GPU with sglang"):
        SGLangRolloutEngine.plan_notes(SGLangRolloutEngine.Config(return_routed_experts=True), device_type="cpu")


def test_an_engine_without_routing_is_refused_under_r3(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    class NoRouting:  # a third-party engine that records no routing
        supports_routed_experts = False

    monkeypatch.setattr(check_rollout, "engine_class", lambda name: NoRouting)
    capsys.readouterr()
    code = main(["validate", "recipe=grpo_qwen3_30b_a3b", "--model-config", A3B,
                 f"{AOR}.actor.router_replay.mode=R3", *NO_RECOMPUTE])
    err = capsys.readouterr().err
    assert code == 2 and "does not return the experts it routed" in err and "use hf, vllm or sglang" in err, err
