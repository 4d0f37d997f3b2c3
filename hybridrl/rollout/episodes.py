"""What happens between the policy's turns of multi-turn episodes, on the rank that owns them.

After each generation an owned, live episode *acts*: the turn's tool calls (``multi_turn.format``) are run (all
episodes' together, each call within ``tool_timeout_s``), or, without calls, the environment answers the turn
(each step within ``environment_timeout_s``), or the episode ends. What comes next (tool messages, the environment's
messages, the template's separators and the next generation prompt) is rendered by the chat template into ids
(:class:`~hybridrl.rollout.turns.TurnRenderer`). An :class:`Act` is what the other ranks learn of it.

A vision-language policy's tool results may carry images (:class:`~hybridrl.interfaces.ToolResult`): the tool message
renders them as image parts before its text, their placeholders are expanded as the processor expands them
(:mod:`hybridrl.vlm.tool_images`) and the act carries them (``Act.images``), so the episode's images grow in
sequence order. A vision-language policy that *samples* an image (or video) placeholder id in a turn that would go
on ends its episode there (``Act.finish = "vision_token"``): the next turn's context would be re-prefilled with
that id read as an image the episode does not have (every engine's image path takes placeholders wherever they are
in the ids), and an engine would fail or see a different context than the one sampled. Ending the episode keeps
the sample as sampled — the actor reads a response's sampled ids as text, as the engine decoded them — where
forbidding the ids would change the sampling distribution the actor's log-probs must equal.

Faults of tools are observations for the policy (:mod:`hybridrl.tools.runner`). An environment whose ``open()`` or
``step()`` raises, times out or returns something that is not an ``EnvStep`` ends its episode with an error
(``Act.error``; the rollout applies ``reward.on_error``); a ``close()`` that raises or times out is a warning. Each of
them runs within ``environment_timeout_s`` (:mod:`hybridrl.tools.bounded`: one past it gives its worker back, so an
environment that hangs costs that limit, never the run).

:func:`episode_actors` builds all of it from ``multi_turn.*`` (tools, environment, renderer checked token-exact),
for the colocated rollout and for the engine ranks of a disaggregated one alike.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridrl.batch import SampleMeta
from hybridrl.interfaces import Environment, EnvStep, Episode, PolicyTurn, SamplingParams
from hybridrl.registry import Registry
from hybridrl.rollout.turns import Message, TurnRenderer
from hybridrl.tools.bounded import Bounded, StuckCallsError
from hybridrl.tools.calls import CallError, ToolCall, parse_calls
from hybridrl.tools.config import KEY
from hybridrl.tools.runner import ToolRunner, tokenizer_cut
from hybridrl.tracking import say
from hybridrl.vlm.inputs import ImageInputs
from hybridrl.vlm.tool_images import ToolImages, image_message

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hybridrl.config.schema import RLConfig


@dataclass(slots=True, kw_only=True)
class Act:
    """An episode's answer to its latest turn, as every rank learns it."""

    appended: list[int] = field(default_factory=list)  # ids up to the next generation prompt (loss_mask 0)
    done: bool = False
    reward: float | None = None  # the environment's reward for this turn
    error: str | None = None  # the environment failed: the episode ends
    # how (a fixed vocabulary for the metrics): open_timeout, step_timeout, bad_step, and for a raise the
    # exception's ``kind`` attribute where it has one (openai_agent's), else open_raised / step_raised
    error_kind: str | None = None
    keep: int | None = None  # the turn is kept up to its first `keep` sampled ids (EnvStep.keep_tokens)
    # the images of the appended ids' placeholder runs, in order (tool results'), and each run's (start, length)
    images: ImageInputs | None = None
    image_runs: list[tuple[int, int]] = field(default_factory=list)
    finish: str | None = None  # why the episode ended, where it is not "stop"/"length" ("vision_token": module doc)


@dataclass(slots=True, kw_only=True)
class OwnedTurn:
    """An owned live episode's latest turn, as the rollout hands it to :meth:`EpisodeActors.act`."""

    sample: int
    ids: list[int]  # as sampled, cut to the episode's budget
    logprobs: list[float]
    cut: bool  # by the budget: the episode ends
    turns: int  # the policy's turns so far, this one included
    meta: SampleMeta
    seed: int  # the episode's
    context_tokens: int  # the ids the turn was generated from
    params: SamplingParams


@dataclass(slots=True, kw_only=True)
class _Owned:
    messages: list[Message]  # the conversation so far
    episode: Episode | None = None  # the environment's, opened at its first step
    images: list[Any] = field(default_factory=list)  # the episode's decoded images so far (the prompt's first)


