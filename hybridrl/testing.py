"""Contract checks for hybridrl plugins, for a plugin author's own tests (and hybridrl's).

    from hybridrl.testing import check_reward_manager

    def test_my_reward_keeps_the_contract(tokenizer):
        check_reward_manager(MyReward, config=MyReward.Config(scale=2.0), tokenizer=tokenizer)

One function per entry-point group (:data:`CHECKS`); :func:`make_batch` and :func:`tiny_tokenizer` build
inputs for a plugin's own tests. Each builds the plugin as the trainer does,
``cls(config, **ctx)`` with its protocol's context (:mod:`hybridrl.interfaces`), runs it on a real
small input and raises :class:`ContractViolation` (an ``AssertionError``) naming the plugin and the
check; an exception raised by the plugin during a check is turned into one, chained. Every check
first runs :func:`check_plugin_class`: a nested kw-only ``Config`` dataclass whose values pass the
config validation of ``reward.kwargs`` & co., and the group's capability flags as ``bool`` class
attributes. ``config=None`` means ``Config()`` (its defaults).

- :func:`check_reward_manager`: a ``RewardOutput`` with ``scores_B`` float [B] finite on the batch's
  device, ``correct_B`` bool [B] or None, ``info`` lists of B; the batch is left unchanged; the
  same batch twice scores the same; class + config survive pickling (the reward can run in worker
  processes) and the rebuilt plugin scores the same.
- :func:`check_advantage_estimator`: ``(advantages, returns)``, each [B, T] in the rewards' dtype,
  finite, zero outside the response mask, not all zero; inputs unchanged; deterministic; the outputs
  follow the samples when the batch is shuffled and its group ids are other integers (the trainer
  passes dataset row ids).
- :func:`check_policy_loss`, in every ``loss_agg_mode``: a finite scalar loss with a gradient, finite
  and zero on padding; metrics ``pg_loss``, ``clipfrac``, ``ppo_kl`` (and any others) finite 0-dim
  tensors without grad; on-policy ``ppo_kl == clipfrac == 0``; micro-batch losses with the
  mini-batch's ``global_normalizer`` add up to the mini-batch loss; deterministic; inputs unchanged.
- :func:`check_rollout_engine`: ``Generation`` fields, ``n`` samples per prompt prompt-major, one
  log-prob ≤ 0 per token, finish reasons that match the tokens, ``[] -> []``; greedy repeats itself; with
  ``supports_abort``, a call after ``abort()`` returns its samples cut short and ``resume()`` restores sampling;
  with ``seeded``, the same seeds give the same samples, whatever the other prompts of the call;
  ``update_weights`` from a lazy stream of buckets takes effect (new log-probs, new version), keeps
  the parameters' storage (``data_ptr``, read by ``storage``) and restores the original outputs when
  the original weights are streamed back; ``release_memory``/``resume_memory`` keep the outputs. An
  extra, unknown context key must be accepted (later versions may pass more).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from hybridrl.algorithms.loss_agg import LOSS_AGG_MODES, local_normalizer
from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.interfaces import (
    AdvantageEstimator,
    Generation,
    PolicyLoss,
    RewardManager,
    RewardOutput,
    RolloutEngine,
    SamplingParams,
    WeightBucket,
)
from hybridrl.registry import (
    GROUPS,
    PROTOCOLS,
    PluginError,
    capability_flags,
    default_flags,
    give_default_flags,
    make_plugin_config,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# make_batch's default task: prompts, their answers, and per prompt a right, a wrong and an unfinished response
PROMPTS: tuple[str, ...] = ("1+2=", "10+25=")
GROUND_TRUTHS: tuple[str, ...] = ("3", "35")
CONFIG_KEYS: dict[str, str] = {  # where the trainer's config holds each group's plugin config
    "rollout_engines": "actor_rollout_ref.rollout.engine_kwargs",
    "reward_managers": "reward.kwargs",
    "advantage_estimators": "algorithm.adv_estimator_kwargs",
    "policy_losses": "algorithm.policy_loss_kwargs",
    "tools": "actor_rollout_ref.rollout.multi_turn.tool_kwargs",
    "environments": "actor_rollout_ref.rollout.multi_turn.environment_kwargs",
}
EXTRA_CTX_KEY = "hybridrl_testing_unknown_ctx"  # passed to engines: later versions may add context keys


class ContractViolation(AssertionError):
    """A plugin broke its group's contract; the message names the plugin and the check."""


class _Plugin:
    """The plugin under check: names it in every failure."""

    def __init__(self, cls: type, group: str) -> None:
        if group not in GROUPS:
            raise ValueError(f"unknown plugin group {group!r}; valid: {sorted(GROUPS)}")
        self.cls, self.group = cls, group
        self.who = f"{group} plugin {getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', cls)!s}"

    def fail(self, check: str, detail: str) -> NoReturn:
        raise ContractViolation(f"{self.who} fails the check {check!r}: {detail}")

    def expect(self, ok: bool, check: str, detail: str | Callable[[], str]) -> None:
        if not ok:
            self.fail(check, detail() if callable(detail) else detail)

    @contextmanager
    def step(self, check: str) -> Iterator[None]:
        """Run plugin code; any exception it raises fails ``check``."""
        try:
            yield
        except ContractViolation:
            raise
        except Exception as e:
            raise ContractViolation(f"{self.who} fails the check {check!r}: it raised {type(e).__name__}: {e}") from e


