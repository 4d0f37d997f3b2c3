"""Advantage estimators (entry-point group ``hybridrl.advantage_estimators``), one module each."""

from hybridrl.algorithms.advantages.drgrpo import DrGRPOEstimator
from hybridrl.algorithms.advantages.gae import GAEEstimator
from hybridrl.algorithms.advantages.grpo import GRPOEstimator
from hybridrl.algorithms.advantages.opd import GRPOOPDEstimator, OPDEstimator
from hybridrl.algorithms.advantages.reinforce_pp import ReinforcePlusPlusEstimator
from hybridrl.algorithms.advantages.reinforce_pp_baseline import ReinforcePlusPlusBaselineEstimator
from hybridrl.algorithms.advantages.rloo import RLOOEstimator

__all__ = ["DrGRPOEstimator", "GAEEstimator", "GRPOEstimator", "GRPOOPDEstimator", "OPDEstimator", "RLOOEstimator",
           "ReinforcePlusPlusBaselineEstimator", "ReinforcePlusPlusEstimator"]
