"""What the report draws: figures of panels, each panel naming the metric keys it plots.

The keys are the ones the trainer logs (:mod:`hybridrl.trainers.rl`, :mod:`hybridrl.metrics`,
:mod:`hybridrl.trainers.eval_metrics`, :mod:`hybridrl.trainers.sft`). A panel whose keys no run logged is left out and
noted; groups that depend on what a run has (data sources, a critic, SFT) are built from the keys seen.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

PanelKind = Literal["line", "time_split", "time_bars"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # one line each (per run): the first solid, then dashed, dotted, …
    band: tuple[str, str] | None = None  # (low, high) keys shaded around the first line, where logged
    smooth: bool = True  # per-step curves: EMA-smoothed over the raw (faint) points; eval points are not
    kind: PanelKind = "line"  # time_split: stacked stage times of each run; time_bars: their mean per run


@dataclass(frozen=True, kw_only=True, slots=True)
class Figure:
    name: str  # file stem of its PNG
    title: str
    panels: tuple[Panel, ...]


TIMING = "timing/"  # per-stage wall seconds (hybridrl.metrics.Timer); timing/step holds them all
STEP_TIME = "timing/step"


def stage_keys(keys: set[str]) -> list[str]:
    """The stages of the step's time split (``timing/<stage>`` other than the whole step), in a fixed order."""
    return sorted(k for k in keys if k.startswith(TIMING) and k != STEP_TIME)


_EVAL_SOURCE = re.compile(r"^eval/(?P<source>.+)/(?P<metric>mean|pass)@(?P<k>\d+)$")


def _eval_source_panels(keys: set[str]) -> list[Panel]:
    """One panel per data source: mean@n, then pass@k by k (pass@1 only without mean@n: they are equal)."""
    by_source: dict[str, list[tuple[int, int, str]]] = {}
    for key in keys:
        if m := _EVAL_SOURCE.match(key):
            by_source.setdefault(m["source"], []).append((m["metric"] == "pass", int(m["k"]), key))
    panels = []
    for source, found in sorted(by_source.items()):
        has_mean = any(not is_pass for is_pass, _, _ in found)
        keys_ = tuple(k for is_pass, n, k in sorted(found) if not (has_mean and is_pass and n == 1))
        panels.append(Panel(title=f"eval: {source} ({', '.join(k.rsplit('/', 1)[-1] for k in keys_)})", keys=keys_,
                            smooth=False))
    return panels


def _prefix_panels(keys: set[str], prefix: str, *, skip: tuple[str, ...] = ()) -> list[Panel]:
    return [Panel(title=k, keys=(k,)) for k in sorted(keys) if k.startswith(prefix) and k not in skip]


def figures(keys: set[str]) -> list[Figure]:
    """The report's figures for runs that logged ``keys`` (panels whose keys are absent stay in: the renderer
    leaves them out and says so)."""
    rl = any(k.startswith(("reward/", "actor/")) for k in keys)
    out: list[Figure] = []
    if rl:
        out.append(Figure(name="overview", title="Overview", panels=(
            Panel(title="reward (train)", keys=("reward/mean",), band=("reward/min", "reward/max")),
            Panel(title="eval accuracy", keys=("eval/accuracy",), smooth=False),
            Panel(title="KL to ref", keys=("actor/kl_ref",)),
            Panel(title="entropy", keys=("actor/entropy",)),
            Panel(title="response length (mean)", keys=("response/length_mean",)),
            Panel(title="tokens/s", keys=("perf/tokens_per_s",)),
        )))
        out.append(Figure(name="reward", title="Reward", panels=(
            Panel(title="reward mean (band: min–max)", keys=("reward/mean",), band=("reward/min", "reward/max")),
            Panel(title="eval reward mean", keys=("eval/reward_mean",), smooth=False),
            Panel(title="KL penalty in the reward (value, coef)",
                  keys=("actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff")),
            Panel(title="samples that failed to score", keys=("reward/errors",), smooth=False),
            Panel(title="skipped steps (total)", keys=("training/skipped_steps",), smooth=False),
        )))
        out.append(Figure(name="eval", title="Evaluation", panels=(
            Panel(title="eval accuracy", keys=("eval/accuracy",), smooth=False),
            *_eval_source_panels(keys),
            Panel(title="eval response length", keys=("eval/response_length_mean",), smooth=False),
        )))
        out.append(Figure(name="policy", title="Policy update", panels=(
            Panel(title="KL to ref", keys=("actor/kl_ref",)),
            Panel(title="entropy", keys=("actor/entropy",)),
            Panel(title="clip fraction", keys=("actor/clipfrac",)),
            Panel(title="grad norm (mean, max)", keys=("actor/grad_norm", "actor/grad_norm_max")),
            Panel(title="PPO KL (mean, first mini-batch)", keys=("actor/ppo_kl", "actor/ppo_kl_first_mb")),
            Panel(title="policy loss", keys=("actor/pg_loss",)),
            Panel(title="learning rate", keys=("actor/lr",), smooth=False),
        )))
        out.append(Figure(name="rollout", title="Rollouts", panels=(
            Panel(title="response length (mean, max)", keys=("response/length_mean", "response/length_max")),
            Panel(title="truncated responses (hit max length)", keys=("response/clip_ratio",)),
            Panel(title="prompt length", keys=("prompt/length_mean",)),
            Panel(title="engine vs actor |Δ log-prob| (mean, max)",
                  keys=("rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max")),
            Panel(title="π_old / π_rollout (max, min)", keys=("rollout_corr/ratio_max", "rollout_corr/ratio_min")),
        )))
        critic = _prefix_panels(keys, "critic/", skip=("critic/advantages_mean",))
        if critic:
            out.append(Figure(name="critic", title="Critic", panels=tuple(critic)))
        out.append(Figure(name="time", title="Time", panels=(
            Panel(title="time split per step", keys=(STEP_TIME,), kind="time_split"),
            Panel(title="mean seconds per step, by stage", keys=(STEP_TIME,), kind="time_bars"),
            Panel(title="step time (s)", keys=(STEP_TIME,)),
            Panel(title="tokens/s", keys=("perf/tokens_per_s",)),
            Panel(title="weight sync (MB)", keys=("perf/weight_sync_mb",), smooth=False),
        )))
    if any(k.startswith("sft/") for k in keys):
        out.append(Figure(name="sft", title="SFT", panels=(
            Panel(title="loss (train, val)", keys=("sft/loss", "val/loss")),
            Panel(title="grad norm", keys=("sft/grad_norm",)),
            Panel(title="learning rate", keys=("sft/lr",), smooth=False),
        )))
    return out