class EpisodeActors:
    """The episodes one rank owns: their conversations and environment episodes, and how they act."""

    def __init__(self, renderer: TurnRenderer, tools: ToolRunner, *, format: str, environment: Environment | None,
                 environment_timeout_s: float, max_assistant_turns: int, images: ToolImages | None = None,
                 vision_ids: frozenset[int] = frozenset()) -> None:
        self.renderer, self.tools, self.format = renderer, tools, format
        # a vision-language policy: tool images, and the placeholder ids that end an episode when sampled
        self.images, self.vision_ids = images, vision_ids
        self.environment, self.env_timeout_s = environment, environment_timeout_s
        self.max_turns = max_assistant_turns
        self.bounded = Bounded(key=f"{KEY}.environment_timeout_s")
        self.owned: dict[int, _Owned] = {}

    def open(self, sample: int, meta: SampleMeta) -> None:
        assert meta.messages is not None, "the dataset keeps each prompt's messages under a chat template"
        self.owned[sample] = _Owned(messages=[dict(m) for m in meta.messages],
                                    images=list(meta.images.images) if meta.images is not None else [])

    def act(self, turns: Sequence[OwnedTurn]) -> dict[int, Act]:
        """The :class:`Act` of each owned live episode's latest turn."""
        acts: dict[int, Act] = {}
        text = {t.sample: self.renderer.turn_text(t.ids) for t in turns}
        calls = {s: parse_calls(text[s], format=self.format) for s in text}
        tool_turns, env_turns = [], []
        for t in turns:
            s = t.sample
            if t.cut or t.turns >= self.max_turns:
                acts[s] = Act(done=True)
            elif self.vision_ids.intersection(t.ids):  # would be read as an image next turn (module docstring)
                acts[s] = Act(done=True, finish="vision_token")
            elif self.environment is not None and self._for_environment(calls[s]):
                env_turns.append(s)
            elif calls[s]:
                tool_turns.append(s)
            elif self.environment is not None:
                env_turns.append(s)
            else:
                acts[s] = Act(done=True)
        replies: dict[int, list[Message]] = {}
        by_sample = {t.sample: t for t in turns}
        observations = iter(self.tools.run([c for s in tool_turns for c in calls[s]],
                                           metas=[by_sample[s].meta for s in tool_turns for _ in calls[s]],
                                           images=[self.owned[s].images for s in tool_turns for _ in calls[s]]))
        shown: dict[int, list[Any]] = {}  # each episode's new images, in the order its messages show them
        for s in tool_turns:
            obs = [next(observations) for _ in calls[s]]
            replies[s] = [image_message(o.text, o.images) for o in obs]
            shown[s] = [im for o in obs for im in o.images]
        sampled = {t.sample: t.ids for t in turns}
        for s, act in zip(env_turns, self._env_steps([(by_sample[s], text[s]) for s in env_turns]), strict=True):
            if isinstance(act, Act):
                acts[s] = act
                continue
            keep = act.keep_tokens
            if keep is not None:  # the turn as kept is what the sample and the conversation go on from
                sampled[s] = sampled[s][:keep]
                text[s] = self.renderer.turn_text(sampled[s])
            replies[s] = act.messages
            acts[s] = Act(done=act.done, reward=None if act.reward is None else float(act.reward), keep=keep)
        for s, new in replies.items():
            owned, assistant = self.owned[s], {"role": "assistant", "content": text[s]}
            if not acts.get(s, Act()).done:
                act = acts.setdefault(s, Act())
                act.appended = self.renderer.appended_ids([*owned.messages, assistant], new, sampled_ids=sampled[s])
                if shown.get(s):
                    self._with_images(act, shown[s])
                    owned.images += shown[s]
            owned.messages += [assistant, *new]
        self._close(*(s for s, act in acts.items() if act.done))
        return acts

    def _with_images(self, act: Act, images: list[Any]) -> None:
        """``act``'s appended ids with each tool image's placeholder run expanded, and the images it carries."""
        assert self.images is not None, "a tool image reached a text policy's episode (ToolRunner(images=False))"
        inputs = self.images.encode(images)
        act.appended = self.images.expand(act.appended, inputs)
        act.images, act.image_runs = inputs, self.images.runs(act.appended)

    def _for_environment(self, calls: Sequence[ToolCall | CallError]) -> bool:
        """A turn goes to the environment when it calls none of the rollout's tools, or calls a tool the environment
        offers (the whole turn then: the environment answers each of its calls)."""
        if not calls:
            return True
        env_tools = {t["function"]["name"] for t in environment_tools(self.environment)}
        if not env_tools:
            return False  # the rollout's tools answer (an unknown tool is an error observation)
        return not all(isinstance(c, ToolCall) and c.name in self.tools.tools for c in calls)

    def _env_steps(self, turns: list[tuple[OwnedTurn, str]]) -> list[EnvStep | Act]:
        """Each turn's environment step, or the error Act of a failed one."""
        env = self.environment
        if not turns:
            return []
        assert env is not None
        unopened = [i for i, (t, _) in enumerate(turns) if self.owned[t.sample].episode is None]
        opens = self.bounded.run([_opener(env, t.meta, t.seed) for t, _ in (turns[i] for i in unopened)],
                                 timeout_s=self.env_timeout_s, names=["environment open()"] * len(unopened))
        opened: list[Act | None] = [None] * len(turns)
        for i, o in zip(unopened, opens, strict=True):
            if o.timed_out:
                opened[i] = Act(done=True, error_kind="open_timeout",
                                error=f"open() took longer than {KEY}.environment_timeout_s={self.env_timeout_s:g} s")
            elif o.error is not None:
                tb = "".join(traceback.format_exception(o.error))
                opened[i] = Act(done=True, error_kind=_kind(o.error, "open_raised"),
                                error=f"open() raised {type(o.error).__name__}: {o.error}\n{tb}")
            else:
                self.owned[turns[i][0].sample].episode = o.value
        live = [i for i, o in enumerate(opened) if o is None]
        steps = self.bounded.run([self._stepper(*turns[i]) for i in live], timeout_s=self.env_timeout_s,
                                 names=["environment step()"] * len(live))
        out: list[EnvStep | Act] = [o if o is not None else Act() for o in opened]
        for i, o in zip(live, steps, strict=True):
            if o.timed_out:
                out[i] = Act(done=True, error_kind="step_timeout",
                             error=f"step() took longer than {KEY}.environment_timeout_s={self.env_timeout_s:g} s")
            elif o.error is not None:
                tb = "".join(traceback.format_exception(o.error))
                out[i] = Act(done=True, error_kind=_kind(o.error, "step_raised"),
                             error=f"step() raised {type(o.error).__name__}: {o.error}\n{tb}")
            elif not _is_env_step(o.value, turns[i][0]):
                out[i] = Act(done=True, error_kind="bad_step",
                             error=f"step() returned {type(o.value).__name__}, not hybridrl.interfaces.EnvStep("
                                   "messages=[{'role', 'content'}, ...], done=..., reward=..., keep_tokens=None or "
                                   "0..the turn's ids)")
            else:
                out[i] = o.value
        return out

    def _stepper(self, turn: OwnedTurn, text: str) -> Any:
        """The step of ``turn``'s episode: ``step_turn`` with the turn's tokens where the episode has one."""
        episode = self.owned[turn.sample].episode
        if (step_turn := getattr(episode, "step_turn", None)) is None:
            return _stepper(episode, {"role": "assistant", "content": text})
        tok = self.renderer.tokenizer
        policy_turn = PolicyTurn(text=text, token_ids=list(turn.ids), logprobs=list(turn.logprobs),
                                 context_tokens=turn.context_tokens, params=turn.params,
                                 eos_token_id=tok.eos_token_id, decode=self.renderer.decode)
        return lambda: step_turn(policy_turn)

    def close_all(self) -> None:
        """End every episode still owned (a step that stopped early): their environment episodes are closed."""
        self._close(*self.owned)

    def _close(self, *samples: int) -> None:
        """Forget ``samples``; their environment episodes' ``close()`` (where there is one) within the timeout."""
        owned = [self.owned.pop(s, None) for s in samples]
        closes = [close for o in owned if o is not None and (close := getattr(o.episode, "close", None)) is not None]
        try:
            done = self.bounded.run(closes, timeout_s=self.env_timeout_s, names=["environment close()"] * len(closes))
        except StuckCallsError as e:  # the step fails or failed already, saying so; a close() is not worth hiding it
            say(f"warning: {len(closes)} environment episodes not closed: {e}")
            return
        for o in done:
            if o.timed_out:  # a failed close() loses nothing of the sample
                say(f"warning: an environment episode's close() took longer than {KEY}.environment_timeout_s="
                    f"{self.env_timeout_s:g} s")
            elif o.error is not None:
                say(f"warning: an environment episode's close() raised {type(o.error).__name__}: {o.error}")


