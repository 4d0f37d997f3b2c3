"""Reward-model training on preference pairs; saves an HF ``*ForSequenceClassification`` (``launch/rm.py``).

    L = mean over pairs of −log σ(r(x, y_w) − r(x, y_l) − m) + c · (r(x, y_w) + r(x, y_l))²

with ``r`` the model's scalar score of the whole sequence (:mod:`hybridrl.algorithms.rm_loss` has the formula, its
papers and its options; :mod:`hybridrl.megatron.reward_model` the model and where a sequence is scored).

An offline job on SFT's skeleton (:mod:`hybridrl.trainers.offline`), like DPO: the same pair data
(``hybridrl prepare preference``), the same batch layout (pair ``i``'s chosen row at ``2i``, its rejected one at
``2i + 1``, a micro-batch holding ``2 × data.micro_batch_size_per_gpu`` rows so that a pair never straddles two
micro-batches or DP ranks), every TP/PP/CP/DP layout and LoRA; no reference model. Held-out metrics every
``trainer.test_freq`` steps: ``eval/pair_accuracy``, ``eval/margin``, ``eval/loss``, ``eval/chosen``,
``eval/rejected``; ``trainer.target_accuracy`` stops the run once ``eval/pair_accuracy`` reaches it.

What a sequence is, so that the saved model scores what ``reward.name=model`` will hand it: the prompt as the dataset
renders it, the response, and then what ends a response — EOS; with ``data.apply_chat_template`` and a tokenizer
that has a chat template, the text the template puts after an assistant message (e.g. ``<|im_end|>\\n``:
:func:`hybridrl.rewards.model.assistant_turn_end`), which is how :class:`~hybridrl.rewards.model.ModelReward` renders
a scored sample. The saved config.json is the start model's with ``architectures`` = its ``*ForSequenceClassification``,
``num_labels`` = 1 and ``pad_token_id`` = the id the score's position skips (the tokenizer's pad); trained on plain
text (``data.apply_chat_template=false``), its tokenizer is saved without a chat template, so ``reward.name=model``
reads samples as plain text as well.

As in SFT and DPO there is no mid-run checkpoint or resume: the run ends with the HF checkpoint.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from hybridrl.algorithms.rm_loss import RMTerms, bradley_terry_loss
from hybridrl.batch import RolloutBatch
from hybridrl.config.rm_schema import RMAlgorithmConfig, RMConfig
from hybridrl.data.collate import PromptBatch, collate_prompts
from hybridrl.data.preference import PreferenceDataset, PreferenceDatasetConfig
from hybridrl.hf.arch import CONFIG_FILE, read_json
from hybridrl.megatron.config import MicroBatching
from hybridrl.megatron.reward_model import MegatronRewardModel
from hybridrl.metrics import DPMeans
from hybridrl.rewards.model import assistant_turn_end
from hybridrl.trainers.dpo import pair_batch
from hybridrl.trainers.offline import OfflineJob, dp_strided_passes, fit_offline

# pairs per forward-only pass of the held-out metrics
EVAL_PAIRS_PER_PASS = 128


def pair_terms(scores_B: torch.Tensor, batch: RolloutBatch, *, algo: RMAlgorithmConfig,
               margin_key: str | None) -> RMTerms:
    """The loss terms of the interleaved pairs of a ``[2N]`` batch of scores."""
    margin_N = None
    if margin_key is not None:
        margin_N = torch.tensor([float(m.extra[margin_key]) for m in batch.meta[0::2]], dtype=scores_B.dtype,
                                device=scores_B.device)
    return bradley_terry_loss(scores_B[0::2], scores_B[1::2], margin_N=margin_N,
                              center_rewards_coefficient=algo.center_rewards_coefficient)


def rm_micro_loss(scores_B: torch.Tensor, mb: RolloutBatch, normalizer: torch.Tensor, *, algo: RMAlgorithmConfig,
                  margin_key: str | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the mean loss over the mini-batch's pairs (``normalizer``: its sequence count, all
    DP ranks); metrics as ``*_sum`` shares of the same means, so they add up across micro-batches."""
    terms = pair_terms(scores_B, mb, algo=algo, margin_key=margin_key)
    pairs = normalizer / 2
    return terms.loss_N.sum() / pairs, {f"{k}_sum": v / pairs for k, v in terms.metric_sums().items()}


