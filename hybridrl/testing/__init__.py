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

from collections.abc import Callable
from typing import Any

from hybridrl.testing.agents import check_environment, check_tool
from hybridrl.testing.algorithms import check_advantage_estimator, check_policy_loss
from hybridrl.testing.batches import GROUND_TRUTHS, PROMPTS, make_batch, tiny_tokenizer
from hybridrl.testing.engines import check_rollout_engine
from hybridrl.testing.kit import CONFIG_KEYS, EXTRA_CTX_KEY, ContractViolation, check_plugin_class
from hybridrl.testing.rewards import check_reward_manager

__all__ = [
    "CHECKS",
    "CONFIG_KEYS",
    "EXTRA_CTX_KEY",
    "GROUND_TRUTHS",
    "PROMPTS",
    "ContractViolation",
    "check_advantage_estimator",
    "check_environment",
    "check_plugin_class",
    "check_policy_loss",
    "check_reward_manager",
    "check_rollout_engine",
    "check_tool",
    "make_batch",
    "tiny_tokenizer",
]

CHECKS: dict[str, Callable[..., Any]] = {
    "rollout_engines": check_rollout_engine,
    "reward_managers": check_reward_manager,
    "advantage_estimators": check_advantage_estimator,
    "policy_losses": check_policy_loss,
    "tools": check_tool,
    "environments": check_environment,
}