# ---- the class and its Config ----------------------------------------------------------------------


def check_plugin_class(cls: type, group: str, *, config: Any = None) -> Any:
    """Check ``cls``'s ``Config`` and capability flags for ``group`` (a key of ``registry.GROUPS``);
    return ``config``, or ``cls.Config()`` when it is None."""
    p = _Plugin(cls, group)
    config_cls = getattr(cls, "Config", None)
    p.expect(isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls), "nested Config dataclass",
             "the class has no nested `Config` dataclass; every plugin declares one (it may be empty)")
    assert isinstance(config_cls, type)
    positional = [f.name for f in dataclasses.fields(config_cls) if f.init and not f.kw_only]
    p.expect(not positional, "Config is kw-only",
             f"fields {positional} can be passed by position; declare @dataclass(kw_only=True)")
    give_default_flags(cls, PROTOCOLS[group])  # as the registry does when it loads the plugin
    flags = [*capability_flags(PROTOCOLS[group]), *default_flags(PROTOCOLS[group])]
    bad = [f for f in flags if not isinstance(getattr(cls, f, None), bool)]
    p.expect(not bad, "capability flags", lambda: f"the {PROTOCOLS[group].__name__} protocol needs the class "
             f"attributes {flags}, each a bool; {', '.join(f'{f}={getattr(cls, f, None)!r}' for f in bad)}")
    if config is None:
        with p.step("Config() from its defaults (pass config=... when a field has none)"):
            config = config_cls()
    p.expect(isinstance(config, config_cls), "config type",
             f"config is a {type(config).__name__}, expected {config_cls.__qualname__}")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    try:  # what `reward.kwargs` & co. go through at start-up: the field values must pass it
        make_plugin_config(cls, cls.__qualname__, values, key=CONFIG_KEYS[group])
    except PluginError as e:
        p.fail("Config values pass hybridrl's config validation", str(e))
    return config


# ---- reward managers ----------------------------------------------------------------------------------


def tiny_tokenizer(*, model_max_length: int = 512) -> PreTrainedTokenizerBase:
    """A real tokenizer without a model hub: the project's char-level ``Qwen2Tokenizer`` (printable ASCII, one
    token per char, ChatML template, ``<|im_end|>`` as EOS) — for tests that need one of their own."""
    from hybridrl.models.char_tokenizer import make_char_tokenizer

    return make_char_tokenizer(model_max_length=model_max_length)


