"""Start a DPO run: ``torchrun --nproc-per-node N launch/dpo.py recipe=dpo_tiny [key=value ...]``."""

import hydra
from omegaconf import DictConfig

from hybridrl.config.dpo_schema import register_dpo_configs
from hybridrl.trainers.entry import run_dpo

register_dpo_configs()


@hydra.main(config_path="../recipes", config_name="dpo", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_dpo(cfg)


if __name__ == "__main__":
    main()
