"""hybridrl: Megatron-core RL post-training for LLMs with colocated SGLang rollouts."""

from hybridrl.megatron import lean_import
from hybridrl.megatron.fallbacks import ignore_fallback_warnings

__version__ = "0.1.0"

ignore_fallback_warnings()  # megatron-core's TE/Apex-missing import warnings: init_parallel says it in one line
lean_import.install()  # import megatron.core without dynamo/inductor/wandb, which a run never uses
