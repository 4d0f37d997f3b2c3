"""Validation metrics as papers report them: mean@n and the unbiased pass@k, per data source.

With ``rollout.val_kwargs.n = n`` samples of each prompt, ``c`` of them correct:

    mean@n = c / n   (averaged over prompts: the accuracy of one sample)
    pass@k = 1 - C(n - c, k) / C(n, k)   for k ≤ n

the unbiased estimator of "at least one of k samples is correct" (Chen et al. 2021, *Evaluating Large
Language Models Trained on Code*, eq. 1), computed as ``1 - ∏_{i=n-c+1}^{n} (1 - k/i)`` (no large
binomials). It is reported for k = 1, 2, 4, … < n and k = n when n > 1; pass@1 equals mean@n. Each is averaged
over prompts, per ``data_source`` (several validation files at once) as ``eval/<source>/pass@k``; the
samples of one prompt are always on one DP rank (the rollout keeps a prompt's samples together).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.metrics import DPMeans


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that k of n samples (c correct), drawn without replacement, include a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 ≤ c ≤ n and 1 ≤ k ≤ n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def reported_ks(n: int) -> list[int]:
    """1, 2, 4, … below n, then n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def add_sampled_accuracy(m: DPMeans, batch: RolloutBatch, correct_B: torch.Tensor, *, n: int) -> None:
    """Add ``eval/<source>/mean@n`` and ``eval/<source>/pass@k`` of ``batch`` (n samples per prompt) to ``m``."""
    per_prompt: dict[int, list[bool]] = defaultdict(list)
    source_of: dict[int, str] = {}
    for g, ok, meta in zip(batch.group_index.tolist(), correct_B.tolist(), batch.meta, strict=True):
        per_prompt[g].append(bool(ok))
        source_of[g] = meta.data_source or "all"
    for g, outcomes in per_prompt.items():
        if len(outcomes) != n:
            raise ValueError(f"validation prompt {g} has {len(outcomes)} samples, expected val_kwargs.n={n}")
        c, source = sum(outcomes), source_of[g]
        m.add(f"eval/{source}/mean@{n}", c / n, 1)
        for k in reported_ks(n) if n > 1 else []:
            m.add(f"eval/{source}/pass@{k}", pass_at_k(n, c, k), 1)
