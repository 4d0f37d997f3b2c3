"""The rollout engine contract: check_rollout_engine and the run of one engine under check."""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridrl.interfaces import Generation, RolloutEngine, SamplingParams, WeightBucket
from hybridrl.testing.kit import EXTRA_CTX_KEY, _Plugin, check_plugin_class


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


def _max_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=False)), default=0.0) if len(a) == len(b) else math.inf


def _tokens(gens: Sequence[Generation]) -> list[list[int]]:
    return [g.token_ids for g in gens]
