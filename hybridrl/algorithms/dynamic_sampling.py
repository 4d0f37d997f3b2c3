"""DAPO's dynamic sampling rule (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale", §3.2): which groups carry a policy-gradient signal, and its settings.

A GRPO group whose samples all score the same (all right or all wrong) has advantage 0: it adds no policy
gradient and only dilutes the batch. DAPO over-samples and trains on the groups that carry a signal::

    repeat  (round r = 0, 1, …)
        generate data.gen_batch_size prompts × rollout.n samples and score them
        keep each group whose algorithm.filter_groups.metric is not the same for all of its samples
    until data.train_batch_size groups are kept

``metric`` (FILTER_METRICS): ``acc`` — the reward's ``correct_B`` (a reward without one: score > 0, as
evaluation counts it); ``score`` — the reward's score; ``seq_reward`` — the score plus the overlong penalty, i.e.
what the advantages see. verl's ``seq_final_reward`` (after the in-reward KL) is not offered: the KL needs
log-probs, which are computed for the kept batch only. The rounds, the cap and the distribution over ranks are
the rollout's (:mod:`hybridrl.rollout.dynamic_sampling`, with the deviations from verl).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FILTER_METRICS: tuple[str, ...] = ("acc", "score", "seq_reward")


@dataclass(kw_only=True, slots=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): groups whose samples all have the same
    metric are dropped and further rounds of data.gen_batch_size prompts are generated until
    data.train_batch_size groups are kept (the rollout: ``hybridrl/rollout/dynamic_sampling.py``)."""

    enable: bool = False
    metric: str = "acc"  # a FILTER_METRICS entry (the module docstring)
    # generation rounds per step at most (0: no limit); at the limit the step is filled up with dropped groups
    max_num_gen_batches: int = 0


def group_signal(values_B: torch.Tensor, n: int) -> torch.Tensor:
    """``[G]`` bool: the group of ``n`` consecutive samples has values that are not all equal (NaN ≠ NaN)."""
    values_GN = values_B.reshape(-1, n)
    return ~(values_GN == values_GN[:, :1]).all(-1)


def config_problems(f: FilterGroupsConfig, *, train_batch_size: int, gen_batch_size: int | None,
                    n: int) -> list[tuple[str, object, str]]:
    """``(key, value, message)`` for every problem of ``algorithm.filter_groups`` and ``data.gen_batch_size``,
    given ``data.train_batch_size``, ``data.gen_batch_size`` and ``actor_rollout_ref.rollout.n``."""
    key, out = "algorithm.filter_groups", list[tuple[str, object, str]]()
    if f.metric not in FILTER_METRICS:
        out.append((f"{key}.metric", f.metric, f"valid: {', '.join(FILTER_METRICS)}"))
    if f.max_num_gen_batches < 0:
        out.append((f"{key}.max_num_gen_batches", f.max_num_gen_batches, "must be ≥ 0 (0: no limit)"))
    if gen_batch_size is not None and gen_batch_size < 1:
        out.append(("data.gen_batch_size", gen_batch_size, "must be ≥ 1 (or null: data.train_batch_size)"))
    if not f.enable:
        if gen_batch_size is not None and gen_batch_size != train_batch_size:
            out.append(("data.gen_batch_size", gen_batch_size, f"is used by dynamic sampling only: set "
                        f"{key}.enable=true, or null (each step generates data.train_batch_size={train_batch_size})"))
        return out
    if n < 2:
        out.append(("actor_rollout_ref.rollout.n", n, f"{key}.enable=true drops groups whose samples all score the "
                    f"same: a group of one always does; needs rollout.n ≥ 2 (or {key}.enable=false)"))
    per_round = train_batch_size if gen_batch_size is None else gen_batch_size
    if f.max_num_gen_batches > 0 and per_round >= 1 and per_round * f.max_num_gen_batches < train_batch_size:
        out.append((f"{key}.max_num_gen_batches", f.max_num_gen_batches,
                    f"{f.max_num_gen_batches} rounds of data.gen_batch_size={per_round} prompts cannot fill a step of "
                    f"data.train_batch_size={train_batch_size}; at least "
                    f"{-(-train_batch_size // per_round)} (or 0: no limit)"))
    return out