def make_batch(
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompts: Sequence[str] = PROMPTS,
    ground_truths: Sequence[str | None] | None = GROUND_TRUTHS,
    responses: Sequence[Sequence[str]] | None = None,
    chat_template: bool = True,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> RolloutBatch:
    """A real small ``RolloutBatch``: ``responses[i]`` are prompt ``i``'s samples, prompt-major.

    Prompts go through the tokenizer's chat template (when it has one and ``chat_template``), as the
    prompt dataset does; responses are tokenized as written, so a special token's text (e.g.
    ``tokenizer.eos_token``) becomes that token. Default responses per prompt: the ground truth +
    EOS, a wrong answer + EOS, and an unfinished one (no EOS, finish reason "length"). Rollout
    log-probs are random negatives; ``group_index`` is the prompt's index.
    """
    truths = list(ground_truths) if ground_truths is not None else [None] * len(prompts)
    if len(truths) != len(prompts):
        raise ValueError(f"make_batch: {len(truths)} ground truths for {len(prompts)} prompts")
    eos = tokenizer.eos_token or ""
    if responses is None:
        responses = [[f"{t}{eos}", f"{t}0{eos}", f"the answer is {t}"] for t in (g or "0" for g in truths)]
    if len(responses) != len(prompts):
        raise ValueError(f"make_batch: responses for {len(responses)} prompts, expected {len(prompts)}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("make_batch: the tokenizer has neither a pad nor an eos token")
    rows: list[tuple[list[int], list[int], int, str | None]] = []
    for i, (prompt, samples) in enumerate(zip(prompts, responses, strict=True)):
        if chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=False)
            prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            prompt_ids = list(tokenizer(prompt)["input_ids"])
        rows += [(prompt_ids, list(tokenizer(r, add_special_tokens=False)["input_ids"]), i, truths[i])
                 for r in samples]
    b = len(rows)
    p, t = max(1, *(len(r[0]) for r in rows)), max(1, *(len(r[1]) for r in rows))
    prompt_ids_BP = torch.full((b, p), pad, dtype=torch.long)
    prompt_mask_BP = torch.zeros((b, p), dtype=torch.long)
    response_ids_BT = torch.full((b, t), pad, dtype=torch.long)
    response_mask_BT = torch.zeros((b, t), dtype=torch.long)
    for k, (prompt_ids, response_ids, _, _) in enumerate(rows):
        if prompt_ids:
            prompt_ids_BP[k, p - len(prompt_ids):] = torch.tensor(prompt_ids)  # left padding
            prompt_mask_BP[k, p - len(prompt_ids):] = 1
        response_ids_BT[k, :len(response_ids)] = torch.tensor(response_ids, dtype=torch.long)  # right padding
        response_mask_BT[k, :len(response_ids)] = 1
    gen = torch.Generator().manual_seed(seed)
    logprobs_BT = -(torch.rand((b, t), generator=gen) * 3 + 0.01) * response_mask_BT
    ends = {tokenizer.eos_token_id} - {None}
    meta = [SampleMeta(ground_truth=g, data_source="hybridrl.testing",
                       finish_reason="stop" if r and r[-1] in ends else "length") for _, r, _, g in rows]
    batch = RolloutBatch(
        prompt_ids=prompt_ids_BP, prompt_mask=prompt_mask_BP, response_ids=response_ids_BT,
        response_mask=response_mask_BT, rollout_logprobs=logprobs_BT,
        weight_version=torch.zeros(b, dtype=torch.long), group_index=torch.tensor([r[2] for r in rows]),
        meta=meta, pad_token_id=int(pad),
    )
    return batch.to(device)


def check_reward_manager(cls: type, *, config: Any = None, tokenizer: PreTrainedTokenizerBase,
                         batch: RolloutBatch | None = None, picklable: bool = True, **ctx: Any) -> RewardOutput:
    """Check a reward manager on ``batch`` (default :func:`make_batch`); return its output.

    ``ctx``: context keys besides ``tokenizer`` that the trainer passes. ``picklable=False`` skips
    the pickling check (only for a reward that never runs in worker processes)."""
    p = _Plugin(cls, "reward_managers")
    config = check_plugin_class(cls, "reward_managers", config=config)
    batch = batch if batch is not None else make_batch(tokenizer)
    ctx_keys = ", ".join(["tokenizer", *ctx])
    with p.step(f"built as cls(config, {ctx_keys}=...)"):
        reward = cls(config, tokenizer=tokenizer, **ctx)
    p.expect(isinstance(reward, RewardManager), "RewardManager protocol",
             "the instance is not callable or has no Config (hybridrl.interfaces.RewardManager)")
    before = _tensors(batch)
    with p.step("__call__(batch)"):
        out = reward(batch)
    _check_reward_output(p, out, batch)
    p.expect(_tensors_equal(before, _tensors(batch)), "leaves the batch unchanged",
             "a tensor of the batch changed during the call; the trainer reads the batch afterwards")
    with p.step("__call__(batch) a second time"):
        again = reward(batch)
    _expect_same_reward(p, "the same batch twice scores the same", out, again)
    if picklable:
        with p.step("class and config round-trip through pickle (reward worker processes)"):
            cls2, config2 = pickle.loads(pickle.dumps((cls, config)))
        p.expect(cls2 is cls and dataclasses.asdict(config2) == dataclasses.asdict(config),
                 "class and config round-trip through pickle",
                 f"unpickled {cls2!r} with {config2!r}, expected {cls!r} with {config!r}")
        with p.step("the plugin rebuilt from the unpickled config scores"):
            rebuilt = cls2(config2, tokenizer=tokenizer, **ctx)(batch)
        _expect_same_reward(p, "the plugin rebuilt from the unpickled config scores the same", out, rebuilt)
    return out


def _check_reward_output(p: _Plugin, out: Any, batch: RolloutBatch) -> None:
    b, device = len(batch), batch.response_ids.device
    p.expect(isinstance(out, RewardOutput), "returns a RewardOutput", f"returned a {type(out).__name__}")
    s = out.scores_B
    p.expect(isinstance(s, torch.Tensor) and s.dtype.is_floating_point and tuple(s.shape) == (b,),
             "scores_B is a float tensor [B]",
             lambda: f"got {type(s).__name__} {getattr(s, 'dtype', '')} {tuple(getattr(s, 'shape', ()))}, B={b}")
    p.expect(bool(torch.isfinite(s).all()), "scores_B is finite", f"scores_B = {s.tolist()}")
    p.expect(s.device == device, "scores_B is on the batch's device", f"{s.device}, the batch is on {device}")
    p.expect(not s.requires_grad, "scores_B carries no autograd graph", "scores_B.requires_grad is True")
    c = out.correct_B
    p.expect(c is None or isinstance(c, torch.Tensor) and c.dtype == torch.bool and tuple(c.shape) == (b,)
             and c.device == device, "correct_B is None or a bool tensor [B] on the batch's device",
             lambda: f"got {type(c).__name__} {getattr(c, 'dtype', '')} {tuple(getattr(c, 'shape', ()))} "
                     f"on {getattr(c, 'device', '-')}, B={b}")
    p.expect(isinstance(out.info, Mapping), "info is a dict of per-sample lists", f"info is a {type(out.info)}")
    bad = {k: v for k, v in out.info.items() if not isinstance(k, str) or not isinstance(v, list) or len(v) != b}
    p.expect(not bad, "info is a dict of per-sample lists",
             lambda: f"entries {sorted(map(str, bad))} are not lists of B={b} values: "
                     f"{ {k: type(v).__name__ for k, v in bad.items()} }")


def _expect_same_reward(p: _Plugin, check: str, a: RewardOutput, b: Any) -> None:
    p.expect(isinstance(b, RewardOutput), check, f"returned a {type(b).__name__}")
    same = (torch.equal(a.scores_B, b.scores_B)
            and (a.correct_B is None) == (b.correct_B is None)
            and (a.correct_B is None or torch.equal(a.correct_B, b.correct_B))
            and a.info == b.info)
    p.expect(same, check, lambda: f"scores {a.scores_B.tolist()} then {b.scores_B.tolist()}; correct "
             f"{_listed(a.correct_B)} then {_listed(b.correct_B)}; info {a.info} then {b.info}")


# ---- advantage estimators -----------------------------------------------------------------------------


def check_advantage_estimator(cls: type, *, config: Any = None, seed: int = 0) -> None:
    """Check an advantage estimator on a random ragged batch of 4 prompts × 2 samples."""
    p = _Plugin(cls, "advantage_estimators")
    config = check_plugin_class(cls, "advantage_estimators", config=config)
    with p.step("built as cls(config)"):
        est = cls(config)
    p.expect(isinstance(est, AdvantageEstimator), "AdvantageEstimator protocol",
             "the instance is not callable or lacks Config/needs_group/needs_critic")
    g = torch.Generator().manual_seed(seed)
    mask_BT = _mask_BT([6, 2, 5, 1, 3, 6, 4, 4], 6)
    inputs: dict[str, torch.Tensor | None] = dict(
        token_rewards_BT=torch.randn(mask_BT.shape, generator=g) * mask_BT, response_mask_BT=mask_BT,
        group_index_B=torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]),
        values_BT=torch.randn(mask_BT.shape, generator=g) * mask_BT if cls.needs_critic else None,  # type: ignore[attr-defined]
    )
    if getattr(cls, "needs_teacher", False):  # a distillation estimator: log-probs of the student and the teacher
        inputs["logprobs_BT"] = -torch.rand(mask_BT.shape, generator=g) * 3 * mask_BT
        inputs["teacher_logprobs_BT"] = -torch.rand(mask_BT.shape, generator=g) * 3 * mask_BT
    before = {k: v.clone() for k, v in inputs.items() if v is not None}
    out = _estimate(p, est, inputs, "__call__ on a ragged batch")
    for name, x in zip(("advantages_BT", "returns_BT"), out, strict=True):
        p.expect(tuple(x.shape) == tuple(mask_BT.shape) and x.dtype == mask_BT.dtype, f"{name} is [B, T] float",
                 f"{tuple(x.shape)} {x.dtype}, expected {tuple(mask_BT.shape)} {mask_BT.dtype}")
        p.expect(bool(torch.isfinite(x).all()), f"{name} is finite", f"{name} = {x.tolist()}")
        p.expect(bool((x[mask_BT == 0] == 0).all()), f"{name} is zero outside the response mask",
                 f"{name} = {x.tolist()}, mask = {mask_BT.tolist()}")
    p.expect(bool(out[0].abs().sum() > 0), "advantages are not all zero",
             "all advantages are 0 on a batch whose samples have different rewards")
    p.expect(_tensors_equal(before, inputs), "leaves its inputs unchanged",
             "an input tensor changed during the call")
    _expect_same(p, "the same inputs twice give the same outputs", out,
                 _estimate(p, est, inputs, "__call__ a second time"), exact=True)
    perm = torch.randperm(len(mask_BT), generator=g)
    row_ids = torch.tensor([907, 13, 4000, 2])  # dataset row ids, as the trainer passes them
    shuffled = {k: None if v is None else v[perm] for k, v in inputs.items()}
    shuffled["group_index_B"] = row_ids[inputs["group_index_B"]][perm]  # type: ignore[index]
    _expect_same(p, "outputs follow the samples when they are shuffled and the group ids are dataset rows",
                 tuple(x[perm] for x in out), _estimate(p, est, shuffled, "__call__ on the shuffled batch"))


