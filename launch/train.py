"""Start an RL run: ``torchrun --nproc-per-node N launch/train.py recipe=grpo_tiny [key=value ...]``."""

import hydra
from omegaconf import DictConfig

from hybridrl.config.compose import register_configs
from hybridrl.trainers.entry import run_rl

register_configs()


@hydra.main(config_path="../recipes", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_rl(cfg)


if __name__ == "__main__":
    main()