def _kind(error: BaseException, default: str) -> str:
    kind = getattr(error, "kind", None)
    return kind if isinstance(kind, str) and kind.isidentifier() else default


def _opener(env: Environment, meta: SampleMeta, seed: int) -> Any:
    return lambda: env.open(meta, seed=seed)


def _stepper(episode: Any, message: Message) -> Any:
    return lambda: episode.step(message)


def _is_env_step(value: Any, turn: OwnedTurn) -> bool:
    return (isinstance(value, EnvStep) and isinstance(value.messages, list) and isinstance(value.done, bool)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value.messages)
            and (value.reward is None or isinstance(value.reward, int | float))
            and (value.keep_tokens is None or (isinstance(value.keep_tokens, int)
                                               and 0 <= value.keep_tokens <= len(turn.ids))))


def tool_schemas(cfg: RLConfig) -> list[dict[str, Any]]:
    """The schemas of ``multi_turn.tools`` and of the environment's tools (the chat template renders them into the
    prompt), [] when off."""
    if not cfg.actor_rollout_ref.rollout.multi_turn.enable:
        return []
    return _schemas(build_tools(cfg), build_environment(cfg))


def environment_tools(environment: Environment | None) -> list[dict[str, Any]]:
    """The function schemas of the tools an environment offers the policy (its optional ``tools`` attribute: an
    agent that runs its own tools), which the chat template renders into the prompt; its episodes answer the calls."""
    return list(getattr(environment, "tools", None) or [])