def _estimate(p: _Plugin, est: Any, inputs: Mapping[str, torch.Tensor | None],
              check: str) -> tuple[torch.Tensor, torch.Tensor]:
    with p.step(check):
        out = est(**inputs)
    p.expect(isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out),
             "returns (advantages_BT, returns_BT)", f"returned {type(out).__name__}")
    return out[0], out[1]


# ---- policy losses ------------------------------------------------------------------------------------


def check_policy_loss(cls: type, *, config: Any = None, loss_agg_modes: Sequence[str] = LOSS_AGG_MODES,
                      seed: int = 0) -> None:
    """Check a policy loss in each of ``loss_agg_modes`` on a random ragged batch."""
    p = _Plugin(cls, "policy_losses")
    config = check_plugin_class(cls, "policy_losses", config=config)
    with p.step("built as cls(config)"):
        loss_fn = cls(config)
    p.expect(isinstance(loss_fn, PolicyLoss), "PolicyLoss protocol", "the instance is not callable or has no Config")
    g = torch.Generator().manual_seed(seed)
    mask_BT = _mask_BT([5, 1, 4, 0, 3], 5)  # an empty response too
    old_BT = -torch.rand(mask_BT.shape, generator=g) * 3
    noisy_BT = old_BT + torch.randn(mask_BT.shape, generator=g) * 0.3  # some tokens outside the clip range
    adv_BT = torch.randn(mask_BT.shape, generator=g) * mask_BT
    for mode in loss_agg_modes:
        inputs = dict(old_logprobs_BT=old_BT, advantages_BT=adv_BT, response_mask_BT=mask_BT, loss_agg_mode=mode)
        before = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        logp_BT = noisy_BT.clone().requires_grad_(True)
        loss, metrics = _loss(p, loss_fn, dict(inputs, logprobs_BT=logp_BT), f"__call__ ({mode})")
        p.expect(loss.dim() == 0 and bool(torch.isfinite(loss)) and loss.requires_grad,
                 f"a finite scalar loss with a gradient ({mode})",
                 f"loss {loss!r} (dim {loss.dim()}, requires_grad {loss.requires_grad})")
        missing = {"pg_loss", "clipfrac", "ppo_kl"} - set(metrics)
        p.expect(not missing, f"metrics include pg_loss, clipfrac, ppo_kl ({mode})", f"missing {sorted(missing)}")
        for name, value in metrics.items():
            p.expect(isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad
                     and bool(torch.isfinite(value)), f"metric {name!r} is a finite 0-dim tensor without grad ({mode})",
                     f"got {value!r}")
        with p.step(f"loss.backward() ({mode})"):
            loss.backward()
        grad = logp_BT.grad
        p.expect(grad is not None and bool(torch.isfinite(grad).all()), f"the gradient is finite ({mode})",
                 f"grad = {grad}")
        assert grad is not None
        p.expect(bool((grad[mask_BT == 0] == 0).all()), f"no gradient on padding ({mode})", f"grad = {grad.tolist()}")
        p.expect(_tensors_equal(before, inputs), f"leaves its inputs unchanged ({mode})",
                 "an input tensor changed during the call")
        again = _loss(p, loss_fn, dict(inputs, logprobs_BT=noisy_BT.clone()), f"__call__ again ({mode})")
        _expect_same(p, f"the same inputs twice give the same loss and metrics ({mode})",
                     (loss.detach(), *[metrics[k] for k in sorted(metrics)]),
                     (again[0].detach(), *[again[1].get(k, torch.tensor(math.nan)) for k in sorted(metrics)]),
                     exact=True)
        _, on_policy = _loss(p, loss_fn, dict(inputs, logprobs_BT=old_BT.clone()), f"__call__ on-policy ({mode})")
        p.expect(abs(on_policy["ppo_kl"].item()) < 1e-7 and on_policy["clipfrac"].item() == 0,
                 f"on-policy (logprobs == old): ppo_kl == 0 and clipfrac == 0 ({mode})",
                 f"ppo_kl {on_policy['ppo_kl'].item()}, clipfrac {on_policy['clipfrac'].item()}")
        norm = local_normalizer(mask_BT, mode)
        whole = _loss(p, loss_fn, dict(inputs, logprobs_BT=noisy_BT, global_normalizer=norm),
                      f"__call__ with global_normalizer ({mode})")[0]
        parts = [_loss(p, loss_fn, dict(old_logprobs_BT=old_BT[rows], advantages_BT=adv_BT[rows],
                                         response_mask_BT=mask_BT[rows], loss_agg_mode=mode,
                                         logprobs_BT=noisy_BT[rows], global_normalizer=norm),
                       f"__call__ on a micro-batch ({mode})")[0] for rows in (slice(0, 2), slice(2, None))]
        _expect_same(p, f"global_normalizer = the batch's own denominator gives the plain loss ({mode})",
                     (loss.detach(),), (whole.detach(),))
        _expect_same(p, f"micro-batch losses with the mini-batch's global_normalizer add up to its loss ({mode})",
                     (whole.detach(),), (torch.stack(parts).detach().sum(),))


