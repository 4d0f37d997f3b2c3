"""Advantage estimators (entry-point group ``hybridrl.advantage_estimators``), one module each."""

from hybridrl.algorithms.advantages.gae import GAEEstimator
from hybridrl.algorithms.advantages.grpo import GRPOEstimator
from hybridrl.algorithms.advantages.reinforce_pp import ReinforcePlusPlusEstimator
from hybridrl.algorithms.advantages.rloo import RLOOEstimator

__all__ = ["GAEEstimator", "GRPOEstimator", "RLOOEstimator", "ReinforcePlusPlusEstimator"]
