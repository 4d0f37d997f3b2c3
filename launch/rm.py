"""Train a reward model: ``torchrun --nproc-per-node N launch/rm.py recipe=rm_tiny [key=value ...]``."""

import hydra
from omegaconf import DictConfig

from hybridrl.config.rm_schema import register_rm_configs
from hybridrl.trainers.entry import run_rm

register_rm_configs()


@hydra.main(config_path="../recipes", config_name="rm", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_rm(cfg)


if __name__ == "__main__":
    main()
