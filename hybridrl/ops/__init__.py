"""Fused kernels: log-prob + entropy over (vocab-parallel) logits or straight from the LM head (``csrc/``)."""

from hybridrl.ops.kernels import compiled_kernels, kernels_for
from hybridrl.ops.logprob import lm_head_logprob_entropy, logprob_entropy

__all__ = ["compiled_kernels", "kernels_for", "lm_head_logprob_entropy", "logprob_entropy"]
