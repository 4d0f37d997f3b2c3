"""Multi-turn GRPO on images end to end (issue 46): a tiny random Qwen2.5-VL calls ``image_zoom_in`` on the dots
task's image, the crop comes back as an image in the tool message, the next turn is sampled by the ``hf`` engine with
the prompt's image and the crop, and the actor — which reads the crop's placeholders in the response as an image —
computes the engine's log-probs of every sampled token (``rollout/logprob_abs_diff`` ≤ 1e-5).

A random policy does not call tools, so the engine here is the ``hf`` engine with a first turn written for it: a
third party's engine (installed as a package would be, :mod:`support.plugins`) whose first turn of each episode is
:data:`CALL`, teacher-forced, with the model's own log-probs of it given the prompt and its image (transformers'
forward); every later turn is the ``hf`` engine's own sampling. The actor's log-probs of the forced turn test its
prompt image, those of the second turn its tool image."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.e2e import TRAIN, read_metrics
from support.plugins import installed_plugin

from hybridrl.data.dots import DotsTaskConfig, write_dots_splits
from hybridrl.models.tiny import TinyModelSpec
from hybridrl.models.tiny_vlm import make_tiny_vlm

CALL = '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 56, 28]}}</tool_call>'

ZOOM_FIRST = f'''
import torch
from hybridrl.interfaces import Generation
from hybridrl.rollout.engines.hf import HFRolloutEngine

CALL = {CALL!r}


class ZoomFirst(HFRolloutEngine):
    """The hf engine, whose first turn of an episode (a context without a tool message) is CALL, teacher-forced."""

    @torch.no_grad()
    def generate(self, prompts, params, *, seeds=None, max_new_tokens=None, images=None):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model_path)
        tool = tok("<|im_start|>tool", add_special_tokens=False)["input_ids"]
        first = [i for i, p in enumerate(prompts)
                 if not any(p[k:k + len(tool)] == tool for k in range(len(p)))]
        rest = [i for i in range(len(prompts)) if i not in first]
        out = {{}}
        if rest:
            caps = None if max_new_tokens is None else [max_new_tokens[i] for i in rest]
            gens = super().generate([prompts[i] for i in rest], params, seeds=[seeds[i] for i in rest],
                                    max_new_tokens=caps, images=None if images is None else [images[i] for i in rest])
            for g in gens:
                g.prompt_index = rest[g.prompt_index]
                out[g.prompt_index] = g
        call = [*tok(CALL, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        for i in first:
            cap = params.max_new_tokens if max_new_tokens is None else max_new_tokens[i]
            ids = call[:cap]
            x = images[i] if images is not None else None
            row = torch.tensor([prompts[i] + ids])
            # the token types mark the images (transformers 5 reads the prompt as text without them)
            kw = {{}} if x is None else {{"pixel_values": x.pixel_values, "image_grid_thw": x.image_grid_thw,
                                        "mm_token_type_ids": (row == self.vision.image_token_id).int()}}
            logits = self.model(input_ids=row, **kw).logits[0].float()
            logits = logits[len(prompts[i]) - 1:-1] / (params.temperature or 1.0)
            logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()
            out[i] = Generation(prompt_index=i, token_ids=ids, logprobs=logprobs, weight_version=self.version,
                                finish_reason="stop" if len(ids) == len(call) else "length")
        return [out[i] for i in range(len(prompts))]
'''


@pytest.fixture(scope="module")
def vlm_task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("grpo_vlm_mt")
    model = make_tiny_vlm(tmp / "model", text=TinyModelSpec(hidden=64, layers=2, heads=2, kv_heads=2, seed=4))
    data = write_dots_splits(tmp / "dots", DotsTaskConfig(num_train=32, num_test=16, seed=3))
    site = installed_plugin(tmp / "plugin", "zoom_first_engine", "hybridrl.rollout_engines",
                            {"zoom_first": "zoom_first_engine:ZoomFirst"}, ZOOM_FIRST)
    return {"model": model, "site": site, **data}


@pytest.mark.e2e
def test_multi_turn_grpo_with_tool_images_keeps_engine_and_actor_equal(
        torchrun, vlm_task: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two steps of 8 prompts × 4 episodes of 2 turns (the zoom call, then a sampled answer seeing the crop), and an
    evaluation: every episode calls the tool and gets its image, and engine and actor log-probs agree at both steps
    (after an update too). ~40 s on 2 cores."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(vlm_task["site"]),
                                                                   os.environ.get("PYTHONPATH")])))
    out = tmp_path / "run"
    t = vlm_task
    torchrun([TRAIN, "recipe=grpo_vlm_tiny", f"actor_rollout_ref.model.path={t['model']}",
              "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{t['train']}]",
              f"data.val_files=[{t['test']}]", "data.build_if_missing=null", f"trainer.output_dir={out}",
              "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
              "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.entropy_coeff=0.01",
              "actor_rollout_ref.actor.freeze_vision_tower=false",
              "data.val_batch_size=16", "trainer.total_training_steps=2", "trainer.test_freq=2",
              "actor_rollout_ref.rollout.name=zoom_first", "data.max_response_length=256",
              "actor_rollout_ref.rollout.multi_turn.enable=true",
              "actor_rollout_ref.rollout.multi_turn.tools=[image_zoom_in]",
              "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"], nproc=1)
    rows = [r for r in read_metrics(out) if "rollout/logprob_abs_diff" in r]
    assert len(rows) == 2 and rows[0]["actor/grad_norm"] > 0
    for r in rows:
        assert r["multi_turn/tool_calls"] == 32 and r["multi_turn/tool_errors"] == 0, r
        assert r["multi_turn/turns_mean"] == 2.0, r
        assert r["rollout/logprob_abs_diff"] <= 1e-5, r
    assert any("eval/accuracy" in r for r in read_metrics(out))
