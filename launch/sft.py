"""Start an SFT run: ``torchrun --nproc-per-node N launch/sft.py recipe=sft_tiny [key=value ...]``."""

import hydra
from omegaconf import DictConfig

from hybridrl.config.compose import register_configs
from hybridrl.trainers.entry import run_sft

register_configs()


@hydra.main(config_path="../recipes", config_name="sft", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_sft(cfg)


if __name__ == "__main__":
    main()