def _loss(p: _Plugin, loss_fn: Any, inputs: Mapping[str, Any], check: str) -> tuple[torch.Tensor, dict[str, Any]]:
    with p.step(check):
        out = loss_fn(**inputs)
    p.expect(isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)
             and isinstance(out[1], Mapping), "returns (loss, metrics)", f"returned {type(out).__name__}")
    return out[0], dict(out[1])


# ---- rollout engines ----------------------------------------------------------------------------------


def check_rollout_engine(cls: type, *, model_path: str | Path, config: Any = None, device: torch.device | str = "cpu",
                         tp_size: int = 1, seeded: bool = True,
                         storage: Callable[[Any], Mapping[str, int]] | None = None, **ctx: Any) -> None:
    """Start the engine on ``model_path`` (a small HF checkpoint: its weights are streamed back in,
    perturbed, twice), check it, shut it down.

    ``seeded=False``: the engine documents that it cannot honour per-sample seeds (e.g. SGLang on CPU),
    so seeded reproducibility is not checked. ``storage(engine)`` reads ``{parameter name: data_ptr}``
    of the engine's weights; by default those of the ``torch.nn.Module`` attributes of the engine,
    and the in-place check is skipped when there are none (e.g. weights in another process).
    """
    p = _Plugin(cls, "rollout_engines")
    config = check_plugin_class(cls, "rollout_engines", config=config)
    ctx = {"model_path": str(model_path), "device": torch.device(device), "tp_size": tp_size, **ctx,
           EXTRA_CTX_KEY: True}
    with p.step(f"built as cls(config, {', '.join(ctx)}=...)"):
        engine = cls(config, **ctx)
    try:
        p.expect(isinstance(engine, RolloutEngine), "RolloutEngine protocol",
                 "the instance lacks generate/update_weights/release_memory/resume_memory/shutdown")
        run = _EngineRun(p, engine, Path(model_path))
        run.check_sampling(seeded=seeded)
        run.check_weight_swap(storage or _module_storage, device=device)
    finally:
        with p.step("shutdown()"):
            engine.shutdown()


