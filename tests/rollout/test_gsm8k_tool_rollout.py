"""A multi-turn rollout whose tool takes its sample (verl's gsm8k multi-turn setup): every episode calls
``calc_gsm8k_reward`` and reads a reply computed from its own row's ground truth — verl's
``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs`` where the row has it, else its ``reward_model.ground_truth``
— read from a parquet file as verl's preprocessing writes it.

Real: the dataset, ``multi_turn.tools=[gsm8k]`` built through the registry (:func:`episode_actors`), the turn loop
(:func:`play_share`), the tool runner, the chat template's render, and a tiny random model on the ``hf`` engine that
writes each episode's turn after the tool's reply. Forced: each episode's first turn, the tool call (a random model
writes none), the same answer for every row, so that the replies differ only by each row's ground truth. ~3 s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridrl.config.schema import RLConfig
from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
from hybridrl.data.rows import write_rows
from hybridrl.interfaces import Generation, SamplingParams
from hybridrl.models.char_tokenizer import make_char_tokenizer
from hybridrl.models.tiny import make_tiny_model
from hybridrl.rollout.engines.hf import HFRolloutEngine
from hybridrl.rollout.episodes import episode_actors, tool_schemas
from hybridrl.rollout.multi_turn import play_share

ANSWER = "72"
CALL = f'<tool_call>{{"name": "calc_gsm8k_reward", "arguments": {{"answer": "{ANSWER}"}}}}</tool_call>'
# (the tool's ground truth in extra_info, the row's reward_model.ground_truth): verl's rows carry both
ROWS = [("72", "72"), ("10", "10"), (None, "72"), (None, "9")]


class ForcedCall:
    """The tiny model's engine, except that an episode's first turn is :data:`CALL` (its context holds no tool reply
    yet)."""

    def __init__(self, engine: HFRolloutEngine, tokenizer: Any) -> None:
        self.engine, self.tok = engine, tokenizer
        self.call = [*tokenizer(CALL, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]

    def __call__(self, contexts: Sequence[list[int]], params: SamplingParams, *, seeds: Sequence[int],
                 max_new_tokens: Sequence[int] | None = None) -> list[Generation]:
        gens = self.engine.generate(contexts, params, seeds=seeds, max_new_tokens=max_new_tokens)
        for i, context in enumerate(contexts):
            if "<|im_start|>tool" not in self.tok.decode(context):
                gens[i] = Generation(prompt_index=i, token_ids=self.call, logprobs=[-0.1] * len(self.call),
                                     finish_reason="stop", weight_version=0)
        return gens


def test_each_episode_reads_the_reply_from_its_own_rows_ground_truth(tmp_path: Path) -> None:
    tok = make_char_tokenizer(model_max_length=1024)
    model = make_tiny_model(tmp_path / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=1024)
    rows = [{"prompt": [{"role": "user", "content": f"Question {i}: how many clips?"}],
             "reward_model": {"ground_truth": own, "style": "rule"},
             "extra_info": {"index": i, "tools_kwargs": None if tool is None else {
                 "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": tool}}}}}
            for i, (tool, own) in enumerate(ROWS)]
    cfg = RLConfig()
    m = cfg.actor_rollout_ref.rollout.multi_turn
    m.enable, m.tools, m.max_assistant_turns = True, ["gsm8k"], 2
    dataset = PromptDataset([write_rows(rows, tmp_path / "train.parquet")], tokenizer=tok, config=PromptDatasetConfig(
        ground_truth_key="reward_model.ground_truth", max_prompt_length=256, tools=tool_schemas(cfg)))
    items = dataset.items
    actors = episode_actors(cfg, tok)
    params = SamplingParams(max_new_tokens=160, n=2)
    episodes = play_share(actors, range(len(items)), [it.prompt_ids for it in items], [it.meta for it in items],
                          params, seed=5, generate=ForcedCall(HFRolloutEngine(HFRolloutEngine.Config(),
                                                                              model_path=str(model)), tok))
    right = [float((tool or own) == ANSWER) for tool, own in ROWS]
    for s, g in enumerate(episodes.gens):
        text = tok.decode(g.token_ids)
        assert text.startswith(CALL), text
        (reply,) = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text)
        assert reply == f"Current parsed answer='{ANSWER}' reward={right[s // 2]}", (s, reply)
        # the forced call and the model's turn after the reply are trained on, the reply is not
        call = len(tok(CALL, add_special_tokens=False)["input_ids"]) + 1
        assert g.loss_mask[:call] == [1] * call and 0 in g.loss_mask[call:] and g.loss_mask[-1] == 1, s
    assert episodes.turns == [2] * len(episodes.gens)
    assert episodes.counts.calls == len(episodes.gens) and episodes.counts.errors == 0
