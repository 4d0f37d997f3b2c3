"""The ``model`` reward manager: a tiny Qwen2ForSequenceClassification scores samples as transformers does."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerBase, Qwen2Tokenizer

from hybridrl import testing
from hybridrl.batch import RolloutBatch
from hybridrl.models.char_tokenizer import EOS_TOKEN, IM_START, PAD_TOKEN, SPECIAL_TOKENS, char_vocab
from hybridrl.models.tiny import make_tiny_model, make_tiny_reward_model
from hybridrl.registry import PluginConfigError, Registry
from hybridrl.rewards.model import ModelReward

torch.set_num_threads(1)
KEY = "reward.kwargs"
# a tokenizer unlike the policy's: other ids for every char, another chat template
OTHER_TEMPLATE = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"


def other_tokenizer() -> Qwen2Tokenizer:
    chars = [t for t in char_vocab() if t not in SPECIAL_TOKENS][::-1]
    vocab = {t: i for i, t in enumerate([*chars, *SPECIAL_TOKENS])}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token=EOS_TOKEN,  # type: ignore[arg-type]
                         pad_token=PAD_TOKEN, additional_special_tokens=[IM_START], model_max_length=512)
    tok.chat_template = OTHER_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", seed=3)


@pytest.fixture(scope="module")
def reference(rm_path: Path) -> torch.nn.Module:
    return AutoModelForSequenceClassification.from_pretrained(rm_path).eval()


def build(tok: PreTrainedTokenizerBase, path: Path, **kwargs: object) -> ModelReward:
    return Registry("reward_managers").build("model", {"path": str(path), **kwargs}, key=KEY, tokenizer=tok,
                                             device=torch.device("cpu"))


def samples(batch: RolloutBatch) -> list[tuple[list[int], list[int]]]:
    """Each sample's real prompt and response ids."""
    return [(p[pm.bool()].tolist(), r[rm.bool()].tolist()) for p, pm, r, rm in
            zip(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, strict=True)]


