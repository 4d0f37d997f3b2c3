"""``reward.name=function``: score with your own Python function, no plugin package needed.

``reward.kwargs.path`` names it: ``my_pkg.rewards:score_fn`` (an importable module) or ``/path/to/file.py:score_fn``
(a file, relative paths from the working directory). It must import wherever the reward runs: in each trainer
rank, and in each worker process with ``reward.num_workers > 0`` (a module: on the workers' ``sys.path``).
``reward.kwargs.fn_kwargs`` are passed to every call as extra keyword arguments.

``granularity: sample`` (default) — one call per response, the counterpart of verl's
``compute_score(data_source, solution_str, ground_truth, extra_info)``::

    def score_fn(response: str, ground_truth: str | None, *, data_source: str, extra: dict, prompt: str,
                 **fn_kwargs) -> float | dict:

``response`` and ``prompt`` are decoded without special tokens; ``data_source`` and ``extra`` (the dataset's other
columns) come from the sample's ``SampleMeta``. Return a number, or a dict with ``score`` (a number), optionally
``correct`` (bool: the accuracy metrics use it when every sample reports it; otherwise score > 0 counts as
correct) and any other keys (kept per sample in ``RewardOutput.info``). An exception names its sample (the
reward runner reports it, and with ``reward.on_error=zero`` scores that sample 0).

``granularity: batch`` — one call per batch, for rewards that batch their work (a model, a sandbox)::

    def score_fn(batch: RolloutBatch, tokenizer, **fn_kwargs) -> RewardOutput | list[float]:

The function is resolved (imported, its signature checked) when the config is validated, before any model is
built. It runs next to the trainer's log-prob passes (``overlaps_compute``): it must not use
``torch.distributed``; one that needs the accelerator or must be killable runs with ``reward.num_workers > 0``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import numbers
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import RewardOutput
from hybridrl.rewards.response_text import decode, response_tokens

if TYPE_CHECKING:  # annotations only: static validation loads these classes without transformers
    from transformers import PreTrainedTokenizerBase

GRANULARITIES = ("sample", "batch")
KEY = "reward.kwargs.path"


class FunctionReward:
    overlaps_compute: ClassVar[bool] = True

    @dataclass(slots=True, kw_only=True)
    class Config:
        path: str  # "module.sub:function" or "/path/to/file.py:function"
        granularity: Literal["sample", "batch"] = "sample"  # one call per response, or per batch
        fn_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of every call

        def __post_init__(self) -> None:
            if self.granularity not in GRANULARITIES:
                raise ValueError(f"granularity={self.granularity!r} is not valid; valid: {list(GRANULARITIES)}")
            check_signature(load_function(self.path), self.path, self.granularity, self.fn_kwargs)

    def __init__(self, config: Config, *, tokenizer: PreTrainedTokenizerBase, **ctx: Any) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.fn = load_function(config.path)

    def __call__(self, batch: RolloutBatch) -> RewardOutput:
        if self.config.granularity == "batch":
            out = self.fn(batch, self.tokenizer, **self.config.fn_kwargs)
            return out if isinstance(out, RewardOutput) else RewardOutput(scores_B=torch.as_tensor(
                out, dtype=torch.float32, device=batch.response_ids.device))
        results = [self._score_sample(batch, i, tokens) for i, tokens in enumerate(response_tokens(batch))]
        scores = [s for s, _ in results]
        corrects = [c for _, (c, _) in results]
        info: dict[str, list[Any]] = {}
        for i, (_, (_, extras)) in enumerate(results):
            for key, value in extras.items():
                info.setdefault(key, [None] * len(batch))[i] = value
        device = batch.response_ids.device
        correct_B = (torch.tensor(corrects, dtype=torch.bool, device=device)
                     if all(c is not None for c in corrects) else None)
        return RewardOutput(scores_B=torch.tensor(scores, dtype=torch.float32, device=device), correct_B=correct_B,
                            info=info)

    def _score_sample(self, batch: RolloutBatch, i: int,
                      tokens: list[int]) -> tuple[float, tuple[bool | None, dict[str, Any]]]:
        meta = batch.meta[i]
        prompt_ids = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        try:
            result = self.fn(decode(self.tokenizer, tokens, skip_special_tokens=True), meta.ground_truth,
                             data_source=meta.data_source, extra=dict(meta.extra),
                             prompt=decode(self.tokenizer, prompt_ids, skip_special_tokens=True),
                             **self.config.fn_kwargs)
            return unpack(result, self.config.path)
        except Exception as e:
            e.sample_index = i  # type: ignore[attr-defined]  # the runner names the sample (scoring.py)
            raise


def unpack(result: object, path: str) -> tuple[float, tuple[bool | None, dict[str, Any]]]:
    """``(score, (correct or None, other keys))`` from what a sample-granularity function returned."""
    if isinstance(result, dict):
        score = result.get("score")
        if isinstance(score, numbers.Real):
            extras = {k: v for k, v in result.items() if k not in ("score", "correct")}
            correct = result.get("correct")
            return float(score), (None if correct is None else bool(correct), extras)
        raise TypeError(f"{path} returned a dict whose 'score' is {score!r}; expected a number")
    if isinstance(result, numbers.Real):
        return float(result), (None, {})
    raise TypeError(f"{path} returned {type(result).__name__} {result!r}; expected a number or a dict with 'score'")


def load_function(path: str) -> Callable[..., Any]:
    """The function at ``module:attr`` or ``file.py:attr``; a ValueError naming ``reward.kwargs.path`` otherwise."""
    target, sep, attr = path.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"{KEY}={path!r}: expected 'module.sub:function' or '/path/to/file.py:function'")
    is_file = target.endswith(".py") or "/" in target
    try:
        module = _import_file(Path(target)) if is_file else importlib.import_module(target)
    except FileNotFoundError:
        raise ValueError(f"{KEY}={path!r}: no such file {str(Path(target).resolve())!r}") from None
    except Exception as e:  # ImportError, or the module's own code failing
        what = "loading the file" if is_file else "importing the module"
        raise ValueError(f"{KEY}={path!r}: {what} {target!r} raised {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        got = "has no attribute" if fn is None else f"has a non-callable {type(fn).__name__}"
        raise ValueError(f"{KEY}={path!r}: {target!r} {got} {attr!r}; its functions: {', '.join(found) or '(none)'}")
    return fn  # type: ignore[no-any-return]


def check_signature(fn: Callable[..., Any], path: str, granularity: str, fn_kwargs: dict[str, Any]) -> None:
    """A ValueError naming ``reward.kwargs.path`` when ``fn`` cannot take the calls of ``granularity``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: it will tell at the first call
        return
    try:
        if granularity == "sample":
            sig.bind("", None, data_source="", extra={}, prompt="", **fn_kwargs)
        else:
            sig.bind(None, None, **fn_kwargs)
    except TypeError as e:
        want = ("(response, ground_truth, *, data_source, extra, prompt" if granularity == "sample"
                else "(batch, tokenizer") + (", " + ", ".join(fn_kwargs) if fn_kwargs else "") + ")"
        raise ValueError(f"{KEY}={path!r}: {fn.__name__}{sig} cannot be called as {want} "
                         f"(granularity={granularity!r}): {e}") from None


def _import_file(file: Path) -> Any:
    """The module of a ``.py`` file, loaded once per process under a name derived from its absolute path."""
    file = file.expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(file)
    name = f"hybridrl_reward_fn_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
