"""Token-exact conversations (``hybridrl.rollout.turns``): what a multi-turn rollout appends between the policy's
turns is exactly what the chat template renders, and the policy's own ids are kept as sampled.

Random conversations (tool results, environment and user messages, one to four policy turns) with the char
tokenizer of the tiny models and a BPE tokenizer trained here: prompt + Σ (sampled + appended) decodes to the
template's render of the whole conversation, and every appended span is token for token the render's own
tokenization of it — also when the sampled ids are not the tokenizer's canonical encoding (decode→encode would
change them). The ChatML ``"\\n"`` after ``<|im_end|>``, which the policy never samples, is appended. A template
that rewrites history, or one that does not end turns with the EOS token, is refused before any run starts.
"""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerBase

from hybridrl.models.bpe_tokenizer import train_bpe_tokenizer
from hybridrl.models.char_tokenizer import IM_END, make_char_tokenizer
from hybridrl.rollout.turns import TemplateError, TurnRenderer, probe_conversation

WORDS = ["what", "is", "the", "answer", "12*7", "=", "84", "then", "add", "5", "thanks", "try", "again", "call",
         '{"name": "calculator"}', "<tool_call>", "</tool_call>", "\n", " ", "  ", "wrong"]


@pytest.fixture(scope="module", params=["char", "bpe"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    if request.param == "char":
        return make_char_tokenizer(model_max_length=4096)
    texts = [" ".join(random.Random(i).choices(WORDS, k=40)) for i in range(200)]
    return train_bpe_tokenizer(texts, vocab_size=420, model_max_length=4096)


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(1, 8))).strip() or "ok"


def _conversation(rng: random.Random) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.5 else []
    messages.append({"role": "user", "content": _text(rng)})
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "assistant", "content": _text(rng)})
        for _ in range(rng.randint(1, 2)):
            messages.append({"role": rng.choice(["tool", "user"]), "content": _text(rng)})
    messages.append({"role": "assistant", "content": _text(rng)})
    return messages


def _sampled(tok: PreTrainedTokenizerBase, content: str, rng: random.Random, *, canonical: bool) -> list[int]:
    """The policy's ids for ``content`` + EOS: the canonical encoding, or one character per token piece."""
    if canonical:
        ids = tok(content, add_special_tokens=False)["input_ids"]
    else:  # a valid but non-canonical spelling: each character encoded alone
        ids = [i for ch in content for i in tok(ch, add_special_tokens=False)["input_ids"]]
    return [*ids, tok.eos_token_id]


def _roll(r: TurnRenderer, messages: list[dict[str, str]], rng: random.Random, *,
          canonical: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """The conversation as a rollout builds it: its ids and the (start, end) of every appended span."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids, spans = r.prompt_ids(messages[:first]), []
    i = first
    while i < len(messages):
        sampled = _sampled(r.tokenizer, messages[i]["content"], rng, canonical=canonical)
        ids += sampled
        nxt = i + 1
        while nxt < len(messages) and messages[nxt]["role"] != "assistant":
            nxt += 1
        if nxt < len(messages):
            appended = r.appended_ids(messages[:i + 1], messages[i + 1:nxt], sampled_ids=sampled)
            spans.append((len(ids), len(ids) + len(appended)))
            ids += appended
        i = nxt
    return ids, spans


@pytest.mark.parametrize("canonical", [True, False])
def test_random_conversations_are_the_template_s_render(tokenizer: PreTrainedTokenizerBase, canonical: bool) -> None:
    r = TurnRenderer(tokenizer)
    r.check()
    rng, changed = random.Random(1), 0
    for _ in range(60):
        messages = _conversation(rng)
        ids, spans = _roll(r, messages, rng, canonical=canonical)
        render = r.render(messages, generation_prompt=False)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        assert render == text + render[len(text):] and render[len(text):] == "\n", (render, text)
        whole = r.encode(render)
        for start, end in spans:  # the appended spans: the render's own tokens, separators included
            piece = tokenizer.decode(ids[start:end], skip_special_tokens=False)
            assert piece.startswith("\n") and piece.endswith("assistant\n")
            assert ids[start:end] == r.encode(piece)
        if canonical:
            assert ids == whole[:len(ids)] and len(whole) == len(ids) + 1  # all but the final "\n"
        changed += ids != whole[:len(ids)]
    if not canonical and len(tokenizer) > 300:  # the BPE tokenizer (420 tokens; the char one has ~100)
        assert changed > 0  # its per-character spellings really differ from decode→encode


@pytest.mark.parametrize("turn", ["\n", " ", "assistant\n", "\n<|im_start|>user\n", "", "<|im_end|>"])
def test_a_turn_that_looks_like_the_template_s_own_text(tokenizer: PreTrainedTokenizerBase, turn: str) -> None:
    """A policy turn that is (or contains) the template's own separators — a random policy writes ``"\\n"`` —
    is located by where the template puts turn content, never by searching for its text."""
    r = TurnRenderer(tokenizer)
    sampled = [*r.encode(turn), tokenizer.eos_token_id]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": r.turn_text(sampled)}]
    new = [{"role": "user", "content": "again"}]
    ids = r.prompt_ids(history[:1]) + sampled + r.appended_ids(history, new, sampled_ids=sampled)
    assert tokenizer.decode(ids) == r.render([*history, *new], generation_prompt=True)


def test_the_separator_the_policy_never_samples_is_appended() -> None:
    """ChatML writes ``<|im_end|>\\n``; the policy stops at ``<|im_end|>`` (EOS). The ``\\n`` comes next."""
    tok = make_char_tokenizer(model_max_length=512)
    r = TurnRenderer(tok)
    history = [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}]
    appended = r.appended_ids(history, [{"role": "user", "content": "sure?"}],
                              sampled_ids=[*tok("5", add_special_tokens=False)["input_ids"], tok.eos_token_id])
    assert tok.decode(appended) == "\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n"
    # a turn cut before its EOS (the response budget) gets the EOS from the template too
    cut = r.appended_ids(history, [{"role": "user", "content": "sure?"}],
                         sampled_ids=tok("5", add_special_tokens=False)["input_ids"])
    assert tok.decode(cut).startswith(IM_END + "\n<|im_start|>user")


def test_a_template_that_rewrites_history_is_refused() -> None:
    """As Qwen3's drops earlier turns' <think> (verl#6854)."""
    tok = make_char_tokenizer(model_max_length=512)
    tok.chat_template = (
        "{%- for m in messages %}{%- if m['role'] == 'assistant' and not loop.last %}"
        "{{- '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1] + '<|im_end|>\\n' }}{%- else %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    with pytest.raises(TemplateError, match="rewrites history"):
        TurnRenderer(tok).check([{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "<think>x</think>a"},
                                 {"role": "user", "content": "more"}, {"role": "assistant", "content": "b"}])


def test_a_template_whose_turns_do_not_end_with_eos_is_refused() -> None:
    tok = make_char_tokenizer(model_max_length=512)
    tok.chat_template = ("{%- for m in messages %}{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
                         "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")
    with pytest.raises(TemplateError, match="does not end an assistant turn"):
        TurnRenderer(tok).check(probe_conversation())
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        TurnRenderer(tok)
