"""Everything the RL loop needs, built from a validated config (the loop itself is ``trainer.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hybridrl.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from hybridrl.config.schema import RLConfig
from hybridrl.config.topology import Topology
from hybridrl.data.collate import PromptBatch
from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
from hybridrl.data.loader import PromptLoader
from hybridrl.data.sampler import SamplerConfig
from hybridrl.hybrid import ActorRolloutRef
from hybridrl.interfaces import AdvantageEstimator, RewardManager
from hybridrl.megatron.parallel import init_parallel, seed_everything
from hybridrl.megatron.policy import parallel_config
from hybridrl.registry import Registry
from hybridrl.tracking import Tracker, say


@dataclass(slots=True, kw_only=True)
class Components:
    cfg: RLConfig
    topology: Topology
    tokenizer: PreTrainedTokenizerBase
    loader: PromptLoader
    val_dataset: PromptDataset | None
    hybrid: ActorRolloutRef
    reward: RewardManager
    estimator: AdvantageEstimator
    tracker: Tracker
    device: torch.device
    model_path: str
    resume_step: int = 0  # the step of the checkpoint this run resumed from (0: a fresh run)

    @property
    def dp_rank(self) -> int:
        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return parallel_state.get_data_parallel_world_size()

    def prompts(self) -> Iterator[PromptBatch]:
        """This DP rank's prompt batches, epoch after epoch (resumable through ``loader``)."""
        while True:
            yield from self.loader

    def val_batches(self) -> Iterator[PromptBatch]:
        """This DP rank's disjoint share of the validation set (every prompt exactly once overall)."""
        from hybridrl.data.collate import collate_prompts

        assert self.val_dataset is not None
        mine = list(range(self.dp_rank, len(self.val_dataset), self.dp_size))
        size = self.cfg.data.val_batch_size
        for start in range(0, len(mine), size):
            idx = mine[start:start + size]
            yield collate_prompts([self.val_dataset[i] for i in idx], idx, pad_token_id=self.loader.pad_token_id)

    def save(self, step: int) -> None:
        path = save_checkpoint(cfg=self.cfg, step=step, policy=self.hybrid.actor,
                               weight_version=self.hybrid.weight_version, sampler_state=self.loader.state_dict(),
                               model_dir=self.model_path)
        say(f"saved checkpoint {path}")

    def close(self) -> None:
        self.hybrid.shutdown()
        self.tracker.close()


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_components(cfg: RLConfig, topology: Topology) -> Components:
    aor = cfg.actor_rollout_ref
    init_parallel(parallel_config(aor.actor.megatron))
    seed_everything(cfg.trainer.seed)
    device = resolve_device(cfg.trainer.device)
    model_path = aor.model.path
    say(f"world {dist.get_world_size()}: actor {topology.roles['actor']}; loading {model_path}")
    tokenizer = AutoTokenizer.from_pretrained(aor.model.tokenizer_path or model_path)
    d = cfg.data
    ds_cfg = PromptDatasetConfig(prompt_key=d.prompt_key, ground_truth_key=d.ground_truth_key,
                                 apply_chat_template=d.apply_chat_template, max_prompt_length=d.max_prompt_length)
    train = PromptDataset(d.train_files, config=ds_cfg, tokenizer=tokenizer)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    loader = PromptLoader(train, sampler=SamplerConfig(train_batch_size=d.train_batch_size, shuffle=d.shuffle,
                                                       seed=cfg.trainer.seed), dp_rank=dp_rank, dp_size=dp_size)
    val = PromptDataset(d.val_files, config=ds_cfg, tokenizer=tokenizer) if d.val_files else None
    hybrid = ActorRolloutRef(cfg, pad_token_id=loader.pad_token_id, device=device, model_path=model_path)
    reward = Registry("reward_managers").build(cfg.reward.name, cfg.reward.kwargs, key="reward.kwargs",
                                               tokenizer=tokenizer)
    estimator = Registry("advantage_estimators").build(
        cfg.algorithm.adv_estimator, cfg.algorithm.adv_estimator_kwargs, key="algorithm.adv_estimator_kwargs")
    resume_step = 0
    resume_from = resolve_resume(cfg)
    if resume_from is not None:
        say(f"resuming from {resume_from}")
        state = load_checkpoint(resume_from, policy=hybrid.actor)
        loader.load_state_dict(state["sampler"])
        hybrid.weight_version = state["weight_version"] - 1
        hybrid.sync_weights()  # the engine gets the restored actor's weights (and version)
        resume_step = state["step"]
    Path(cfg.trainer.output_dir).mkdir(parents=True, exist_ok=True)
    tracker = Tracker(cfg.trainer, config=_flat(dataclasses.asdict(cfg)), rank=dist.get_rank(),
                      resume_step=resume_step)
    return Components(cfg=cfg, topology=topology, tokenizer=tokenizer, loader=loader, val_dataset=val,
                      hybrid=hybrid, reward=reward, estimator=estimator, tracker=tracker, device=device,
                      model_path=model_path, resume_step=resume_step)


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out
