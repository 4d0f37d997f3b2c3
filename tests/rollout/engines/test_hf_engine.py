"""The `hf` rollout engine: sampling, log-probs, stop handling and the in-place weight swap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hybridrl.interfaces import SamplingParams
from hybridrl.models.tiny import make_tiny_model
from hybridrl.registry import Registry
from hybridrl.rollout.engines.hf import HFRolloutEngine

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("hf_engine")
    a = make_tiny_model(tmp / "a", hidden=64, layers=2, heads=4, kv_heads=2, seed=1)
    b = make_tiny_model(tmp / "b", hidden=64, layers=2, heads=4, kv_heads=2, seed=2)
    return a, b


def engine(path: Path, **kw: object) -> HFRolloutEngine:
    return Registry("rollout_engines").build("hf", kw, key="actor_rollout_ref.rollout.engine_kwargs",
                                             model_path=str(path))


def test_greedy_matches_transformers_generate(models: tuple[Path, Path]) -> None:
    eng = engine(models[0])
    out = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))
    ref = AutoModelForCausalLM.from_pretrained(models[0]).eval()
    for g, p in zip(out, PROMPTS, strict=True):
        want = ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                            eos_token_id=eng.eos_ids, pad_token_id=eng.pad_id)[0, len(p):].tolist()
        assert g.token_ids == want[:len(g.token_ids)]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_match_a_full_forward(models: tuple[Path, Path], temperature: float) -> None:
    eng = engine(models[0])
    out = eng.generate(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=8, n=2), seeds=[3, 4, 5])
    ref = AutoModelForCausalLM.from_pretrained(models[0]).eval()
    for g in out:
        ids = torch.tensor([PROMPTS[g.prompt_index] + g.token_ids])
        with torch.no_grad():
            logits = ref(ids).logits[0, len(PROMPTS[g.prompt_index]) - 1:-1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), -1)
        want = logp.gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(g.logprobs), want, atol=1e-5), (g.logprobs, want)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_score_is_a_teacher_forced_full_forward(models: tuple[Path, Path], temperature: float) -> None:
    """``score`` (a teacher on its own engine): each sequence's tokens from ``start`` on, given the ones before, under
    softmax(logits / T), and the top-k there — sequences of different lengths in one chunk (padding must not leak)."""
    eng = engine(models[0], max_batch_size=2)  # three sequences: two chunks
    seqs, starts = [[5, 6, 7, 8, 9, 20, 21], [10, 11, 30], [12, 13, 14, 40, 41, 42, 43, 44]], [5, 2, 1]
    ref = AutoModelForCausalLM.from_pretrained(models[0]).eval()
    got = eng.score(seqs, starts=starts, topk=4, temperature=temperature)
    for s, start, g in zip(seqs, starts, got, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(ref(torch.tensor([s])).logits[0, start - 1:-1].float() / temperature, -1)
        want = logp.gather(-1, torch.tensor(s[start:])[:, None]).squeeze(-1)
        assert g.logprobs.shape == (len(s) - start,) and torch.allclose(g.logprobs, want, atol=1e-5)
        assert g.topk_ids is not None and g.topk_logprobs is not None
        assert torch.equal(g.topk_ids, logp.topk(4, -1).indices)
        assert torch.allclose(g.topk_logprobs, logp.topk(4, -1).values, atol=1e-5)
    plain = eng.score(seqs[:1], starts=starts[:1])  # topk 0: the sampled tokens' only
    assert plain[0].topk_ids is None and torch.allclose(plain[0].logprobs, got[0].logprobs, atol=1e-5) == (
        temperature == 1.0)
    with pytest.raises(ValueError, match="score start 0 outside 1..3"):
        eng.score([[1, 2, 3]], starts=[0])


def test_n_samples_seed_and_stop(models: tuple[Path, Path]) -> None:
    eng = engine(models[0])
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=3)
    out = eng.generate(PROMPTS, params, seeds=[7, 8, 9])
    assert [g.prompt_index for g in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    again = eng.generate(PROMPTS, params, seeds=[7, 8, 9])
    assert [g.token_ids for g in out] == [g.token_ids for g in again]  # seeded
    assert all(g.finish_reason == "length" and len(g.token_ids) == 5 for g in out
               if not set(g.token_ids) & set(eng.eos_ids))
    # make the first greedy token a stop token: generation ends right there
    first = eng.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=4))[0].token_ids[0]
    stopped = eng.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=[first]))
    assert stopped[0].token_ids == [first] and stopped[0].finish_reason == "stop"


def test_a_prompts_samples_depend_only_on_its_seed(models: tuple[Path, Path]) -> None:
    """Per-sample seeds: the same samples whichever other prompts share the call (or the engine), in
    whatever order and batch chunking — what makes rollouts identical at every parallel layout."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=6, n=4)
    together = engine(models[0]).generate(PROMPTS, params, seeds=[11, 12, 13])
    alone = engine(models[0], max_batch_size=3).generate(PROMPTS[2:] + PROMPTS[:1], params, seeds=[13, 11])
    key = {0: 2, 1: 0}  # alone's prompt index -> together's
    mine = sorted((key[g.prompt_index], g.token_ids, g.logprobs) for g in alone)
    theirs = sorted((g.prompt_index, g.token_ids, g.logprobs) for g in together if g.prompt_index != 1)
    assert [m[:2] for m in mine] == [t[:2] for t in theirs]  # the same tokens
    # log-probs to fp32 round-off: a different batch (padding, shapes) reassociates the sums
    for m, t in zip(mine, theirs, strict=True):
        assert torch.allclose(torch.tensor(m[2]), torch.tensor(t[2]), atol=1e-5)
    assert len({tuple(g.token_ids) for g in together}) > 3  # the n samples of a prompt differ
    other = engine(models[0]).generate(PROMPTS, params, seeds=[21, 22, 23])
    assert [g.token_ids for g in other] != [g.token_ids for g in together]