def build_environment(cfg: RLConfig) -> Environment | None:
    """``multi_turn.environment`` with its ``environment_kwargs``; None when there is none."""
    m = cfg.actor_rollout_ref.rollout.multi_turn
    return None if m.environment is None else Registry("environments").build(
        m.environment, m.environment_kwargs, key=f"{KEY}.environment_kwargs")


def _schemas(tools: Sequence[Any], environment: Environment | None) -> list[dict[str, Any]]:
    own, offered = [t.schema for t in tools], environment_tools(environment)
    if both := sorted({t["function"]["name"] for t in own} & {t["function"]["name"] for t in offered}):
        raise ValueError(f"tools {both} are both in {KEY}.tools and offered by the environment "
                         f"({KEY}.environment_kwargs.tools): a call must have one owner")
    return own + offered


def build_tools(cfg: RLConfig) -> list[Any]:
    """``multi_turn.tools``, built with their ``tool_kwargs`` (a tool may make its schema from its config)."""
    m = cfg.actor_rollout_ref.rollout.multi_turn
    tools = Registry("tools")
    return [tools.build(name, m.tool_kwargs.get(name), key=f"{KEY}.tool_kwargs.{name}") for name in m.tools]


def episode_actors(cfg: RLConfig, tokenizer: PreTrainedTokenizerBase) -> EpisodeActors:
    """The multi-turn rollout's tools, environment and turn renderer; refuses a template that is not token-exact."""
    m = cfg.actor_rollout_ref.rollout.multi_turn
    built, env = build_tools(cfg), build_environment(cfg)
    renderer = TurnRenderer(tokenizer, tools=_schemas(built, env))
    renderer.check()
    images, vision_ids = tool_images(cfg)
    runner = ToolRunner({t.schema["function"]["name"]: t for t in built}, timeout_s=m.tool_timeout_s,
                        max_tokens=m.max_tool_response_length, cut=tokenizer_cut(tokenizer), images=images is not None)
    return EpisodeActors(renderer, runner, format=m.format, environment=env,
                         environment_timeout_s=m.environment_timeout_s, max_assistant_turns=m.max_assistant_turns,
                         images=images, vision_ids=vision_ids)


def tool_images(cfg: RLConfig) -> tuple[ToolImages | None, frozenset[int]]:
    """A vision-language policy's tool-image encoder (its processor's) and vision placeholder ids; (None, {}) for a
    text policy."""
    from pathlib import Path

    from hybridrl.hf.arch import CONFIG_FILE
    from hybridrl.hf.vlm import checkpoint_vision

    model = cfg.actor_rollout_ref.model
    vision = checkpoint_vision(model.path) if (Path(model.path) / CONFIG_FILE).is_file() else None
    if vision is None:
        return None, frozenset()
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model.tokenizer_path or model.path)
    ids = {vision.image_token_id} | ({vision.video_token_id} if vision.video_token_id is not None else set())
    return (ToolImages(processor, image_token_id=vision.image_token_id, merge_size=vision.spatial_merge_size),
            frozenset(ids))
