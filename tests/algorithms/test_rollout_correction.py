"""Rollout correction (TIS / MIS): hand-computed weights and masks, the gradient it gives, validation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hybridrl.algorithms.actor_objective import ActorObjective
from hybridrl.algorithms.loss_agg import aggregate, local_normalizer
from hybridrl.algorithms.policy_losses import DualClipLoss, PPOClipLoss
from hybridrl.algorithms.rollout_correction import RolloutCorrection, config_problems, ratio_extremes
from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.config.schema import RolloutCorrectionConfig

LN = math.log


def correction(**kw: object) -> RolloutCorrection:
    rc = RolloutCorrection.from_config(RolloutCorrectionConfig(**kw))  # type: ignore[arg-type]
    assert rc is not None
    return rc


# Three tokens with ratios π_old/π_rollout = 4, 1, 0.25, then one padded position holding garbage.
OLD = torch.tensor([[LN(0.8), LN(0.9), LN(0.1), -7.0]], dtype=torch.float64)
ROLLOUT = torch.tensor([[LN(0.2), LN(0.9), LN(0.4), 3.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)


def test_token_tis_truncates_each_token_ratio() -> None:
    w, keep, m = correction(rollout_is="token", rollout_is_threshold=2.0)(OLD, ROLLOUT, MASK)
    torch.testing.assert_close(w[0, :3], torch.tensor([2.0, 1.0, 0.25], dtype=torch.float64))
    assert torch.equal(keep, MASK)  # no rejection configured
    torch.testing.assert_close(m["rollout_corr/ratio_mean"], torch.tensor((4 + 1 + 0.25) / 3, dtype=torch.float64))
    torch.testing.assert_close(m["rollout_corr/truncated_frac"], torch.tensor(1 / 3, dtype=torch.float64))
    assert m["rollout_corr/masked_frac"] == 0
    log_r = torch.tensor([LN(4), 0.0, LN(0.25)], dtype=torch.float64)
    torch.testing.assert_close(m["rollout_corr/kl"], (-log_r).mean())  # padding ignored
    torch.testing.assert_close(m["rollout_corr/k3_kl"], (log_r.exp() - 1 - log_r).mean())


def test_sequence_tis_uses_the_product_of_ratios() -> None:
    old = torch.tensor([[LN(0.8), LN(0.9), LN(0.5), 0.0], [LN(0.5), LN(0.5), 0.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[LN(0.4), LN(0.9), LN(0.5), 0.0], [LN(0.25), LN(0.25), 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    # sequence ratios: 2·1·1 = 2 (kept as is at C = 3), 2·2 = 4 (truncated to 3)
    w, _, m = correction(rollout_is="sequence", rollout_is_threshold=3.0)(old, rollout, mask)
    torch.testing.assert_close(w * mask, torch.tensor([[2.0, 2.0, 2.0, 0.0], [3.0, 3.0, 0.0, 0.0]],
                                                      dtype=torch.float64))
    torch.testing.assert_close(m["rollout_corr/truncated_frac"], torch.tensor(2 / 5, dtype=torch.float64))


def test_sequence_weight_of_a_long_response_does_not_overflow() -> None:
    old = torch.zeros(1, 400, dtype=torch.float64)
    rollout = torch.full((1, 400), -0.5, dtype=torch.float64)  # ratio e^0.5 per token, e^200 per sequence
    w, _, _ = correction(rollout_is="sequence", rollout_is_threshold=5.0)(old, rollout, torch.ones(1, 400))
    assert torch.isfinite(w).all() and torch.allclose(w, torch.full_like(w, 5.0))


def test_token_rejection_masks_tokens_outside_the_band() -> None:
    rc = correction(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5)
    w, keep, m = rc(OLD, ROLLOUT, MASK)
    assert torch.equal(keep, torch.tensor([[0.0, 1.0, 0.0, 0.0]], dtype=torch.float64))
    assert torch.equal(w, torch.ones_like(w))  # rejection only: kept tokens weigh 1
    torch.testing.assert_close(m["rollout_corr/masked_frac"], torch.tensor(2 / 3, dtype=torch.float64))


def test_band_defaults_to_is_threshold_and_its_reciprocal() -> None:
    rc = correction(rollout_rs="token", rollout_is_threshold=4.0)
    assert (rc.rs_lower, rc.rs_upper) == (0.25, 4.0)
    _, keep, _ = rc(OLD, ROLLOUT, MASK)  # 4 and 0.25 sit on the band's edges: kept
    assert torch.equal(keep, MASK)


def test_sequence_mis_drops_whole_sequences() -> None:
    # MIS of Liu et al.: sequence IS weight, sequences with ρ_i > C are dropped instead of truncated
    old = torch.tensor([[LN(0.8), LN(0.5)], [LN(0.5), LN(0.5)]], dtype=torch.float64)
    rollout = torch.tensor([[LN(0.2), LN(0.5)], [LN(0.4), LN(0.5)]], dtype=torch.float64)  # ρ_i = 4, 1.25
    mask = torch.ones(2, 2, dtype=torch.float64)
    rc = correction(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="sequence",
                    rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.0)  # verl's seq_mis: no lower edge
    w, keep, m = rc(old, rollout, mask)
    assert torch.equal(keep, torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(w[1], torch.tensor([1.25, 1.25], dtype=torch.float64))
    torch.testing.assert_close(m["rollout_corr/masked_frac"], torch.tensor(0.5, dtype=torch.float64))


def test_empty_response_has_weight_one_and_finite_metrics() -> None:
    old, rollout = torch.tensor([[1.0, 2.0], [LN(0.5), 0.0]]), torch.tensor([[-3.0, 5.0], [LN(0.25), 0.0]])
    mask = torch.tensor([[0.0, 0.0], [1.0, 0.0]])  # sample 0 generated nothing
    for level in ("token", "sequence"):
        w, keep, m = correction(rollout_is=level, rollout_rs=level, rollout_is_threshold=4.0)(old, rollout, mask)
        assert torch.equal(w[0], torch.ones(2)) and torch.equal(keep[0], torch.zeros(2))
        torch.testing.assert_close(w[1, 0], torch.tensor(2.0))
        assert all(torch.isfinite(v) for v in m.values())
    w, keep, m = correction(rollout_is="token")(old, rollout, torch.zeros(2, 2))  # no response token at all
    assert all(v == 0 for v in m.values())
    mx, mn = ratio_extremes(old, rollout, mask)
    torch.testing.assert_close((mx, mn), (torch.tensor(2.0), torch.tensor(2.0)))


def test_ratio_extremes_ignore_padding() -> None:
    mx, mn = ratio_extremes(OLD, ROLLOUT, MASK)
    torch.testing.assert_close((mx, mn), (torch.tensor(4.0, dtype=torch.float64),
                                          torch.tensor(0.25, dtype=torch.float64)))


def test_off_by_default() -> None:
    assert RolloutCorrection.from_config(RolloutCorrectionConfig()) is None


# ---- through the actor objective ----

def batch(old_BT: torch.Tensor, rollout_BT: torch.Tensor, adv_BT: torch.Tensor, mask_BT: torch.Tensor) -> RolloutBatch:
    b, t = old_BT.shape
    return RolloutBatch(
        prompt_ids=torch.ones(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
        response_ids=torch.ones(b, t, dtype=torch.long), response_mask=mask_BT.long(), rollout_logprobs=rollout_BT,
        weight_version=torch.zeros(b, dtype=torch.long), group_index=torch.arange(b),
        meta=[SampleMeta() for _ in range(b)], pad_token_id=0, old_logprobs=old_BT, advantages=adv_BT)


def objective(rc: RolloutCorrection | None, loss: object = None, mode: str = "token-mean") -> ActorObjective:
    return ActorObjective(policy_loss=loss or PPOClipLoss(), loss_agg_mode=mode, entropy_coeff=0.0,  # type: ignore[arg-type]
                          use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl", rollout_correction=rc)


def synthetic(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits_BTV = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    tokens_BT = torch.randint(0, 7, (3, 5), generator=g)
    adv_BT = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.float64)
    return logits_BTV, tokens_BT, adv_BT * mask_BT, mask_BT


def token_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits_BTV / temperature, -1).gather(-1, tokens_BT[..., None]).squeeze(-1)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gradient_under_a_temperature_mismatch_is_the_hand_weighted_one(level: str, mode: str) -> None:
    """The engine sampled at T = 0.7, the trainer scores at T = 1. On the first mini-batch (π_θ = π_old,
    so PPO's ratio is 1 and unclipped), d l_t / d logit_{t,v} = −w_t A_t (1[v = y_t] − p_{t,v}) before
    aggregation; the autograd gradient of the objective must be exactly that."""
    logits_BTV, tokens_BT, adv_BT, mask_BT = synthetic()
    logits_BTV.requires_grad_(True)
    logprobs_BT = token_logprobs(logits_BTV, tokens_BT, 1.0)
    on_BT = mask_BT.bool()  # padded positions hold garbage log-probs, which the mask must hide
    old_BT = torch.where(on_BT, logprobs_BT.detach(), 5.0)
    rollout_BT = torch.where(on_BT, token_logprobs(logits_BTV.detach(), tokens_BT, 0.7), -9.0)
    mb = batch(old_BT, rollout_BT, adv_BT, mask_BT)
    rc = correction(rollout_is=level, rollout_is_threshold=1.5)
    loss, metrics = objective(rc, mode=mode)(logprobs_BT, torch.zeros_like(logprobs_BT), mb,
                                             normalizer=local_normalizer(mask_BT, mode))
    (grad_BTV,) = torch.autograd.grad(loss, logits_BTV, retain_graph=True)

    log_r_BT = (old_BT - rollout_BT) * mask_BT
    if level == "sequence":
        log_r_BT = log_r_BT.sum(-1, keepdim=True).expand_as(log_r_BT)
    w_BT = log_r_BT.exp().clamp(max=1.5)
    assert (w_BT * mask_BT < 1.5).any() and (w_BT * mask_BT == 1.5).any()  # both branches exercised
    if mode == "token-mean":
        scale_BT = mask_BT / mask_BT.sum()
    else:
        scale_BT = mask_BT / mask_BT.sum(-1, keepdim=True).clamp_min(1) / 2  # 2 non-empty sequences
    onehot_BTV = torch.nn.functional.one_hot(tokens_BT, 7).double()
    p_BTV = torch.softmax(logits_BTV.detach(), -1)
    hand_BTV = (-(w_BT * adv_BT * scale_BT))[..., None] * (onehot_BTV - p_BTV)
    torch.testing.assert_close(grad_BTV, hand_BTV, rtol=1e-12, atol=1e-14)
    (plain_BTV,) = torch.autograd.grad(objective(None, mode=mode)(
        logprobs_BT, torch.zeros_like(logprobs_BT), mb, normalizer=local_normalizer(mask_BT, mode))[0], logits_BTV)
    assert not torch.allclose(plain_BTV, grad_BTV)  # the correction does change the update
    assert metrics["rollout_corr/truncated_frac"] > 0 and metrics["clipfrac"] == 0 and metrics["ppo_kl"] == 0


@pytest.mark.parametrize("loss", [PPOClipLoss(), DualClipLoss()], ids=["ppo_clip", "dual_clip"])
def test_weights_in_advantages_equal_the_weighted_per_token_loss(loss: PPOClipLoss) -> None:
    """Off-policy (π_θ ≠ π_old, clipping active): w·A inside the plugin = w times its per-token loss."""
    logits_BTV, tokens_BT, adv_BT, mask_BT = synthetic(1)
    logits_BTV.requires_grad_(True)
    logprobs_BT = token_logprobs(logits_BTV, tokens_BT, 1.0)
    old_BT = token_logprobs(logits_BTV.detach() * 1.6, tokens_BT, 1.0) * mask_BT
    rollout_BT = token_logprobs(logits_BTV.detach(), tokens_BT, 0.7) * mask_BT
    mb = batch(old_BT, rollout_BT, adv_BT, mask_BT)
    rc = correction(rollout_is="token", rollout_is_threshold=1.05, rollout_rs="token",  # ρ_t from 0.70 to 1.09
                    rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.75)
    got, metrics = objective(rc, loss)(logprobs_BT, torch.zeros_like(logprobs_BT), mb,
                                       normalizer=local_normalizer(mask_BT, "token-mean"))
    w_BT, keep_BT, _ = rc(old_BT, rollout_BT, mask_BT)
    assert 0 < float((mask_BT - keep_BT).sum()) < float(mask_BT.sum())  # some tokens rejected, some kept
    ratio_BT = (logprobs_BT - old_BT).exp()
    per_token_BT, _ = loss.per_token_loss(ratio_BT, adv_BT, keep_BT)
    want = aggregate(w_BT * per_token_BT, keep_BT, "token-mean", global_normalizer=mask_BT.sum())
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(got, logits_BTV, retain_graph=True)[0],
                               torch.autograd.grad(want, logits_BTV)[0])
    assert metrics["clipfrac"] > 0 and metrics["rollout_corr/truncated_frac"] > 0


def test_off_is_bitwise_identical_to_the_plain_objective() -> None:
    logits_BTV, tokens_BT, adv_BT, mask_BT = synthetic(2)
    logprobs_BT = token_logprobs(logits_BTV, tokens_BT, 1.0)
    old_BT = token_logprobs(logits_BTV * 1.3, tokens_BT, 1.0) * mask_BT
    mb = batch(old_BT, token_logprobs(logits_BTV, tokens_BT, 0.7) * mask_BT, adv_BT, mask_BT)
    norm = local_normalizer(mask_BT, "token-mean")
    loss, metrics = objective(RolloutCorrection.from_config(RolloutCorrectionConfig()))(
        logprobs_BT, torch.zeros_like(logprobs_BT), mb, normalizer=norm)
    pg, pg_metrics = PPOClipLoss()(logprobs_BT=logprobs_BT, old_logprobs_BT=old_BT, advantages_BT=adv_BT,
                                   response_mask_BT=mask_BT, loss_agg_mode="token-mean", global_normalizer=norm)
    assert torch.equal(loss, pg) and torch.equal(metrics["clipfrac"], pg_metrics["clipfrac"])
    assert not any(k.startswith("rollout_corr/") for k in metrics)


# ---- config ----

def test_config_problems_name_key_value_and_valid_values() -> None:
    assert config_problems(RolloutCorrectionConfig()) == []
    assert config_problems(RolloutCorrectionConfig(rollout_is="sequence", rollout_rs="token")) == []
    bad = config_problems(RolloutCorrectionConfig(rollout_is="geometric", rollout_is_threshold=0.0,
                                                  rollout_rs="seq", rollout_rs_threshold=-1.0,
                                                  rollout_rs_threshold_lower=-0.5))
    assert [(k.rsplit(".", 1)[1], v) for k, v, _ in bad] == [
        ("rollout_is", "geometric"), ("rollout_rs", "seq"), ("rollout_is_threshold", 0.0),
        ("rollout_rs_threshold", -1.0), ("rollout_rs_threshold_lower", -0.5)]
    assert all(k.startswith("algorithm.rollout_correction.") for k, _, _ in bad)
    assert "valid: token, sequence or null (off)" in bad[0][2]
    (empty,) = config_problems(RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0,
                                                       rollout_rs_threshold_lower=2.0))
    assert empty[0] == "algorithm.rollout_correction.rollout_rs_threshold_lower"
    assert "[2, 2] is empty: lower must be < upper" in empty[2]
    (below_one,) = config_problems(RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=0.5))
    assert "[2, 0.5] is empty" in below_one[2]  # the default lower edge 1/upper is above upper


def test_validate_reports_rollout_correction_keys(tmp_path: Path) -> None:
    from hybridrl.config.compose import compose_config
    from hybridrl.config.errors import ConfigError
    from hybridrl.config.validate import validate
    from hybridrl.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", hidden=32, layers=2, heads=4, kv_heads=2, max_positions=128)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files=[{data}]", "actor_rollout_ref.rollout.n=4",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.max_prompt_length=32",
            "data.max_response_length=16", "trainer.total_training_steps=2"]
    cfg = compose_config([*base, "algorithm.rollout_correction.rollout_is=sequence",
                          "algorithm.rollout_correction.rollout_is_threshold=3.0"])
    assert cfg.algorithm.rollout_correction.rollout_is == "sequence"
    validate(cfg, world_size=1)
    with pytest.raises(ConfigError) as e:
        validate(compose_config([*base, "algorithm.rollout_correction.rollout_is=tokens",
                                 "algorithm.rollout_correction.rollout_is_threshold=-2"]), world_size=1)
    assert [str(i) for i in e.value.issues] == [
        "algorithm.rollout_correction.rollout_is='tokens': valid: token, sequence or null (off)",
        "algorithm.rollout_correction.rollout_is_threshold=-2.0: must be > 0 (the IS weight is truncated at it; "
        "2.0 is typical)"]
