"""Supervised fine-tuning of the Megatron actor on prompt → response pairs; saves an HF checkpoint.

    L = -(1/N) Σ_i Σ_t m_{i,t} log π(y_{i,t} | x_i, y_{i,<t}),   N = Σ m over the global batch

Loss on the response tokens only (EOS appended to each target), token-mean over the whole
optimizer batch across micro-batches and DP ranks (the same normalisation as the RL actor).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hybridrl.algorithms.loss_agg import aggregate
from hybridrl.batch import RolloutBatch
from hybridrl.config.plan import MicroBatching
from hybridrl.config.sft_schema import SFTConfig
from hybridrl.data.collate import PromptBatch, collate_prompts
from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
from hybridrl.data.loader import PromptLoader
from hybridrl.data.sampler import SamplerConfig
from hybridrl.hf_checkpoint import save_hf_checkpoint
from hybridrl.lora_config import LoRAConfig
from hybridrl.megatron.parallel import init_parallel, seed_everything
from hybridrl.megatron.policy import MegatronPolicy, parallel_config
from hybridrl.metrics import DPMeans
from hybridrl.run_lock import hold_output_dir
from hybridrl.tracking import Tracker, say


def sft_batch(prompts: PromptBatch, tokenizer: PreTrainedTokenizerBase, *, max_response_length: int) -> RolloutBatch:
    """Targets = tokenized ground truth + EOS, right-padded, as a RolloutBatch the actor can train on."""
    eos = tokenizer.eos_token_id
    targets = []
    for meta in prompts.meta:
        if meta.ground_truth is None:
            raise ValueError("an SFT row has no response (data.response_key)")
        ids = tokenizer(meta.ground_truth, add_special_tokens=False)["input_ids"][:max_response_length - 1]
        targets.append(ids + [eos])
    B, T = len(targets), max(len(t) for t in targets)
    response_ids_BT = torch.full((B, T), prompts.pad_token_id, dtype=torch.long)
    mask_BT = torch.zeros((B, T), dtype=torch.long)
    for b, ids in enumerate(targets):
        response_ids_BT[b, :len(ids)] = torch.tensor(ids)
        mask_BT[b, :len(ids)] = 1
    return RolloutBatch(prompt_ids=prompts.input_ids, prompt_mask=prompts.attention_mask,
                        response_ids=response_ids_BT, response_mask=mask_BT, rollout_logprobs=torch.zeros(B, T),
                        weight_version=torch.zeros(B, dtype=torch.long), group_index=prompts.index,
                        meta=prompts.meta, pad_token_id=prompts.pad_token_id)


def nll_loss(logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor, mb: RolloutBatch, *,
             normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the token-mean NLL of the whole batch (``normalizer``: its token count)."""
    loss = -aggregate(logprobs_BT, mb.response_mask, "token-mean", global_normalizer=normalizer)
    return loss, {"loss_sum": loss.detach()}


def validation_loss(policy: MegatronPolicy, val: PromptDataset, tokenizer: PreTrainedTokenizerBase,
                    micro: MicroBatching, *, max_response_length: int, pad_token_id: int) -> float:
    """Token-mean NLL of the held-out pairs (``data.val_files``), each DP rank scoring its share."""
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = list(range(dp_rank, len(val), dp_size))
    rows = 256  # pairs per forward-only pass (micro-batched inside)
    m = DPMeans()
    for start in range(0, -(-len(val) // dp_size), rows):  # the same number of passes on every rank
        idx = mine[start:start + rows]
        weight = 1.0 if idx else 0.0  # a rank with nothing left runs a pass on row 0 that counts for nothing
        idx = idx or [0]
        batch = sft_batch(collate_prompts([val[i] for i in idx], idx, pad_token_id=pad_token_id), tokenizer,
                          max_response_length=max_response_length)
        logp_BT, _ = policy.compute_log_probs(batch, batching=micro)
        m.add("val/loss", -(logp_BT * batch.response_mask).sum() * weight, batch.response_mask.sum() * weight)
    return m.reduce()["val/loss"]


def fit_sft(cfg: SFTConfig) -> dict[str, float]:
    init_parallel(parallel_config(cfg.megatron))
    d, t = cfg.data, cfg.trainer
    hold_output_dir(t.output_dir)  # before anything is written: a second run on it fails here
    seed_everything(t.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    dataset = PromptDataset(d.train_files, tokenizer=tokenizer, config=PromptDatasetConfig(
        prompt_key=d.prompt_key, ground_truth_key=d.response_key, apply_chat_template=d.apply_chat_template,
        max_prompt_length=d.max_prompt_length))
    dp_size = parallel_state.get_data_parallel_world_size()
    loader = PromptLoader(dataset, sampler=SamplerConfig(train_batch_size=d.train_batch_size, shuffle=d.shuffle,
                                                         seed=t.seed),
                          dp_rank=parallel_state.get_data_parallel_rank(), dp_size=dp_size)
    policy = MegatronPolicy(model_dir=cfg.model.path, megatron=cfg.megatron, optim=cfg.optim,
                            total_steps=t.total_training_steps, pad_token_id=loader.pad_token_id,
                            lora=LoRAConfig.from_model(cfg.model, key="model"))  # LoRA: saves the merged weights
    val = PromptDataset(d.val_files, tokenizer=tokenizer, config=dataset.config) if d.val_files else None
    tracker = Tracker(t, config={}, rank=dist.get_rank())
    say(f"SFT: {len(dataset)} pairs, {t.total_training_steps} steps of {d.train_batch_size} samples")

    def batches():  # epoch after epoch
        while True:
            yield from loader

    metrics: dict[str, float] = {}
    micro = MicroBatching(micro_batch_size=d.micro_batch_size_per_gpu)
    for step, prompts in zip(range(1, t.total_training_steps + 1), batches(), strict=False):
        batch = sft_batch(prompts, tokenizer, max_response_length=d.max_response_length)
        step_metrics = policy.train_step(batch, nll_loss, batching=micro, loss_agg_mode="token-mean")
        metrics = {f"sft/{k}": v for k, v in step_metrics.items()}
        if val is not None and t.test_freq and (step % t.test_freq == 0 or step == t.total_training_steps):
            metrics["val/loss"] = validation_loss(policy, val, tokenizer, micro, pad_token_id=loader.pad_token_id,
                                                  max_response_length=d.max_response_length)
        tracker.log(metrics, step=step)
    say(f"SFT: saving the HF checkpoint to {t.save_path}")
    save_hf_checkpoint(policy.export_weights(bucket_bytes=256 << 20), t.save_path, source_dir=cfg.model.path,
                       key="trainer.save_path", overwrite=t.overwrite_save_path,
                       overwrite_option="trainer.overwrite_save_path=true", protect=[cfg.model.path])
    tracker.close()
    return metrics