def direct(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' own score of one unpadded sequence."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0]


@pytest.mark.parametrize("chat", [False, True])
def test_scores_equal_a_direct_transformers_forward(tok: PreTrainedTokenizerBase, rm_path: Path,
                                                    reference: torch.nn.Module, chat: bool) -> None:
    batch = testing.make_batch(tok)
    reward = build(tok, rm_path, micro_batch_size=1, apply_chat_template=chat)
    out = reward(batch)
    rows = [reward.encode(p, r)[0] for p, r in samples(batch)]
    assert torch.equal(out.scores_B, torch.stack([direct(reference, ids) for ids in rows]))  # bitwise
    if not chat:  # the same tokenizer, no template: the RM reads exactly the policy's tokens
        assert rows == [p + r for p, r in samples(batch)]
    assert out.correct_B is None and out.info == {"truncated": [False] * len(batch)}


def test_batched_scores_equal_unbatched(tok: PreTrainedTokenizerBase, rm_path: Path) -> None:
    batch = testing.make_batch(tok, responses=[["3" + tok.eos_token, "a much longer response, 3", "x"],
                                               ["35", "", "35 is what it is" + tok.eos_token]])
    alone = build(tok, rm_path, micro_batch_size=1)(batch).scores_B
    for mbs in (2, 4, 8):  # rows of other lengths in one forward: right padding must not leak into a score
        assert torch.allclose(build(tok, rm_path, micro_batch_size=mbs)(batch).scores_B, alone, rtol=0, atol=1e-6)
    assert len(set(alone.tolist())) == len(batch)  # the samples are told apart


def test_chat_template_reads_one_user_and_one_assistant_turn(tok: PreTrainedTokenizerBase, rm_path: Path) -> None:
    batch = testing.make_batch(tok)  # prompts in the policy's chat template, as the dataset makes them
    reward = build(tok, rm_path)
    text = tok.decode(reward.encode(*samples(batch)[0])[0])
    assert text == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"
    plain = testing.make_batch(tok, chat_template=False)  # a prompt the template did not make: passed whole
    assert tok.decode(reward.encode(*samples(plain)[0])[0]) == text


def test_a_reward_model_with_another_tokenizer(tok: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    path = make_tiny_reward_model(tmp_path / "rm", seed=4, tokenizer=other_tokenizer())
    rm_tok = AutoTokenizer.from_pretrained(path)
    batch = testing.make_batch(tok)
    reward = build(tok, path, micro_batch_size=4)
    want_ids = rm_tok("USER: 1+2=\nASSISTANT: 3\n", add_special_tokens=False)["input_ids"]
    policy_ids = tok("USER: 1+2=\nASSISTANT: 3\n", add_special_tokens=False)["input_ids"]
    assert reward.encode(*samples(batch)[0])[0] == want_ids != policy_ids
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    want = [direct(model, reward.encode(p, r)[0]) for p, r in samples(batch)]
    assert torch.allclose(reward(batch).scores_B, torch.stack(want), rtol=0, atol=1e-6)


def test_long_samples_lose_their_start(tok: PreTrainedTokenizerBase, rm_path: Path,
                                       reference: torch.nn.Module) -> None:
    batch = testing.make_batch(tok)
    full = build(tok, rm_path)
    cut = build(tok, rm_path, max_length=8)
    out = cut(batch)
    assert out.info["truncated"] == [True] * len(batch)
    for i, (p, r) in enumerate(samples(batch)):
        ids = full.encode(p, r)[0]
        assert cut.encode(p, r) == (ids[-8:], True)
        assert torch.allclose(out.scores_B[i], direct(reference, ids[-8:]), rtol=0, atol=1e-6)


def test_scale_bias_and_threshold(tok: PreTrainedTokenizerBase, rm_path: Path) -> None:
    batch = testing.make_batch(tok)
    logits = build(tok, rm_path)(batch).scores_B
    threshold = float((logits * 10 + 0.8).median())
    out = build(tok, rm_path, score_scale=10.0, score_bias=0.8, correct_threshold=threshold)(batch)
    assert torch.allclose(out.scores_B, logits * 10 + 0.8)
    assert out.correct_B is not None and torch.equal(out.correct_B, out.scores_B > threshold)
    assert 0 < int(out.correct_B.sum()) < len(batch)


def test_bfloat16(tok: PreTrainedTokenizerBase, rm_path: Path) -> None:
    batch = testing.make_batch(tok)
    fp32 = build(tok, rm_path)(batch).scores_B
    bf16 = build(tok, rm_path, dtype="bfloat16")(batch).scores_B
    assert bf16.dtype == torch.float32 and torch.allclose(bf16, fp32, rtol=0, atol=2e-2)


def test_pad_id_from_the_tokenizer_when_the_config_has_none(tok: PreTrainedTokenizerBase, rm_path: Path,
                                                           tmp_path: Path) -> None:
    path = make_tiny_reward_model(tmp_path / "rm", seed=3)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"pad_token_id": None}))
    batch = testing.make_batch(tok)
    assert torch.equal(build(tok, path, micro_batch_size=4)(batch).scores_B,
                       build(tok, rm_path, micro_batch_size=4)(batch).scores_B)


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"micro_batch_size": 0}, "reward.kwargs.micro_batch_size=0"),
    ({"max_length": 0}, "reward.kwargs.max_length=0"),
    ({"dtype": "float16"}, "reward.kwargs.dtype='float16'"),
    ({"score_scale": math.inf}, "reward.kwargs.score_scale=inf"),
    ({"correct_threshold": math.nan}, "reward.kwargs.correct_threshold=nan"),
    ({"path": ""}, "reward.kwargs.path=''"),
    ({"temperature": 1.0}, "unknown key reward.kwargs.temperature"),
])
def test_config_errors_name_the_field(rm_path: Path, kwargs: dict[str, object], names: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        Registry("reward_managers").make_config("model", {"path": str(rm_path), **kwargs}, key=KEY)
    assert names in str(err.value) and "Valid keys" in str(err.value), err.value


def test_path_is_required() -> None:
    with pytest.raises(PluginConfigError, match="missing required key reward.kwargs.path"):
        Registry("reward_managers").make_config("model", {}, key=KEY)


def test_loading_errors_name_the_path(tok: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"reward\.kwargs\.path='.*nowhere' is not a directory"):
        build(tok, tmp_path / "nowhere")
    causal = make_tiny_model(tmp_path / "lm", hidden=32, layers=1, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match=r"reward\.kwargs\.path=.* Qwen2ForCausalLM checkpoint, not a reward model"):
        build(tok, causal)
    two = make_tiny_reward_model(tmp_path / "two", hidden=32, layers=1, heads=2, kv_heads=1)
    config = json.loads((two / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"reward\.kwargs\.path=.* num_labels=2"):
        build(tok, two)


def test_keeps_the_reward_manager_contract(tok: PreTrainedTokenizerBase, rm_path: Path) -> None:
    assert "model" in Registry("reward_managers").names()
    cls = Registry("reward_managers").load("model")
    config = Registry("reward_managers").make_config("model", {"path": str(rm_path), "correct_threshold": 0.0},
                                                     key=KEY)
    out = testing.check_reward_manager(cls, config=config, tokenizer=tok, device=torch.device("cpu"))
    assert out.correct_B is not None