def test_sampling_follows_the_distribution() -> None:
    """Inverse-CDF sampling at the per-sample uniforms draws each token with its probability."""
    from hybridrl.rollout.engines.hf import sample, sample_stream, uniform

    probs_V = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits_BV = probs_V.clamp_min(1e-30).log().expand(20_000, -1)
    streams_B = torch.tensor([sample_stream(s, 0) for s in range(20_000)])
    token_B, logp_B = sample(logits_BV, SamplingParams(temperature=1.0), uniform(streams_B, 0))
    freq_V = torch.bincount(token_B, minlength=5).double() / 20_000
    assert torch.allclose(freq_V, probs_V.double(), atol=0.012), freq_V  # ~3.5 σ at the largest p
    assert freq_V[4] == 0 and torch.allclose(logp_B, probs_V.log()[token_B])
    top2 = sample(logits_BV, SamplingParams(temperature=1.0, top_k=2), uniform(streams_B, 1))[0]
    assert set(top2.tolist()) == {0, 1} and abs(float((top2 == 0).double().mean()) - 2 / 3) < 0.012


def test_top_k_1_is_greedy(models: tuple[Path, Path]) -> None:
    eng = engine(models[0])
    greedy = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))
    topk = eng.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6), seeds=[0, 1, 2])
    assert [g.token_ids for g in greedy] == [g.token_ids for g in topk]


def test_update_weights_in_place_equals_fresh_load(models: tuple[Path, Path]) -> None:
    a, b = models
    eng = engine(a)
    ptrs = {n: p.data_ptr() for n, p in eng.params.items()}
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = eng.generate(PROMPTS, params)
    weights = load_file(b / "model.safetensors")
    names = sorted(weights)
    eng.update_weights(([(n, weights[n]) for n in names[i:i + 3]] for i in range(0, len(names), 3)), version=5)
    after = eng.generate(PROMPTS, params)
    fresh = engine(b).generate(PROMPTS, params)
    # a random tiny model's greedy path can repeat the prompt: compare the log-probs too
    assert [(g.token_ids, g.logprobs) for g in after] == [(g.token_ids, g.logprobs) for g in fresh]
    assert [g.logprobs for g in after] != [g.logprobs for g in before]
    assert {n: p.data_ptr() for n, p in eng.params.items()} == ptrs  # same storage: swapped in place
    assert all(g.weight_version == 5 for g in after)


