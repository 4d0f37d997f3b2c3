"""hybridrl: Megatron-core RL post-training for LLMs with colocated SGLang rollouts."""

__version__ = "0.1.0"