def sequence_classification_config(model_dir: str, *, pad_token_id: int) -> dict[str, Any]:
    """The config.json keys that make the start model's config a one-label ``*ForSequenceClassification``."""
    config = read_json(Path(model_dir) / CONFIG_FILE)
    names = [a.replace("ForCausalLM", "ForSequenceClassification") for a in config.get("architectures") or []]
    return {"architectures": [n for n in names if n.endswith("ForSequenceClassification")],
            "num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "pad_token_id": pad_token_id}


class RMJob(OfflineJob):
    """:class:`~hybridrl.trainers.offline.OfflineJob` of reward-model training."""

    name = "RM"
    target_metric = "eval/pair_accuracy"

    def __init__(self, cfg: RMConfig) -> None:
        self.cfg = cfg
        self.micro = MicroBatching(micro_batch_size=2 * cfg.data.micro_batch_size_per_gpu,  # both halves of a pair
                                   packed=cfg.megatron.use_remove_padding)
        self.loss_fn = partial(rm_micro_loss, algo=cfg.algorithm, margin_key=cfg.data.margin_key)

    def datasets(self, tokenizer: PreTrainedTokenizerBase) -> tuple[PreferenceDataset, PreferenceDataset | None]:
        d = self.cfg.data
        config = PreferenceDatasetConfig(prompt_key=d.prompt_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key,
                                         apply_chat_template=d.apply_chat_template,
                                         max_prompt_length=d.max_prompt_length, margin_key=d.margin_key)
        train = PreferenceDataset(d.train_files, tokenizer=tokenizer, config=config)
        return train, PreferenceDataset(d.val_files, tokenizer=tokenizer, config=config) if d.val_files else None

    def build(self, *, pad_token_id: int) -> MegatronRewardModel:
        from hybridrl.lora.config import LoRAConfig

        c = self.cfg
        return MegatronRewardModel(model_dir=c.model.path, megatron=c.megatron, optim=c.optim,
                                   total_steps=c.trainer.total_training_steps, pad_token_id=pad_token_id,
                                   seed=c.trainer.seed, lora=LoRAConfig.from_model(c.model, key="model"))

    def start(self, policy: MegatronRewardModel, *, tokenizer: PreTrainedTokenizerBase, pad_token_id: int,
              train: PreferenceDataset) -> str:
        self.tokenizer, self.pad_token_id = tokenizer, pad_token_id
        end = assistant_turn_end(tokenizer) if self.cfg.data.apply_chat_template else None
        self.end_ids = (list(tokenizer(end, add_special_tokens=False)["input_ids"]) if end
                        else [tokenizer.eos_token_id])
        a, d, t = self.cfg.algorithm, self.cfg.data, self.cfg.trainer
        return (f"RM (Bradley–Terry, margin={d.margin_key or 'none'}, center_rewards_coefficient="
                f"{a.center_rewards_coefficient:g}): {len(train)} pairs, {t.total_training_steps} steps of "
                f"{d.train_batch_size} pairs; responses end with {tokenizer.decode(self.end_ids)!r}")

    def _batch(self, prompts: PromptBatch) -> RolloutBatch:
        d = self.cfg.data
        return pair_batch(prompts, self.tokenizer, rejected_key=d.rejected_key,
                          max_response_length=d.max_response_length, end_ids=self.end_ids)

    def step(self, policy: MegatronRewardModel, prompts: PromptBatch) -> dict[str, float]:
        metrics = policy.train_step(self._batch(prompts), self.loss_fn, batching=self.micro)
        return {k if "/" in k else f"rm/{k}": v for k, v in metrics.items()}

    def validate(self, policy: MegatronRewardModel, val: PreferenceDataset) -> dict[str, float]:
        """``eval/*`` over the held-out pairs, each DP rank scoring its share."""
        m = DPMeans()
        for idx, weight in dp_strided_passes(len(val), rows=EVAL_PAIRS_PER_PASS):
            batch = self._batch(collate_prompts([val[i] for i in idx], idx, pad_token_id=self.pad_token_id))
            scores_B = policy.compute_scores(batch, batching=self.micro)
            terms = pair_terms(scores_B, batch, algo=self.cfg.algorithm, margin_key=self.cfg.data.margin_key)
            for k, v in terms.metric_sums().items():
                m.add(f"eval/{k}", v * weight, len(idx) * weight)
        return m.reduce()

    def hf_config(self) -> dict[str, Any]:
        return sequence_classification_config(self.cfg.model.path, pad_token_id=self.pad_token_id)

    def keeps_chat_template(self) -> bool:
        """A reward model trained on plain text (``data.apply_chat_template=false``) is saved without a chat
        template, so that ``reward.name=model`` reads it as plain text too (it renders chat when the RM's tokenizer
        has a template)."""
        return self.cfg.data.apply_chat_template


def fit_rm(cfg: RMConfig) -> dict[str, float]:
    return fit_offline(cfg, RMJob(cfg), train_batch_size=cfg.data.train_batch_size, shuffle=cfg.data.shuffle)
