"""Save and resume an RL run: atomic, reshardable checkpoints that a crash never leaves half-trusted.

Layout of ``<trainer.output_dir>/checkpoints/``:
- ``step_<k>/megatron/``: actor model + optimizer in Megatron's ``dist_checkpointing`` format (every rank
  writes its shards in parallel; loading at another TP/PP/VPP/DP layout reshards; the vocab rows are
  saved with Megatron's ``allow_shape_mismatch`` so a TP-dependent vocab padding does not matter). The
  distributed optimizer's state is saved in Megatron's ``fully_reshardable`` format: per parameter, in
  model space, like the plain optimizer's, so it loads at any DP size;
- ``step_<k>/critic/``: with a critic, its model + optimizer, the same way;
- ``step_<k>/lora.json``: with LoRA (``model.lora_rank`` > 0), whose ``megatron/`` then holds only the adapters
  and their optimizer state: the base model's path and SHA-256 (resuming onto another base is an error) and
  the LoRA settings (:mod:`hybridrl.lora.checkpoint`);
- ``step_<k>/trainer_state.pt``: step, weight version, LR scheduler positions (actor, critic), data-sampler
  position, KL-controller β;
- ``step_<k>/rng/rank_<r>.pt``: each rank's Python/NumPy/torch(/CUDA)/Megatron-tracker RNG states;
- ``step_<k>/hf/``: config.json, generation config and tokenizer of the model (``export-hf`` needs nothing
  else), plus the actor's full weights as safetensors when ``trainer.save_hf_weights``;
- ``step_<k>/config.yaml``: the resolved run config (resume compares its optimizer settings);
- ``step_<k>/manifest.json``: every file's size (and SHA-256 of the small ones), written last;
- ``latest``: the name of the newest committed checkpoint, written after it is in place;
- ``abandoned-<time>/``: checkpoints that are not this run's history, moved aside (see below).

Commit protocol (rank 0, after every rank has written): manifest → fsync of every file and directory →
rename ``.tmp_step_<k>`` to ``step_<k>`` (a re-saved step: the old one is renamed aside first and removed
only after the new one is in) → fsync of ``checkpoints/`` → ``latest`` (written to a temporary file,
fsynced, renamed) → retention. A SIGKILL at any moment leaves the previous committed checkpoint intact.

``resume=auto`` takes the checkpoint ``latest`` names (without ``latest``: the newest ``step_*``); if its
manifest does not match its files it warns and falls back to the next older complete one. A ``step_*``
newer than ``latest`` was never committed and is not used. When checkpoints are there and none is usable the run
stops, naming each and why (``trainer.resume=never`` starts over; nothing is moved or deleted before that).
Only complete checkpoints are trusted; loading reads pickles (``torch.load(weights_only=True)`` here, Megatron's
own metadata upstream), so a checkpoint directory is trusted input.

History: at start, checkpoints that are not the resumed run's history — those newer than the resumed
step, or all of them with ``resume=never`` or a resume from another directory — are moved (never
deleted) into ``checkpoints/abandoned-<time>/``, so ``resume=auto`` afterwards follows the new line.
Retention (``trainer.max_checkpoints_to_keep``) deletes only complete checkpoints older than the one
just committed.

Changed settings on resume: the optimizer and LR-schedule settings always come from this run's config
(Megatron's ``override_opt_param_scheduler``): a changed ``actor_rollout_ref.actor.optim.*`` value or
``trainer.total_training_steps`` (the LR decay length) is applied from the saved step and logged; a
changed ``optim.optimizer`` (and ``megatron.use_distributed_optimizer``), whose saved state the other
optimizer can't take, is an error naming the key.
"""

from hybridrl.checkpoint.layout import (
    LATEST,
    MANIFEST,
    checkpoint_problem,
    checkpoint_root,
    commit,
    remove_scratch,
    step_dirs,
)
from hybridrl.checkpoint.load import RESUME_SETTINGS, changed_settings, load_checkpoint
from hybridrl.checkpoint.load import _check_expert_layout as _check_expert_layout
from hybridrl.checkpoint.load import _restore as _restore
from hybridrl.checkpoint.resume import latest_complete, resolve_resume, resume_point, set_aside_other_histories
from hybridrl.checkpoint.save import save_checkpoint
from hybridrl.checkpoint.state import _model_and_optimizer_state as _model_and_optimizer_state
from hybridrl.checkpoint.state import _rng_state as _rng_state
from hybridrl.checkpoint.state import _set_rng_state as _set_rng_state

# the public names; the underscored ones above are re-exported for the tests that reach them through this module
__all__ = [
    "LATEST",
    "MANIFEST",
    "RESUME_SETTINGS",
    "changed_settings",
    "checkpoint_problem",
    "checkpoint_root",
    "commit",
    "latest_complete",
    "load_checkpoint",
    "remove_scratch",
    "resolve_resume",
    "resume_point",
    "save_checkpoint",
    "set_aside_other_histories",
    "step_dirs",
]