class _EngineRun:
    """One engine under check, with its prompts (valid ids of the checkpoint's vocabulary) and stop ids."""

    SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=6, n=2)
    GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
    SEEDS = [11, 12, 13]

    def __init__(self, p: _Plugin, engine: Any, model_path: Path) -> None:
        from hybridrl.hf.arch import eos_token_ids

        self.p, self.engine, self.model_path = p, engine, model_path
        vocab = int(json.loads((model_path / "config.json").read_text())["vocab_size"])
        self.prompts = [[(first + k) % vocab for k in range(length)] for first, length in ((3, 5), (9, 2), (12, 3))]
        self.stops = set(eos_token_ids(model_path))

    def check_sampling(self, *, seeded: bool) -> None:
        p, sampled = self.p, self.SAMPLED
        gens = self.generate(self.prompts, sampled, version=0, seeds=self.SEEDS, what="sampling, n=2, seeded")
        with p.step("generate([]) returns []"):
            none = self.engine.generate([], sampled)
        p.expect(none == [], "generate([]) returns []", f"returned {none!r}")
        if seeded:
            again = self.generate(self.prompts, sampled, version=0, seeds=self.SEEDS, what="the same seeds again")
            p.expect(_tokens(again) == _tokens(gens), "the same seeds give the same samples",
                     lambda: f"{_tokens(gens)} then {_tokens(again)}")
            alone = self.generate([self.prompts[2], self.prompts[0]], sampled, version=0,
                                  seeds=[self.SEEDS[2], self.SEEDS[0]], what="a subset of the prompts, reordered")
            want = [g.token_ids for i in (2, 0) for g in gens if g.prompt_index == i]
            p.expect(_tokens(alone) == want,
                     "a prompt's samples depend on its seed alone, not on the other prompts of the call",
                     lambda: f"expected {want}, got {_tokens(alone)}")
        self.greedy = self.generate(self.prompts, self.GREEDY, version=0, what="greedy")
        self.expect_greedy("greedy (temperature 0) repeats itself", version=0)
        if "max_new_tokens" in inspect.signature(self.engine.generate).parameters:
            self.check_caps()
        if getattr(self.engine, "supports_abort", False):
            self.check_abort()

    def check_abort(self) -> None:
        """``supports_abort``: after ``abort()`` a call returns at once, every sample cut short (``"abort"``) with
        no more tokens than it could have; after ``resume()`` the engine samples as before."""
        with self.p.step("abort(), then generate"):
            self.engine.abort()
            try:
                cut = self.engine.generate(self.prompts, self.GREEDY)
            finally:
                self.engine.resume()
        self.p.expect(len(cut) == len(self.prompts) and all(g.finish_reason == "abort" for g in cut),
                      "after abort() every unfinished sample comes back with finish_reason 'abort'",
                      lambda: f"got {[(g.token_ids, g.finish_reason) for g in cut]}")
        self.p.expect(all(g.token_ids == s.token_ids[:len(g.token_ids)] for g, s in zip(cut, self.greedy, strict=True)),
                      "an aborted sample holds a prefix of what it would have sampled",
                      lambda: f"got {_tokens(cut)}, full {_tokens(self.greedy)}")
        self.expect_greedy("after resume() the engine samples as before", version=0)

    def check_caps(self) -> None:
        """The optional per-prompt caps (``generate(..., max_new_tokens=[...])``): each prompt's greedy samples are
        the uncapped ones cut to their cap."""
        caps = [1, 3, 6]
        with self.p.step("generate with per-prompt max_new_tokens"):
            capped = self.engine.generate(self.prompts, self.GREEDY, max_new_tokens=caps)
        want = [g.token_ids[:caps[g.prompt_index]] for g in self.greedy]
        self.p.expect(_tokens(capped) == want, "max_new_tokens[i] caps prompt i's samples (a prefix of the uncapped)",
                      lambda: f"expected {want}, got {_tokens(capped)}")

    def check_weight_swap(self, storage: Callable[[Any], Mapping[str, int]], *, device: torch.device | str) -> None:
        from hybridrl.hf.tensors import SafetensorsReader, tensor_files

        p, engine = self.p, self.engine
        with SafetensorsReader(self.model_path) as reader:
            original = [(n, reader.read(n)) for n in sorted(tensor_files(self.model_path))]
        gen = torch.Generator().manual_seed(0)
        perturbed = [(n, t + (0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype)) for n, t in original]
        ptrs = storage(engine)
        in_place, moved = "update_weights keeps the parameters' storage (in place)", "a parameter's data_ptr changed"
        with p.step("update_weights(perturbed weights, version=1)"):
            engine.update_weights(_buckets(perturbed, device), version=1)
        p.expect(storage(engine) == ptrs, in_place, moved)
        changed = self.generate(self.prompts, self.GREEDY, version=1, what="greedy after update_weights")
        p.expect(any(a.token_ids != b.token_ids or _max_diff(a.logprobs, b.logprobs) > 1e-3
                     for a, b in zip(self.greedy, changed, strict=True)), "update_weights takes effect",
                 "greedy tokens and log-probs are the same after streaming in perturbed weights")
        want = _reference_logprobs(self.model_path, dict(perturbed), self.prompts, changed)
        p.expect(all(_max_diff(g.logprobs, w) <= 1e-3 for g, w in zip(changed, want, strict=True)),
                 "after update_weights the engine serves exactly the streamed weights (its greedy samples' log-probs "
                 "equal transformers' on those weights, within 1e-3)",
                 lambda: "largest log-prob difference "
                         f"{max(_max_diff(g.logprobs, w) for g, w in zip(changed, want, strict=True))}: part of the "
                         "model (e.g. a tied LM head) still computes with the old weights")
        with p.step("update_weights(original weights, version=2)"):
            engine.update_weights(_buckets(original, device), version=2)
        p.expect(storage(engine) == ptrs, in_place, moved)
        self.expect_greedy("streaming the original weights back restores the original outputs", version=2)
        with p.step("release_memory() then resume_memory()"):
            engine.release_memory()
            engine.resume_memory()
        self.expect_greedy("release_memory/resume_memory keep the outputs", version=2)

    def expect_greedy(self, check: str, *, version: int) -> None:
        """Greedy generation now gives the first greedy tokens and log-probs (within 1e-4)."""
        a, b = self.greedy, self.generate(self.prompts, self.GREEDY, version=version, what=check)
        self.p.expect(_tokens(a) == _tokens(b) and all(_max_diff(x.logprobs, y.logprobs) <= 1e-4
                                                       for x, y in zip(a, b, strict=True)), check,
                      lambda: f"tokens {_tokens(a)} then {_tokens(b)}, largest log-prob difference "
                              f"{max(_max_diff(x.logprobs, y.logprobs) for x, y in zip(a, b, strict=True))}")

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, version: int, what: str,
                 seeds: list[int] | None = None) -> list[Generation]:
        p, check = self.p, f"generate ({what})"
        with p.step(check):
            gens = self.engine.generate(prompts, params, seeds=seeds)
        p.expect(isinstance(gens, list) and all(isinstance(g, Generation) for g in gens),
                 f"{check} returns Generations", f"returned {type(gens).__name__}")
        order = [g.prompt_index for g in gens]
        p.expect(order == [i for i in range(len(prompts)) for _ in range(params.n)],
                 f"{check}: n={params.n} samples per prompt, prompt-major", f"prompt_index order {order}")
        for g in gens:
            problems = _generation_problems(g, params, self.stops | set(params.stop_token_ids), version=version)
            p.expect(not problems, f"{check}: Generation fields", f"{g}: {'; '.join(problems)}")
        return gens


