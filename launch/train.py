"""Start an RL run: ``torchrun --nproc-per-node N launch/train.py recipe=grpo_tiny [key=value ...]``.

The overrides are composed with Hydra exactly as ``hybridrl validate`` composes them
(:func:`hybridrl.config.compose.compose_config`): every unknown key is reported at once, and a verl launch
script's keys are read as verl means them (docs/verl.md).
"""

import sys

from hybridrl.trainers.entry import run_rl_cli

if __name__ == "__main__":
    sys.exit(run_rl_cli(sys.argv[1:]))
