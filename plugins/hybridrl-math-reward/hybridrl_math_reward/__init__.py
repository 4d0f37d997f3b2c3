"""hybridrl reward manager ``math``: GSM8K/MATH final answers checked with math-verify (see ``reward.py``)."""

from hybridrl_math_reward.reward import MathReward

__all__ = ["MathReward"]
