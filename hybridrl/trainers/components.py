"""Everything the RL loop needs, built from a validated config (the loop itself is ``rl.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hybridrl.algorithms.actor_objective import ActorObjective
from hybridrl.algorithms.kl_controller import KLController
from hybridrl.algorithms.rollout_correction import RolloutCorrection
from hybridrl.checkpoint.rl import load_checkpoint, resume_point, save_checkpoint
from hybridrl.config.plan import Plan
from hybridrl.config.schema import RLConfig
from hybridrl.data.collate import PromptBatch
from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
from hybridrl.data.loader import PromptLoader
from hybridrl.data.sampler import SamplerConfig
from hybridrl.guards import require_finite
from hybridrl.hybrid import ActorRolloutRef
from hybridrl.interfaces import AdvantageEstimator, ResumableRollout, Rollout
from hybridrl.megatron.parallel import init_parallel, rank_device, seed_everything
from hybridrl.megatron.policy import parallel_config
from hybridrl.registry import Registry
from hybridrl.rewards.execution import RewardRunner
from hybridrl.rollout.build import build_rollout
from hybridrl.rollout.episodes import tool_schemas
from hybridrl.rollout.teacher_service import RemoteTeacher
from hybridrl.rollout.workers import EngineWorkers, build_engines
from hybridrl.run_lock import hold_output_dir
from hybridrl.tracking import Tracker, say


@dataclass(slots=True, kw_only=True)
class Components:
    cfg: RLConfig
    plan: Plan
    tokenizer: PreTrainedTokenizerBase
    loader: PromptLoader
    val_dataset: PromptDataset | None
    hybrid: ActorRolloutRef
    rollout: Rollout  # the step's samples and their pending scores; weight sync (rollout/build.py picks the kind)
    reward: RewardRunner  # the reward manager, run as reward.* says (thread or workers, time limit, on_error)
    estimator: AdvantageEstimator
    kl_ctrl: KLController  # β of algorithm.use_kl_in_reward (saved with checkpoints)
    tracker: Tracker
    model_path: str
    resume_step: int = 0  # the step of the checkpoint this run resumed from (0: a fresh run)

    def prompts(self) -> Iterator[PromptBatch]:
        """A new stream over the training prompts (the rollout holds its own)."""
        return self.loader.forever()

    def val_batches(self) -> Iterator[PromptBatch]:
        """The validation set in batches of ``data.val_batch_size`` prompts (each prompt exactly once)."""
        from hybridrl.data.collate import collate_prompts

        assert self.val_dataset is not None
        size = self.cfg.data.val_batch_size
        for start in range(0, len(self.val_dataset), size):
            idx = list(range(start, min(start + size, len(self.val_dataset))))
            yield collate_prompts([self.val_dataset[i] for i in idx], idx, pad_token_id=self.loader.pad_token_id)

    def save(self, step: int) -> None:
        self.hybrid.actor_offload.reload()  # the checkpoint reads every state kind (an eval may have offloaded)
        if self.hybrid.critic_offload is not None:
            self.hybrid.critic_offload.reload()
        require_finite(self.hybrid.actor.parameters(), what="the actor's weights")  # a NaN model is never saved
        # a rollout that draws ahead (async) saves the position of its oldest untrained batch, and its own count
        rollout_state = self.rollout.state_dict() if isinstance(self.rollout, ResumableRollout) else None
        sampler = rollout_state["sampler"] if rollout_state else self.loader.state_dict()
        path = save_checkpoint(cfg=self.cfg, step=step, policy=self.hybrid.actor,
                               weight_version=self.rollout.weight_version, sampler_state=sampler,
                               rollout_state=rollout_state, kl_ctrl_state=self.kl_ctrl.state_dict(),
                               model_dir=self.model_path, critic=self.hybrid.critic)
        say(f"saved checkpoint {path}")

    def close(self) -> None:
        self.reward.close()
        self.rollout.shutdown()
        self.hybrid.close()
        self.tracker.close()


def build_components(cfg: RLConfig, plan: Plan) -> Components:
    aor = cfg.actor_rollout_ref
    init_parallel(parallel_config(aor.actor.megatron), timeout_s=cfg.trainer.dist_timeout_s)
    hold_output_dir(cfg.trainer.output_dir)  # before anything is written: a second run on it fails here
    resume_from = resume_point(cfg)  # checkpoints that are not this run's history are moved aside
    seed_everything(cfg.trainer.seed)
    model_path = aor.model.path
    say(f"world {dist.get_world_size()}: actor {plan.roles['actor']}; loading {model_path}")
    tokenizer_path = aor.model.tokenizer_path or model_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    d = cfg.data
    ds_cfg = PromptDatasetConfig(prompt_key=d.prompt_key, ground_truth_key=d.ground_truth_key,
                                 apply_chat_template=d.apply_chat_template, max_prompt_length=d.max_prompt_length,
                                 filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation,
                                 tools=tool_schemas(cfg))
    prompts = prompt_datasets(plan, ds_cfg, tokenizer_path, tokenizer, image_key=d.image_key)
    train = prompts(d.train_files)
    loader = PromptLoader(train, sampler=SamplerConfig(train_batch_size=plan.batch.prompts_per_generation,
                                                       shuffle=d.shuffle,
                                                       seed=cfg.trainer.seed), dp_rank=0, dp_size=1)
    val = prompts(d.val_files) if d.val_files else None
    teacher = RemoteTeacher(plan, timeout_s=cfg.trainer.dist_timeout_s) if plan.teacher_engines else None
    hybrid = ActorRolloutRef(aor, plan=plan, objective=actor_objective(cfg), pad_token_id=loader.pad_token_id,
                             critic=cfg.critic, seed=cfg.trainer.seed, balance_batch=cfg.trainer.balance_batch,
                             remote_teacher=teacher)
    workers = EngineWorkers(build_engines(cfg, plan, pad_token_id=loader.pad_token_id), trainer=hybrid,
                            bucket_megabytes=aor.rollout.update_weights_bucket_megabytes)
    reward = RewardRunner.build(cfg.reward, tokenizer=tokenizer, tokenizer_path=tokenizer_path,
                                max_response_length=d.max_response_length, device=rank_device())
    estimator = Registry("advantage_estimators").build(
        cfg.algorithm.adv_estimator, cfg.algorithm.adv_estimator_kwargs, key="algorithm.adv_estimator_kwargs")
    # each step's whole prompt batch, the same on every rank (under algorithm.filter_groups: each round's); the
    # rollout hands each rank its DP share of the samples; resumable through the loader
    rollout = build_rollout(cfg, plan, workers=workers, prompts=loader.forever(), position=loader.state_dict,
                            reward=reward, tokenizer=tokenizer)
    kl_ctrl, resume_step = KLController(cfg.algorithm.kl_ctrl), 0
    if resume_from is not None:
        say(f"resuming from {resume_from}")
        state = load_checkpoint(resume_from, cfg=cfg, policy=hybrid.actor, critic=hybrid.critic)
        loader.load_state_dict(state["sampler"])
        rollout.sync_weights(version=state["weight_version"])  # the engines get the restored actor and version
        resume_step = state["step"]
        if isinstance(rollout, ResumableRollout):  # the staleness count: the bound holds across the resume
            rollout.load_state_dict(state.get("rollout"), step=resume_step)
        if state.get("kl_ctrl") is not None:  # else saved without one: β starts again at kl_ctrl.kl_coef
            kl_ctrl.load_state_dict(state["kl_ctrl"])
    Path(cfg.trainer.output_dir).mkdir(parents=True, exist_ok=True)
    tracker = Tracker(cfg.trainer, config=_flat(dataclasses.asdict(cfg)), rank=dist.get_rank(),
                      resume_step=resume_step)
    return Components(cfg=cfg, plan=plan, tokenizer=tokenizer, loader=loader, val_dataset=val,
                      hybrid=hybrid, rollout=rollout, reward=reward, estimator=estimator, kl_ctrl=kl_ctrl,
                      tracker=tracker, model_path=model_path, resume_step=resume_step)


def actor_objective(cfg: RLConfig) -> ActorObjective:
    a = cfg.actor_rollout_ref.actor
    policy_loss = Registry("policy_losses").build(cfg.algorithm.policy_loss, cfg.algorithm.policy_loss_kwargs,
                                                  key="algorithm.policy_loss_kwargs")
    return ActorObjective(policy_loss=policy_loss, loss_agg_mode=a.loss_agg_mode, entropy_coeff=a.entropy_coeff,
                          use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
                          norm_constant=cfg.data.max_response_length,
                          rollout_correction=RolloutCorrection.from_config(cfg.algorithm.rollout_correction),
                          distillation=cfg.actor_rollout_ref.teacher.loss)


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def prompt_datasets(plan: Plan, config: PromptDatasetConfig, tokenizer_path: str, tokenizer: PreTrainedTokenizerBase,
                    *, image_key: str) -> Callable[[list[str]], PromptDataset]:
    """``files -> dataset``: text prompts, or, for a vision-language model, prompts with images read through its
    processor (:mod:`hybridrl.data.multimodal`)."""
    if plan.model is None or plan.model.vision is None:
        return lambda files: PromptDataset(files, config=config, tokenizer=tokenizer)
    from transformers import AutoProcessor

    from hybridrl.data.multimodal import MultimodalDatasetConfig, MultimodalPromptDataset

    processor = AutoProcessor.from_pretrained(tokenizer_path)
    mm = MultimodalDatasetConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
                                 image_key=image_key)
    return lambda files: MultimodalPromptDataset(files, config=mm, processor=processor)
