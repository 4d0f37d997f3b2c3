"""A plugin's kwargs that stay with their plugin when another is picked by its one key.

Each plugin block — ``actor_rollout_ref.rollout.engine_kwargs``, ``reward.kwargs``, ``algorithm.adv_estimator_kwargs``,
``algorithm.policy_loss_kwargs``, ``actor_rollout_ref.rollout.multi_turn.environment_kwargs`` — takes two spellings:

- flat keys, ``reward.kwargs.format_reward=0.1`` (verl's ``+reward.kwargs.x=``): the chosen plugin's, whichever it is;
- a block per plugin, ``reward.kwargs.math.format_reward: 0.1``: that plugin's only, used when it is the chosen one
  and dropped otherwise. Recipes write this one, so that ``reward.name=arithmetic`` on a recipe made for ``math``
  does not hand ``math``'s keys to ``arithmetic``. A flat key wins over the block's: it is the command line's
  (``+reward.kwargs.format_reward=0.2``, verl's ``actor.clip_ratio_low`` on a recipe's ``ppo_clip`` block).

A key is a block when it names an installed plugin of the group and is not a key of the chosen plugin's own
``Config``. The tools' kwargs are per tool already (``multi_turn.tool_kwargs.<tool>``): those of an installed tool
that is not in ``multi_turn.tools`` are dropped the same way. With ``multi_turn.enable=false`` the multi-turn blocks
are left as written (validation refuses any multi-turn setting then). :func:`resolve_plugin_kwargs` leaves each block as
the chosen plugin's flat keys, before anything reads them (``validate`` calls it first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridrl.config.schema import RLConfig
from hybridrl.registry import PluginError, Registry


def resolve_plugin_kwargs(cfg: RLConfig) -> None:
    """Rewrite ``cfg``'s plugin blocks as their chosen plugin's flat kwargs (idempotent)."""
    r, alg, m = cfg.actor_rollout_ref.rollout, cfg.algorithm, cfg.actor_rollout_ref.rollout.multi_turn
    for group, name, holder, field in (
            ("rollout_engines", r.name, r, "engine_kwargs"),
            ("reward_managers", cfg.reward.name, cfg.reward, "kwargs"),
            ("advantage_estimators", alg.adv_estimator, alg, "adv_estimator_kwargs"),
            ("policy_losses", alg.policy_loss, alg, "policy_loss_kwargs"),
            ("environments", m.environment, m, "environment_kwargs")):
        if group == "environments" and not m.enable:  # left as written: validation refuses them with enable=false
            continue
        setattr(holder, field, chosen_kwargs(getattr(holder, field), name, group=group))
    tools = set(Registry("tools").names()) if m.enable else set()
    m.tool_kwargs = {name: v for name, v in m.tool_kwargs.items() if name in m.tools or name not in tools}


def chosen_kwargs(kwargs: Mapping[str, Any], name: str | None, *, group: str) -> dict[str, Any]:
    """The kwargs of plugin ``name``: ``kwargs[name]``'s block with the flat keys of ``kwargs`` over it; the other
    installed plugins' blocks dropped."""
    own_keys = _config_keys(group, name)
    blocks = {k: v for k, v in kwargs.items()
              if k not in own_keys and isinstance(v, Mapping) and k in Registry(group).names()}
    flat = {k: v for k, v in kwargs.items() if k not in blocks}
    return {**dict(blocks.get(name or "", {})), **flat}


def _config_keys(group: str, name: str | None) -> set[str]:
    """The keys of plugin ``name``'s Config (none when it is not installed: validation says so)."""
    if name is None:
        return set()
    try:
        return {f.name for f in dataclasses.fields(Registry(group).load(name).Config)}  # type: ignore[attr-defined]
    except PluginError:
        return set()
