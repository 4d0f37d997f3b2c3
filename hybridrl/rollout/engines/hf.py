"""Rollout engine ``hf``: batched sampling with transformers on the engine's own copy of the weights.

One engine per rank (no tensor parallelism); the simplest engine and the reference the SGLang engine
is checked against. Log-probs are those of the sampled token under softmax(logits / temperature),
i.e. before top-k/top-p truncation — the distribution the actor recomputes (as in verl/SGLang);
with top_k=-1 and top_p=1 that *is* the sampling distribution. Greedy (temperature 0) reports
log-probs under the untempered softmax.

``update_weights`` copies each streamed tensor into the existing parameter storage (``copy_``), so
the engine never reallocates or reloads: the weight swap is in place.

``abort()`` (from another thread) stops the running ``generate`` before its next decoding step: each unfinished
sample comes back with its tokens so far and ``finish_reason="abort"`` until ``resume()``
(``async_training.partial_rollout``, :mod:`hybridrl.rollout.partial`).

Sampling is seeded per sample: each row draws its uniforms from a counter-based generator keyed by
``(seeds[i], j)`` and the decoding step (SplitMix64, Steele et al. 2014), and picks its token by
inverting the CDF of its filtered distribution. A sample therefore does not depend on the other rows
of the batch, so the same seeds give the same samples however prompts are grouped into calls or engines.

A vision-language checkpoint (Qwen2.5-VL, Qwen3-VL) generates with each prompt's images (``generate(images=)``): their
features enter the prefill (Qwen3-VL's DeepStack features too) and every position has multimodal RoPE ids
(:mod:`hybridrl.rollout.engines.hf_images`). ``score`` stays text-only (a teacher's sequences carry no images).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import GenerationConfig

from hybridrl.hf.arch import eos_token_ids
from hybridrl.interfaces import Generation, SamplingParams, TokenScores, WeightBucket, check_limits
from hybridrl.rollout.engines.hf_compat import RoutingRecorder, checkpoint_views, vlm_checkpoint_names
from hybridrl.rollout.engines.hf_images import Images, check_images, load_model, prefill_images, row_positions

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFRolloutEngine:
    supports_tensor_parallel: ClassVar[bool] = False
    supports_abort: ClassVar[bool] = True
    supports_routed_experts: ClassVar[bool] = True  # SamplingParams.return_routed_experts (an MoE model's routing)
    supports_images: ClassVar[bool] = True  # generate(images=): a vision-language checkpoint's (hf_images)

    @dataclass(kw_only=True, slots=True)
    class Config:
        dtype: str = "float32"  # float32 | bfloat16 | float16
        max_batch_size: int = 256  # sequences decoded together; larger prompt lists are chunked
        # stop decoding rows that have finished: once a quarter of the rows being decoded are done, they are
        # dropped from the batch and its KV cache (same samples; a long tail no longer costs the whole batch)
        drop_finished: bool = True
        # encode each prompt once for its n samples: the prefill runs on one row per distinct prompt and its KV
        # cache is repeated for the samples (a row's math never depends on the others: the same samples)
        prefill_once_per_prompt: bool = True
        offload_weights_on_release: bool = False  # on GPU: move weights to CPU during the train phase

        def __post_init__(self) -> None:
            if self.dtype not in _DTYPES:
                raise ValueError(f"dtype={self.dtype!r}; valid: {', '.join(_DTYPES)}")
            if self.max_batch_size < 1:
                raise ValueError(f"max_batch_size={self.max_batch_size} must be ≥ 1")

    def __init__(self, config: Config, *, model_path: str, device: str | torch.device = "cpu", **ctx: Any) -> None:
        self.config = config
        self.device = torch.device(device)
        self.model_path = model_path
        self.model, self.vision = load_model(model_path, _DTYPES[config.dtype])  # vision: None for a causal LM
        self.model.to(self.device).eval()
        gen = GenerationConfig.from_model_config(self.model.config)
        # generation_config.json's stop ids (a list: e.g. <|im_end|> and <|endoftext|>), as SGLang reads them;
        # config.json's single eos_token_id let a tiny model run on past <|endoftext|>
        self.eos_ids: list[int] = eos_token_ids(model_path)
        pad = gen.pad_token_id if gen.pad_token_id is not None else self.model.config.get_text_config().pad_token_id
        self.pad_id: int = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))
        self.params = _weights(self.model)
        self.version = 0
        self._abort = threading.Event()
        # transformers ≥ 5.2x names the KV cache `cache` (argument and output); earlier, `past_key_values`
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.routers = RoutingRecorder(self.model)

    @torch.no_grad()
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *,
                 seeds: Sequence[int] | None = None,
                 max_new_tokens: Sequence[int] | None = None, images: Images | None = None) -> list[Generation]:
        if seeds is None:
            seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        limits = check_limits(max_new_tokens, prompts, params)
        check_images(images, len(prompts), self.vision, self.model_path)
        expanded = [(i, p, sample_stream(seeds[i], j), limits[i]) for i, p in enumerate(prompts)
                    for j in range(params.n)]
        out: list[Generation] = []
        try:
            for start in range(0, len(expanded), self.config.max_batch_size):
                chunk = expanded[start:start + self.config.max_batch_size]
                out += self._generate_chunk(chunk, params, images)
        finally:
            self.routers.stop()  # no router hook outlives a call
        return out

    def _generate_chunk(self, chunk: list[tuple[int, list[int], int, int]], params: SamplingParams,
                        images: Images | None) -> list[Generation]:
        B, P = len(chunk), max(len(p) for _, p, _, _ in chunk)
        ids_BP = torch.full((B, P), self.pad_id, dtype=torch.long)
        mask_BP = torch.zeros((B, P), dtype=torch.long)
        stream_B = torch.tensor([s for _, _, s, _ in chunk], dtype=torch.long, device=self.device)
        limit_B = torch.tensor([c for _, _, _, c in chunk], dtype=torch.long, device=self.device)
        for b, (_, p, _, _) in enumerate(chunk):  # left padding
            ids_BP[b, P - len(p):] = torch.tensor(p)
            mask_BP[b, P - len(p):] = 1
        ids_BP, mask_BP = ids_BP.to(self.device), mask_BP.to(self.device)
        stop = torch.tensor(sorted(set(self.eos_ids) | set(params.stop_token_ids)), device=self.device)
        T = int(limit_B.max())
        tok_BT = torch.full((B, T), self.pad_id, dtype=torch.long, device=self.device)
        lp_BT = torch.zeros((B, T), device=self.device)
        finished_by_stop_B = torch.zeros(B, dtype=torch.bool, device=self.device)
        rows_A = torch.arange(B, device=self.device)  # the rows still decoded (A of them): their index in B
        done_A = limit_B <= 0  # rows with no room: nothing to sample
        past = None
        step_ids, attn = ids_BP, mask_BP  # step_ids: the tokens each decoding step feeds (t ≥ 1)
        if self.vision is None:
            pos_AP = (mask_BP.cumsum(-1) - 1).clamp(min=0)
            next_A = mask_BP.sum(-1)  # the position of each row's first generated token
        else:  # multimodal RoPE: [3, B, P], rows on dim -2 (hf_images)
            pos_AP, next_A = (x.to(self.device) for x in row_positions([c[:2] for c in chunk], images, self.vision, P))
        n_B = torch.zeros(B, dtype=torch.long, device=self.device)  # tokens sampled per row
        # the experts of every position run (prompt ‖ response), MoE layers in order: R3 router replay
        route_BSLK = self.routers.start(B, P + T) if params.return_routed_experts else None
        steps = 0
        # rows of one prompt follow one another (generate's expansion): the prefill runs on the first of each
        owner_B = torch.tensor([0] + [int(chunk[b][0] != chunk[b - 1][0]) for b in range(1, B)],
                               device=self.device).cumsum(0)
        once = self.config.prefill_once_per_prompt and route_BSLK is None and int(owner_B[-1]) + 1 < B
        for t in range(T):
            if self._abort.is_set():  # interrupted: every row keeps what it has
                break
            if t == 0:  # the prefill: on the first row of each prompt (once), else on every row
                first_U = torch.cat([torch.zeros(1, dtype=torch.long, device=self.device),
                                     (owner_B[1:] != owner_B[:-1]).nonzero().squeeze(-1) + 1]) if once else rows_A
                seen = {} if self.vision is None else prefill_images(
                    self.model, [chunk[u][0] for u in first_U.tolist()], images)
                out = self.model(input_ids=ids_BP[first_U], attention_mask=attn[first_U],
                                 position_ids=pos_AP[..., first_U, :], use_cache=True, logits_to_keep=1,
                                 **seen, **{self._cache_kw: past})
                if once:
                    getattr(out, self._cache_kw).batch_select_indices(owner_B)  # each sample's copy of its prompt's
                    out.logits = out.logits[owner_B]
            else:
                out = self.model(input_ids=step_ids, attention_mask=attn, position_ids=pos_AP, use_cache=True,
                                 logits_to_keep=1, **{self._cache_kw: past})
            if route_BSLK is not None:  # this forward ran the prompt (t = 0) or the last sampled token
                self.routers.collect(route_BSLK, rows_A, torch.arange(P) if t == 0 else torch.tensor([P + t - 1]))
            past = getattr(out, self._cache_kw)
            token_A, logprob_A = sample(out.logits[:, -1, :].float(), params, uniform(stream_B[rows_A], t))
            live_A = ~done_A
            tok_BT[rows_A[live_A], t] = token_A[live_A]
            lp_BT[rows_A[live_A], t] = logprob_A[live_A].float()
            n_B[rows_A[live_A]] = t + 1
            hit_A = torch.isin(token_A, stop) & live_A
            finished_by_stop_B[rows_A[hit_A]] = True
            done_A |= hit_A | (limit_B[rows_A] <= t + 1)  # a row's own cap (RolloutEngine.generate's max_new_tokens)
            steps = t + 1
            if bool(done_A.all()):
                break
            step_ids = token_A[:, None]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)  # rows already done are discarded
            if t == 0:  # a VLM's generated tokens: the same id on all three axes
                pos_AP = next_A[:, None] if self.vision is None else next_A[None, :, None].expand(3, -1, 1)
            else:
                pos_AP = pos_AP + 1
            if self.config.drop_finished and 4 * int(done_A.sum()) >= len(done_A) and hasattr(
                    past, "batch_select_indices"):  # a row's math never depends on the others: drop the done
                keep_A = (~done_A).nonzero().squeeze(-1)
                past.batch_select_indices(keep_A)
                rows_A, done_A, step_ids, attn, pos_AP = (
                    rows_A[keep_A], done_A[keep_A], step_ids[keep_A], attn[keep_A], pos_AP[..., keep_A, :])
        tok_BT = tok_BT[:, :steps].cpu()
        lp_BT = lp_BT[:, :steps].cpu()
        results, stops, n_B = [], set(stop.tolist()), n_B.tolist()
        for b, (prompt_index, _, _, cap) in enumerate(chunk):
            row = tok_BT[b, :n_B[b]].tolist()
            length = next((t + 1 for t, tok in enumerate(row) if tok in stops), len(row))
            finish = "stop" if bool(finished_by_stop_B[b]) else "length" if n_B[b] >= cap else "abort"
            routed = None
            if route_BSLK is not None:  # the prompt's positions, then every kept token's but the last
                p = int(mask_BP[b].sum())
                routed = route_BSLK[b, P - p:P + max(length - 1, 0)].clone()
            results.append(Generation(prompt_index=prompt_index, token_ids=row[:length],
                                      logprobs=lp_BT[b, :length].tolist(), finish_reason=finish,
                                      weight_version=self.version, routed_experts=routed))
        return results

    @torch.no_grad()
    def score(self, sequences: Sequence[list[int]], *, starts: Sequence[int], topk: int = 0,
              temperature: float = 1.0) -> list[TokenScores]:
        """Teacher-forced scores of ``sequences[i][starts[i]:]`` (:class:`~hybridrl.interfaces.TokenScores`): one
        forward pass per chunk of ``max_batch_size`` right-padded sequences; log-probs under
        softmax(logits / temperature) in float32, over the model's whole vocabulary."""
        out: list[TokenScores] = []
        for first in range(0, len(sequences), self.config.max_batch_size):
            chunk = range(first, min(first + self.config.max_batch_size, len(sequences)))
            out += self._score_chunk([sequences[i] for i in chunk], [starts[i] for i in chunk], topk, temperature)
        return out

    def _score_chunk(self, seqs: list[list[int]], starts: list[int], topk: int,
                     temperature: float) -> list[TokenScores]:
        for seq, start in zip(seqs, starts, strict=True):
            if not 1 <= start <= len(seq):
                raise ValueError(f"hf engine: score start {start} outside 1..{len(seq)} (a token is scored given "
                                 "the ones before it, so the first cannot be)")
        B, S = len(seqs), max(len(s) for s in seqs)
        ids_BS = torch.full((B, S), self.pad_id, dtype=torch.long)
        mask_BS = torch.zeros((B, S), dtype=torch.long)
        for b, seq in enumerate(seqs):
            ids_BS[b, :len(seq)] = torch.tensor(seq)
            mask_BS[b, :len(seq)] = 1
        logits_BSV = self.model(input_ids=ids_BS.to(self.device), attention_mask=mask_BS.to(self.device)).logits
        out = []
        for b, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
            logp_NV = torch.log_softmax(logits_BSV[b, start - 1:len(seq) - 1].float() / temperature, dim=-1)
            tokens_N = ids_BS[b, start:len(seq)].to(self.device)
            scores = TokenScores(logprobs=logp_NV.gather(-1, tokens_N[:, None]).squeeze(-1).cpu())
            if topk > 0:
                values_NK, ids_NK = torch.topk(logp_NV, min(topk, logp_NV.shape[-1]), dim=-1)
                scores.topk_ids, scores.topk_logprobs = ids_NK.cpu(), values_NK.cpu()
            out.append(scores)
        return out

    def abort(self) -> None:
        """Make the running ``generate`` (and any until :meth:`resume`) return its samples as they stand."""
        self._abort.set()

    def resume(self) -> None:
        self._abort.clear()

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        for bucket in buckets:
            for name, tensor in bucket:
                param = self.params.get(name)
                if param is None:
                    raise KeyError(f"hf engine: weight {name!r} is not a parameter of the rollout model; "
                                   f"known names look like {next(iter(self.params))!r}")
                if param.shape != tensor.shape:
                    raise ValueError(f"hf engine: weight {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the rollout model expects {tuple(param.shape)}")
                param.data.copy_(tensor)  # into the existing storage: in place, no reallocation
        self.version = version

    def release_memory(self) -> None:
        if self.config.offload_weights_on_release and self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        if self.config.offload_weights_on_release and self.device.type == "cuda":
            self.model.to(self.device)
            self.params = _weights(self.model)

    def shutdown(self) -> None:
        del self.model
        self.params.clear()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by name, the checkpoint tensors it keeps as buffers (a sigmoid router's
    ``e_score_correction_bias``: GLM-4.5, DeepSeek-V3), and its fused MoE experts by the checkpoint's per-expert names
    too (:mod:`hybridrl.rollout.engines.hf_compat` item 1), a vision-language model's parameters by the checkpoint's
    names (item 3): what ``update_weights`` copies into."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    biases = {n: b for n, b in model.named_buffers() if n.endswith(".e_score_correction_bias")}
    return {**params, **biases, **checkpoint_views(params, model.config.model_type),
            **vlm_checkpoint_names(params, model.config.model_type)}


