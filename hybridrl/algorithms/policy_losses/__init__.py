"""Policy losses (entry-point group ``hybridrl.policy_losses``), one module each."""

from hybridrl.algorithms.policy_losses.cispo import CISPOLoss
from hybridrl.algorithms.policy_losses.dual_clip import DualClipLoss
from hybridrl.algorithms.policy_losses.gspo import GSPOLoss
from hybridrl.algorithms.policy_losses.ppo_clip import PPOClipLoss
from hybridrl.algorithms.policy_losses.sapo import SAPOLoss

__all__ = ["CISPOLoss", "DualClipLoss", "GSPOLoss", "PPOClipLoss", "SAPOLoss"]