def _generation_problems(g: Generation, params: SamplingParams, stops: set[int], *, version: int) -> list[str]:
    tokens, n = g.token_ids, len(g.token_ids)
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens)):
        return [f"token_ids is not a non-empty list of ints: {tokens!r}"]
    problems = []
    if n > params.max_new_tokens:
        problems.append(f"{n} tokens > max_new_tokens={params.max_new_tokens}")
    if len(g.logprobs) != n:
        problems.append(f"{len(g.logprobs)} log-probs for {n} tokens")
    if not all(math.isfinite(x) and x <= 1e-5 for x in g.logprobs):
        problems.append("log-probs are not all finite and ≤ 0")
    if g.finish_reason not in ("stop", "length"):
        problems.append(f"finish_reason {g.finish_reason!r} is neither 'stop' nor 'length'")
    if g.finish_reason == "stop" and tokens[-1] not in stops:
        problems.append(f"finish_reason 'stop' but the last token is no stop token {sorted(stops)}")
    if g.finish_reason == "length" and n != params.max_new_tokens:
        problems.append(f"finish_reason 'length' after {n} < max_new_tokens={params.max_new_tokens} tokens")
    if set(tokens[:-1]) & stops:
        problems.append("a stop token before the last token")
    if not isinstance(g.weight_version, int) or g.weight_version != version:
        problems.append(f"weight_version {g.weight_version!r}, expected {version}")
    return problems


def _buckets(weights: list[tuple[str, torch.Tensor]], device: torch.device | str) -> Iterator[WeightBucket]:
    """The weights as a lazy stream of two buckets, on ``device`` (as the trainer streams them)."""
    half = (len(weights) + 1) // 2
    for part in (weights[:half], weights[half:]):
        yield [(n, t.to(device)) for n, t in part]


def _reference_logprobs(model_path: Path, weights: dict[str, torch.Tensor], prompts: list[list[int]],
                        gens: Sequence[Generation]) -> list[list[float]]:
    """transformers' (fp32) untempered log-probs of each greedy sample's tokens, on ``weights``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    out = []
    with torch.no_grad():
        for g in gens:
            prompt = prompts[g.prompt_index]
            logits = model(torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1:-1].float()
            out.append(logits.log_softmax(-1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0].tolist())
    return out


def _module_storage(engine: Any) -> dict[str, int]:
    """``{name: data_ptr}`` of the parameters of the engine's ``torch.nn.Module`` attributes."""
    return {f"{attr}.{n}": param.data_ptr() for attr, value in sorted(vars(engine).items())
            if isinstance(value, torch.nn.Module) for n, param in value.named_parameters()}


# ---- tools and environments (multi-turn rollouts) --------------------------------------------------------