_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores (two's complement)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def sample_stream(seed: int, j: int) -> int:
    """The stream of sample ``j`` of a prompt seeded with ``seed`` (a 63-bit key)."""
    x = (seed * _GAMMA + (j + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 32)) * 0xBF58476D1CE4E5B9) & _MASK64
    return (x ^ (x >> 29)) >> 1


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def uniform(stream_B: torch.Tensor, t: int) -> torch.Tensor:
    """One uniform in [0, 1) per row for decoding step ``t``: SplitMix64 of ``stream + (t+1)·γ`` (int64
    arithmetic wraps, as the generator needs), top 53 bits as a float64."""
    z = stream_B + _signed((t + 1) * _GAMMA & _MASK64)
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() / float(1 << 53)


def sample(logits_BV: torch.Tensor, params: SamplingParams, u_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverting its CDF at ``u_B`` (uniforms in [0, 1)); return it and its
    log-prob under softmax(logits / temperature)."""
    if params.temperature == 0:
        logp_BV = torch.log_softmax(logits_BV, dim=-1)
        token_B = logits_BV.argmax(dim=-1)
        return token_B, logp_BV.gather(-1, token_B[:, None]).squeeze(-1)
    logp_BV = torch.log_softmax(logits_BV / params.temperature, dim=-1)
    filtered_BV = logp_BV
    if params.top_k > 0:
        kth = torch.topk(filtered_BV, min(params.top_k, filtered_BV.shape[-1]), dim=-1).values[:, -1:]
        filtered_BV = filtered_BV.masked_fill(filtered_BV < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_BV, idx_BV = torch.sort(filtered_BV, dim=-1, descending=True)
        cum_BV = sorted_BV.exp().cumsum(dim=-1)
        drop_BV = cum_BV - sorted_BV.exp() > params.top_p  # keep the smallest prefix with mass ≥ top_p
        filtered_BV = filtered_BV.scatter(-1, idx_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    cdf_BV = torch.softmax(filtered_BV.double(), dim=-1).cumsum(-1)
    token_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True).squeeze(-1)
    token_B = token_B.clamp(max=logits_BV.shape[-1] - 1)
    return token_B, logp_BV.gather(-1, token_B[:, None]).squeeze(-1)