def test_update_weights_rejects_unknown_names_and_shapes(models: tuple[Path, Path]) -> None:
    eng = engine(models[0])
    with pytest.raises(KeyError, match="model.layers.99"):
        eng.update_weights([[("model.layers.99.mlp.up_proj.weight", torch.zeros(1))]], version=1)
    with pytest.raises(ValueError, match="model.norm.weight"):
        eng.update_weights([[("model.norm.weight", torch.zeros(3))]], version=1)


def test_config_validated_by_the_plugin(models: tuple[Path, Path]) -> None:
    from hybridrl.registry import PluginConfigError

    with pytest.raises(PluginConfigError, match="dtype='fp8'; valid: float32, bfloat16, float16"):
        engine(models[0], dtype="fp8")


def test_prefilling_each_prompt_once_gives_the_same_samples(models: tuple[Path, Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefill_once_per_prompt`` (default): the prefill runs on one row per prompt and its KV cache is repeated for
    the prompt's n samples — every sample, log-prob and finish reason is the one of a prefill per sample."""
    once, per_sample = engine(models[0]), engine(models[0], prefill_once_per_prompt=False)
    prefill_rows: list[int] = []
    forward = type(once.model).forward

    def spy(model, *args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("cache", kwargs.get("past_key_values")) is None:  # the prefill
            prefill_rows.append(int(kwargs["input_ids"].shape[0]))
        return forward(model, *args, **kwargs)

    monkeypatch.setattr(type(once.model), "forward", spy)
    prompts = [[5 + i, 6, 7 + 2 * i][: 2 + i % 2] for i in range(6)]  # two prompt lengths: left padding
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=4, stop_token_ids=list(range(20, 35)))
    got = once.generate(prompts, params, seeds=list(range(6)))
    want = per_sample.generate(prompts, params, seeds=list(range(6)))
    assert prefill_rows == [6, 24]  # one row per prompt, then one per sample
    assert [(g.prompt_index, g.token_ids, g.finish_reason) for g in got] == [
        (g.prompt_index, g.token_ids, g.finish_reason) for g in want]
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_dropping_finished_rows_gives_the_same_samples(models: tuple[Path, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``drop_finished`` (default): rows that stopped leave the batch and its KV cache; every sample, log-prob
    and finish reason is the one decoded with the whole batch to the end."""
    from transformers import DynamicCache

    dropped: list[int] = []
    select = DynamicCache.batch_select_indices

    def spy(cache: DynamicCache, indices: torch.Tensor) -> None:
        if indices.unique().numel() == len(indices):  # a drop (the prompt-once prefill repeats rows instead)
            dropped.append(len(indices))
        select(cache, indices)

    monkeypatch.setattr(DynamicCache, "batch_select_indices", spy)
    prompts = [[5 + i, 6, 7 + 2 * i] for i in range(8)]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=4, stop_token_ids=list(range(20, 35)))
    seeds = list(range(100, 108))
    dropping = engine(models[0]).generate(prompts, params, seeds=seeds)
    assert dropped, "no row was dropped: the stop ids did not end enough rows early"
    whole = engine(models[0], drop_finished=False).generate(prompts, params, seeds=seeds)
    assert dropped == sorted(dropped, reverse=True) and min(dropped) < 32  # fewer and fewer rows
    lengths = {len(g.token_ids) for g in whole}
    assert len(lengths) > 3 and max(lengths) == 12  # a mix of early stops and a row to the limit
    assert [(g.prompt_index, g.token_ids, g.finish_reason) for g in dropping] == [
        (g.prompt_index, g.token_ids, g.finish_reason) for g in whole]
    for a, b in zip(dropping, whole, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
