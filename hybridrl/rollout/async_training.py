"""The ``async_training`` block (verl's name) and the placement keys it needs, checked before anything is built.

- ``async_training.enable``: false — each step waits for its own rollouts (today's loop);
- ``async_training.staleness_threshold`` S: a sample trained at weight version v was started at a version ≥ v − S
  (integer versions; verl's fully-async trainer takes a float *fraction of extra samples* under this name — a
  stated deviation, see ``docs/verl.md``); S = 1 without partial rollouts is one-step-off-policy;
- ``async_training.partial_rollout``: in-flight generations are interrupted at a weight update and continued on the
  new weights; ``mask_stale_prefix`` then keeps the tokens sampled by older versions out of the loss (slime's
  ``--mask-offpolicy-in-partial-rollout``);
- ``actor_rollout_ref.rollout.placement`` colocated | disaggregated and ``rollout.num_ranks`` (disaggregated: the
  ranks that run engines; the others train).

The refusals are the combinations the peers' users found silently wrong (``../shared/reference/agentic-async.md``):
off-policy samples (S > 0) need ``algorithm.rollout_correction`` (radixark/miles PR #1829: the PPO denominator
recomputed on the current actor with no behaviour correction) and a clipped policy loss (tinker-cookbook PR #822:
the unclipped IS loss collapsed at staleness 3).
"""

from __future__ import annotations

from dataclasses import dataclass

KEY = "async_training"
PLACEMENTS: tuple[str, ...] = ("colocated", "disaggregated")  # actor_rollout_ref.rollout.placement


@dataclass(kw_only=True, slots=True)
class AsyncTrainingConfig:
    enable: bool = False  # false: each step waits for its own rollouts
    staleness_threshold: int = 0  # S, in weight versions (verl's fully-async float fraction is not this)
    partial_rollout: bool = False  # interrupt in-flight generations at a weight update; continue on the new weights
    mask_stale_prefix: bool = False  # with partial_rollout: tokens sampled by an older version get loss mask 0


Problem = tuple[str, object, str]


def config_problems(cfg: AsyncTrainingConfig, *, placement: str, num_ranks: int | None, world_size: int,
                    rollout_tp: int, correction_on: bool, policy_loss: str, loss_is_clipped: bool) -> list[Problem]:
    """``(key, value, message)`` for each invalid or silently wrong setting of the block and the placement keys."""
    rk = "actor_rollout_ref.rollout"
    problems: list[Problem] = []
    if placement not in PLACEMENTS:
        problems.append((f"{rk}.placement", placement, f"valid: {', '.join(PLACEMENTS)}"))
    if placement == "disaggregated":
        if num_ranks is None or num_ranks < 1:
            problems.append((f"{rk}.num_ranks", num_ranks, "placement=disaggregated needs the number of ranks that "
                                                           "run engines (≥ 1; the other ranks train)"))
        elif num_ranks >= world_size:
            problems.append((f"{rk}.num_ranks", num_ranks, f"must be < the world size {world_size}: at least one "
                                                           "rank must train"))
        elif num_ranks % rollout_tp:
            problems.append((f"{rk}.num_ranks", num_ranks, f"must be a multiple of {rk}.tensor_model_parallel_size="
                                                           f"{rollout_tp} (one engine per {rollout_tp} ranks)"))
    elif num_ranks is not None:
        problems.append((f"{rk}.num_ranks", num_ranks, "only with placement=disaggregated (colocated engines run "
                                                       "on every rank); set it to null"))
    if cfg.staleness_threshold < 0:
        problems.append((f"{KEY}.staleness_threshold", cfg.staleness_threshold, "must be ≥ 0 (weight versions)"))
    if not cfg.enable:
        for name in ("partial_rollout", "mask_stale_prefix"):
            if getattr(cfg, name):
                problems.append((f"{KEY}.{name}", True, f"takes effect with {KEY}.enable=true"))
        if cfg.staleness_threshold > 0:
            problems.append((f"{KEY}.staleness_threshold", cfg.staleness_threshold,
                             f"takes effect with {KEY}.enable=true"))
        return problems
    if cfg.mask_stale_prefix and not cfg.partial_rollout:
        problems.append((f"{KEY}.mask_stale_prefix", True, f"masks what {KEY}.partial_rollout=true produces; "
                                                           "turn that on, or this off"))
    if placement != "disaggregated":
        problems.append((f"{KEY}.enable", True, f"asynchronous rollouts run on their own ranks: set "
                                                f"{rk}.placement=disaggregated and {rk}.num_ranks"))
    off_policy = cfg.staleness_threshold > 0 or cfg.partial_rollout
    if off_policy and not correction_on:
        problems.append((f"{KEY}.staleness_threshold", cfg.staleness_threshold,
                         "off-policy samples need the behaviour-policy correction: set "
                         "algorithm.rollout_correction.rollout_is (token or sequence) and/or rollout_rs"))
    if off_policy and not loss_is_clipped:
        problems.append(("algorithm.policy_loss", policy_loss,
                         f"is not a clipped (trust-region) loss, which off-policy samples ({KEY}.staleness_threshold"
                         f"={cfg.staleness_threshold}) need: use ppo_clip, dual_clip, gspo or cispo"))
    return problems