_DUMMY = {"string": "1", "integer": 1, "number": 1.0, "boolean": False, "array": [], "object": {}}


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, awaited when it is a coroutine function (tools and episodes may be either)."""
    import asyncio
    import inspect

    out = fn(*args)
    return asyncio.run(out) if inspect.iscoroutine(out) else out


def check_tool(cls: type, *, config: Any = None, arguments: Sequence[Mapping[str, Any]] = ()) -> None:
    """A ``hybridrl.tools`` plugin: ``Config``; built as ``cls(config, **ctx)`` (an unknown ctx key accepted);
    ``schema`` an OpenAI function schema (``{"type": "function", "function": {"name", "description",
    "parameters": {"type": "object", ...}}}``); called with ``arguments`` (default: one dict of placeholder values
    for the schema's required parameters) it returns a ``str`` or raises an ``Exception`` (an error observation);
    the same call returns the same text."""
    p = _Plugin(cls, "tools")
    config = check_plugin_class(cls, "tools", config=config)
    with p.step("build with an unknown ctx key"):
        tool = cls(config, **{EXTRA_CTX_KEY: 1})
    schema = getattr(tool, "schema", None)
    fn = schema.get("function") if isinstance(schema, dict) and schema.get("type") == "function" else None
    p.expect(isinstance(fn, dict) and isinstance(fn.get("name"), str) and bool(fn["name"]), "schema",
             f'expected {{"type": "function", "function": {{"name": ..., ...}}}}, got {schema!r}')
    assert isinstance(fn, dict)
    params = fn.get("parameters")
    p.expect(isinstance(fn.get("description"), str) and isinstance(params, dict) and params.get("type") == "object",
             "schema", "function needs a description and parameters of type object (JSON Schema)")
    assert isinstance(params, dict)
    if not arguments:
        props = params.get("properties", {})
        arguments = [{k: _DUMMY.get(props.get(k, {}).get("type"), "1") for k in params.get("required", [])}]
    for args in arguments:
        outs = []
        for _ in range(2):
            try:
                outs.append(_run(tool, dict(args)))
            except Exception as e:  # an error observation: allowed
                outs.append(f"raised {type(e).__name__}: {e}")
        p.expect(all(isinstance(o, str) for o in outs), "returns str",
                 f"called with {dict(args)!r} it returned {type(outs[0]).__name__}: the policy reads text")
        p.expect(outs[0] == outs[1], "same call, same text", f"{dict(args)!r} gave {outs[0]!r}, then {outs[1]!r}")


def check_environment(cls: type, *, config: Any = None, meta: SampleMeta | None = None,
                      replies: Sequence[str] = ("3", "4", "5", "6")) -> None:
    """A ``hybridrl.environments`` plugin: ``Config``; built as ``cls(config, **ctx)``; ``open(meta, seed=...)``
    gives an episode whose ``step`` answers each assistant message of ``replies`` with an ``EnvStep`` (chat
    messages with str role and content, bool ``done``, float-or-None ``reward``) until ``done``; the same seed
    gives the same steps."""
    from hybridrl.interfaces import EnvStep

    p = _Plugin(cls, "environments")
    config = check_plugin_class(cls, "environments", config=config)
    with p.step("build with an unknown ctx key"):
        env = cls(config, **{EXTRA_CTX_KEY: 1})
    meta = meta if meta is not None else SampleMeta(  # a sample as a multi-turn rollout has it: a chat prompt
        ground_truth=GROUND_TRUTHS[0], data_source="arithmetic",
        messages=[{"role": "user", "content": f"What is {int(GROUND_TRUTHS[0]) - 1}+1?"}])

    def play() -> list[EnvStep]:
        with p.step("open and step an episode"):
            episode, steps = env.open(meta, seed=7), []
            for reply in replies:
                steps.append(_run(episode.step, {"role": "assistant", "content": reply}))
                if not isinstance(steps[-1], EnvStep) or steps[-1].done:
                    break
            if callable(getattr(episode, "close", None)):
                _run(episode.close)
        return steps

    steps = play()
    for s in steps:
        p.expect(isinstance(s, EnvStep), "step returns EnvStep", f"got {type(s).__name__}")
        p.expect(isinstance(s.done, bool) and (s.reward is None or isinstance(s.reward, (int, float))),
                 "EnvStep fields", f"done={s.done!r}, reward={s.reward!r}")
        p.expect(all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                     for m in s.messages), "EnvStep.messages", f"chat messages with str role/content: {s.messages!r}")
    p.expect(steps == play(), "same seed, same steps", "two episodes opened with seed 7 differ")


# ---- shared -------------------------------------------------------------------------------------------

CHECKS: dict[str, Callable[..., Any]] = {
    "rollout_engines": check_rollout_engine,
    "reward_managers": check_reward_manager,
    "advantage_estimators": check_advantage_estimator,
    "policy_losses": check_policy_loss,
    "tools": check_tool,
    "environments": check_environment,
}


def _mask_BT(lengths: list[int], t: int) -> torch.Tensor:
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()


def _tensors(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    return {f.name: getattr(batch, f.name).clone() for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)}


def _tensors_equal(before: Mapping[str, torch.Tensor], now: Mapping[str, Any]) -> bool:
    """Every tensor of ``before`` is still in ``now``, unchanged."""
    return all(isinstance(now.get(k), torch.Tensor) and torch.equal(v, now[k]) for k, v in before.items())


def _expect_same(p: _Plugin, check: str, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], *,
                 exact: bool = False) -> None:
    same = len(a) == len(b) and all(
        x.shape == y.shape and (torch.equal(x, y) if exact else torch.allclose(x, y, rtol=1e-5, atol=1e-6))
        for x, y in zip(a, b, strict=True))
    p.expect(same, check, lambda: f"{[x.tolist() for x in a]} vs {[y.tolist() for y in b]}")


def _max_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=False)), default=0.0) if len(a) == len(b) else math.inf


def _listed(x: torch.Tensor | None) -> Any:
    return None if x is None else x.tolist()


def _tokens(gens: Sequence[Generation]) -> list[list[int]]:
    return [g.token_ids for g in gens]
