"""Token-in, token-out conversations: the ids a multi-turn rollout puts between the policy's turns.

The ids the policy sampled are kept verbatim (never decoded and re-encoded: SkyRL#123, prime-rl#1352). Every id it
did not sample — a tool's result, an environment's message, the template's separators (ChatML's ``"\\n"`` after
``<|im_end|>``, which the policy stops before and never samples: verl#6501) and the next generation prompt — comes
from :class:`TurnRenderer`, from the chat template itself::

    h = render(history)                       history ends with the policy's turn (its text, as sampled)
    f = render(history + new, generation prompt)
    appended = tokens(the rest of h after the policy's sampled text  +  f[len(h):])

It needs the template's prefix property: ``render(history)`` is a prefix of ``render(history + new)``. A template
that rewrites history (Qwen3 drops earlier turns' ``<think>``: verl#6854) is refused, not split into one sample
per turn: splitting changes what a sample is for the advantage estimators and the reward, and a user who wants it
can render such a model's turns without the rewrite. :meth:`TurnRenderer.check` proves the whole scheme on a probe
conversation before a run starts: prompt + Σ (sampled + appended) must be exactly the tokens of the template's
render of the whole conversation; otherwise it refuses to start, naming the first token that differs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
_SENTINEL = "\u2063hybridrl-turn\u2063"  # content no policy writes: marks where a turn's content ends


class TemplateError(ValueError):
    """The chat template cannot give token-exact multi-turn conversations."""


class TurnRenderer:
    """The non-sampled ids of a conversation, from ``tokenizer``'s chat template (``tools``: the tool schemas the
    template may render into its system prompt)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, tools: Sequence[dict[str, Any]] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template: multi-turn rollouts render turns with it")
        if tokenizer.eos_token_id is None:
            raise TemplateError("the tokenizer has no eos_token: it ends the policy's turns")
        self.tokenizer, self.tools = tokenizer, list(tools)
        self.eos_text = str(tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id))

    def render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        tools: Any = self.tools or None
        return str(self.tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The ids of the first generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def decode(self, ids: Sequence[int]) -> str:
        """``ids`` as text, special tokens kept."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def turn_text(self, sampled_ids: Sequence[int]) -> str:
        """The policy's turn as the template's ``content`` (its text without the ending EOS)."""
        ids = list(sampled_ids)
        if ids and ids[-1] == self.tokenizer.eos_token_id:
            ids = ids[:-1]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def appended_ids(self, history: Sequence[Message], new: Sequence[Message], *, sampled_ids: Sequence[int],
                     generation_prompt: bool = True) -> list[int]:
        """The ids after the policy's last turn (``history[-1]``, sampled as ``sampled_ids``) up to the next
        generation prompt (``generation_prompt=False``: up to the end of ``new``)."""
        h = self.render(history, generation_prompt=False)
        f = self.render([*history, *new], generation_prompt=generation_prompt)
        if not f.startswith(h):
            at = next((i for i, (a, b) in enumerate(zip(h, f, strict=False)) if a != b), min(len(h), len(f)))
            raise TemplateError(f"the chat template rewrites history: the render of the conversation so far is not "
                                f"a prefix of its render with the next messages (first difference at character {at}: "
                                f"{h[at:at + 40]!r} became {f[at:at + 40]!r}); token-exact multi-turn rollouts need "
                                "a template that only appends (e.g. one that keeps earlier turns' <think>)")
        turn = self.turn_text(sampled_ids)
        ended = bool(sampled_ids) and sampled_ids[-1] == self.tokenizer.eos_token_id
        suffix = self._turn_suffix(history)
        if not h.endswith(turn + suffix):
            raise TemplateError(f"the template does not render the policy's turn verbatim ({turn[:60]!r}) followed by "
                                f"its end-of-turn text {suffix!r}")
        end = len(h) - len(suffix)
        if ended:  # the EOS was sampled: what follows it is the template's
            if not suffix.startswith(self.eos_text):
                raise TemplateError(f"the template does not end an assistant turn with {self.eos_text!r}")
            end += len(self.eos_text)
        return self.encode(h[end:] + f[len(h):])

    def _turn_suffix(self, history: Sequence[Message]) -> str:
        """What the template writes after the content of the assistant turn ``history[-1]`` (ChatML:
        ``"<|im_end|>\\n"``): found with a sentinel content, never by searching for the policy's text (which may
        occur in the template's own text too: a turn of just ``"\\n"``)."""
        text = self.render([*history[:-1], {**history[-1], "content": _SENTINEL}], generation_prompt=False)
        return text[text.rindex(_SENTINEL) + len(_SENTINEL):]

    def check(self, probe: Sequence[Message] | None = None) -> None:
        """Raise :class:`TemplateError` unless the turn-by-turn ids of ``probe`` (default: a tool-calling
        conversation) equal the tokens of the template's render of the whole conversation."""
        messages = list(probe) if probe is not None else probe_conversation()
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        ids = self.prompt_ids(messages[:first])
        i = first
        while i < len(messages):
            assert messages[i]["role"] == "assistant", "a probe alternates assistant turns and the rest"
            sampled = [*self.encode(messages[i]["content"]), self.tokenizer.eos_token_id]
            ids += sampled
            nxt = i + 1
            while nxt < len(messages) and messages[nxt]["role"] != "assistant":
                nxt += 1
            if nxt > i + 1 or nxt < len(messages):
                ids += self.appended_ids(messages[:i + 1], messages[i + 1:nxt], sampled_ids=sampled,
                                         generation_prompt=nxt < len(messages))
            i = nxt
        whole = self.encode(self.render(messages, generation_prompt=False))
        end = len(whole) - whole[::-1].index(self.tokenizer.eos_token_id)  # up to the last turn's EOS
        if ids != whole[:end]:
            at = next((k for k, (a, b) in enumerate(zip(ids, whole, strict=False)) if a != b), min(len(ids), end))
            raise TemplateError(
                f"turn-by-turn token ids differ from the chat template's render of the whole conversation at token "
                f"{at}: {self.tokenizer.decode(ids[at:at + 8])!r} vs {self.tokenizer.decode(whole[at:at + 8])!r}; "
                "multi-turn rollouts would train on ids the template never produces")


def probe_conversation() -> list[Message]:
    call = json.dumps({"name": "calculator", "arguments": {"expression": "12*7"}})
    return [{"role": "system", "content": "You can use tools."},
            {"role": "user", "content": "What is 12*7? Then add 5."},
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": "84"},
            {"role": "assistant", "content": "84 + 5 = 89."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "You are welcome."}]
