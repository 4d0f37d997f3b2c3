"""The offline trainers' skeleton (SFT, DPO, the reward model): a fixed dataset, one optimizer step per loader batch,
held-out metrics every ``trainer.test_freq`` steps and at the end, an HF checkpoint at ``trainer.save_path``.

    start (process groups, the output-dir lock, seeds, tokenizer, datasets, loader, the policy)
    for each step: metrics = job.step(policy, batch); + job.validate(...) when due; log
        stop early once job.target_metric reaches trainer.target_accuracy (when set)
    save the model as an HF checkpoint (LoRA: the merged weights)

With ``trainer.target_accuracy`` a run stops on what it is for, not on a step count: the step at which a small model
crosses a given quality moves with the CPU's kernels, the thread count and the package versions (the tiny recipes'
warm starts drop sharply once, anywhere from step 400 to 1100), so a fixed step count gives another model on every
machine. ``total_training_steps`` is then the cap; ending there below the target raises :class:`TargetNotReached`
and saves nothing, so no caller ever takes a half-trained model for the one it asked for.

A job (:class:`OfflineJob`) says what differs: its datasets, how a loader batch becomes one optimizer step, and its
held-out metrics. The policy is the RL actor's ``MegatronPolicy`` (every TP/PP/CP/DP layout, LoRA); a job that
needs a reference builds it with :func:`hybridrl.megatron.policy.reference_policy`, as the RL loop does.
Unlike the RL trainer, there is no mid-run checkpoint or resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hybridrl.config.errors import UserError
from hybridrl.config.sft_schema import SFTTrainerConfig
from hybridrl.data.collate import PromptBatch
from hybridrl.data.loader import PromptLoader
from hybridrl.data.sampler import SamplerConfig
from hybridrl.hf.write import save_hf_checkpoint
from hybridrl.lora.config import LoRAConfig
from hybridrl.megatron.parallel import init_parallel, seed_everything
from hybridrl.megatron.policy import MegatronPolicy, parallel_config
from hybridrl.run_lock import hold_output_dir
from hybridrl.tracking import Tracker, say

if TYPE_CHECKING:
    from hybridrl.config.schema import ModelConfig
    from hybridrl.megatron.config import MegatronConfig, OptimConfig


class OfflineConfig(Protocol):
    """What the skeleton reads of an SFT or DPO config (``data`` as far as the loader goes)."""

    model: ModelConfig
    megatron: MegatronConfig
    optim: OptimConfig
    trainer: SFTTrainerConfig


class TargetNotReached(UserError):
    """An offline run hit ``trainer.total_training_steps`` below ``trainer.target_accuracy`` (nothing was saved): said
    in one line, as a config mistake is, since what would help is a setting."""


class OfflineJob(Protocol):
    """What differs between the offline trainers; a job subclasses this for its defaults (``build``: the causal LM of
    ``cfg.model``, ``hf_config``: the start model's config.json as it is)."""

    name: str  # "SFT", "DPO", "RM": the start of its log lines
    target_metric: str | None  # the held-out metric trainer.target_accuracy is compared with (None: not supported)
    cfg: Any  # the run's config (an OfflineConfig)

    def build(self, *, pad_token_id: int, freeze_vision_tower: bool = False) -> Any:
        """The trained model (a :class:`~hybridrl.megatron.runner.MegatronRunner` with ``export_weights``)."""
        c: OfflineConfig = self.cfg
        return MegatronPolicy(model_dir=c.model.path, megatron=c.megatron, optim=c.optim,
                              total_steps=c.trainer.total_training_steps, pad_token_id=pad_token_id,
                              lora=LoRAConfig.from_model(c.model, key="model"),  # LoRA: saves the merged weights
                              freeze_vision_tower=freeze_vision_tower)

    def hf_config(self) -> dict[str, Any]:
        """What the saved checkpoint's config.json changes from the start model's (nothing: the same architecture)."""
        return {}

    def keeps_chat_template(self) -> bool:
        """Whether the saved tokenizer keeps the start model's chat template (yes: a policy is read as it was)."""
        return True

    def datasets(self, tokenizer: PreTrainedTokenizerBase) -> tuple[Any, Any]:
        """The training rows (a ``PromptDataset``) and the held-out ones (None: no validation)."""

    def start(self, policy: MegatronPolicy, *, tokenizer: PreTrainedTokenizerBase, pad_token_id: int,
              train: Any) -> str:
        """Called once the policy is built (a reference, loss settings); returns the start line, name first."""

    def step(self, policy: MegatronPolicy, prompts: PromptBatch) -> dict[str, float]:
        """One optimizer step on one loader batch; its metrics, as logged."""

    def validate(self, policy: MegatronPolicy, val: Any) -> dict[str, float]:
        """The held-out metrics (every DP rank scores its share: :func:`dp_strided_passes`)."""


def fit_offline(cfg: OfflineConfig, job: OfflineJob, *, train_batch_size: int, shuffle: bool) -> dict[str, float]:
    init_parallel(parallel_config(cfg.megatron))
    t = cfg.trainer
    hold_output_dir(t.output_dir)  # before anything is written: a second run on it fails here
    seed_everything(t.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    train, val = job.datasets(tokenizer)
    loader = PromptLoader(train, sampler=SamplerConfig(train_batch_size=train_batch_size, shuffle=shuffle,
                                                       seed=t.seed),
                          dp_rank=parallel_state.get_data_parallel_rank(),
                          dp_size=parallel_state.get_data_parallel_world_size())
    policy = job.build(pad_token_id=loader.pad_token_id)
    say(job.start(policy, tokenizer=tokenizer, pad_token_id=loader.pad_token_id, train=train))
    tracker = Tracker(t, config={}, rank=dist.get_rank())
    metrics: dict[str, float] = {}
    target, best = t.target_accuracy, float("-inf")
    for step, prompts in zip(range(1, t.total_training_steps + 1), loader.forever(), strict=False):
        metrics = job.step(policy, prompts)
        if val is not None and t.test_freq and (step % t.test_freq == 0 or step == t.total_training_steps):
            metrics |= job.validate(policy, val)
            best = max(best, metrics.get(job.target_metric or "", best))
        tracker.log(metrics, step=step)
        if target is not None and best >= target:
            say(f"{job.name}: {job.target_metric} {best:.3f} reached trainer.target_accuracy={target:g} at step {step} "
                f"of at most {t.total_training_steps}")
            break
    if target is not None and best < target:
        tracker.close()
        raise TargetNotReached(
            f"{job.name} ({t.experiment_name}): {job.target_metric} was at most {max(best, 0.0):.3f} in "
            f"trainer.total_training_steps={t.total_training_steps} steps, below trainer.target_accuracy={target:g}; "
            f"nothing was saved to {t.save_path}. Raise the step cap or the learning rate (optim.lr), or lower the "
            "target")
    say(f"{job.name}: saving the HF checkpoint to {t.save_path}")
    save_hf_checkpoint(policy.export_weights(bucket_bytes=256 << 20), t.save_path, source_dir=cfg.model.path,
                       key="trainer.save_path", overwrite=t.overwrite_save_path,
                       overwrite_option="trainer.overwrite_save_path=true", protect=[cfg.model.path],
                       config_updates=job.hf_config(), chat_template=job.keeps_chat_template())
    tracker.close()
    return metrics


def dp_strided_passes(n: int, rows: int) -> Iterator[tuple[list[int], float]]:
    """This DP rank's share of ``n`` held-out rows (every DP-size-th one), in passes of at most ``rows``:
    ``(indices, weight)``. Every rank runs the same number of passes (their forwards are collectives); a rank with
    nothing left gets row 0 with weight 0, a pass that counts for nothing."""
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = list(range(dp_rank, n, dp_size))
    for start in range(0, -(-n // dp_size), rows):
        idx = mine[start:start + rows]
        yield (idx, 1.0) if idx else ([0], 0.0)
