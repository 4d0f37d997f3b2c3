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

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from omegaconf import DictConfig, OmegaConf

from hybridrl.checkpoint.hashing import sha256_collective, sha256_many
from hybridrl.config.errors import CheckpointError
from hybridrl.config.schema import OptimConfig, RLConfig
from hybridrl.distributed import host_group
from hybridrl.hf.write import copy_side_files, save_hf_checkpoint
from hybridrl.lora.checkpoint import check_base, read_record, write_record
from hybridrl.megatron.checkpoint_compat import install_results_queue, install_worker_death_signal
from hybridrl.megatron.cpu import cpu_distributed_optimizer_checkpoint_metadata, init_distributed_optimizer_state
from hybridrl.megatron.lora import is_lora_name
from hybridrl.megatron.model import unwrap_model
from hybridrl.megatron.policy import MegatronPolicy
from hybridrl.megatron.runner import MegatronRunner
from hybridrl.tracking import say

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
LATEST = "latest"
_SCRATCH = (".tmp_step_*", ".old_step_*", ".deleting_step_*")  # left by a crash; removed at the next save


def checkpoint_root(cfg: RLConfig) -> Path:
    return Path(cfg.trainer.output_dir) / "checkpoints"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The ``step_<k>`` directories under ``root`` (complete or not: see :func:`checkpoint_problem`), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


# --- completeness -------------------------------------------------------------------------------


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (None: it is): no manifest, or a file missing, of another
    size or another SHA-256 than the manifest says (every file is hashed, in parallel: :mod:`.hashing`; a manifest
    of an older hybridrl has them for files up to 8 MiB only)."""
    if not path.is_dir():
        return "no such directory"
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        entries = [(rel, int(e["bytes"]), e.get("sha256")) for rel, e in files.items()]
    except FileNotFoundError:
        return f"no {MANIFEST}: its save did not finish, or a hybridrl without manifests wrote it"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for rel, size, _ in entries:
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, {MANIFEST} says {size}"
    hashed = [(rel, sha) for rel, _, sha in entries if sha is not None]
    found = sha256_many([path / rel for rel, _ in hashed])
    for rel, sha in hashed:
        if found[path / rel] != sha:
            return f"{rel} does not match its SHA-256 in {MANIFEST}"
    return None


def _read_latest(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return name if _STEP_DIR.match(name) else None


def latest_complete(root: Path) -> Path | None:
    """The checkpoint ``resume=auto`` takes: the committed one (``latest``; without it the newest), or the
    next older complete one, with a warning for each skipped; None when ``root`` holds no checkpoint. Checkpoints
    none of which is usable are a :class:`CheckpointError` naming each (nothing is moved or deleted)."""
    dirs = present = step_dirs(root)
    pointer = _read_latest(root)
    skipped: list[tuple[Path, str]] = []
    if pointer is not None:
        committed = int(pointer.removeprefix("step_"))
        skipped += [(p, f"newer than {LATEST} ({pointer}): never committed") for s, p in dirs if s > committed]
        if not (root / pointer).is_dir():
            skipped.append((root / pointer, f"named by {LATEST}, and missing"))
        dirs = [(s, p) for s, p in dirs if s <= committed]
    for _, path in reversed(dirs):
        problem = checkpoint_problem(path)
        if problem is None:
            for p, why in skipped:
                say(f"warning: not resuming from {p}: {why}; falling back to {path.name}")
            return path
        skipped.append((path, problem))
    if not present:  # nothing to resume (a `latest` whose checkpoint was deleted: said, then removed at start)
        for p, why in skipped:
            say(f"warning: not resuming from {p}: {why}; starting at step 0")
        return None
    raise CheckpointError(
        f"trainer.resume=auto: no checkpoint in {root} can be resumed: "
        + "; ".join(f"{p.name}: {why}" for p, why in skipped)
        + ". Nothing was changed. To start over from step 0 set trainer.resume=never (they are then moved aside into "
          f"{root.name}/abandoned-<time>/, not deleted), or resume one by its path: trainer.resume=<its dir>")


def resolve_resume(cfg: RLConfig) -> Path | None:
    """``trainer.resume``: ``never`` → None; ``auto`` → :func:`latest_complete` (or None); else a path,
    which must be a complete checkpoint."""
    mode = cfg.trainer.resume
    if mode == "never":
        return None
    if mode == "auto":
        return latest_complete(checkpoint_root(cfg))
    path = Path(mode)
    if (problem := checkpoint_problem(path)) is not None:
        raise FileNotFoundError(f"trainer.resume={mode!r}: {path} is not a complete hybridrl checkpoint "
                                f"({problem}); valid: auto, never, or a checkpoints/step_<k> dir")
    return path


def resume_point(cfg: RLConfig) -> Path | None:
    """Collective, at start: ``trainer.resume`` resolved once (rank 0), and the checkpoints in
    ``trainer.output_dir`` that are not this run's history moved aside (:func:`set_aside_other_histories`)."""
    box: list[Any] = [None, None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            path = resolve_resume(cfg)
            set_aside_other_histories(checkpoint_root(cfg), resumed=path)
            box = [None if path is None else str(path), None]
        except (OSError, ValueError) as e:
            error, box = e, [None, (isinstance(e, CheckpointError), str(e))]
    dist.broadcast_object_list(box, src=0, group=host_group.get())
    if error is not None:
        raise error
    if box[1] is not None:
        user, message = box[1]
        raise CheckpointError(message) if user else RuntimeError(f"rank 0: {message}")
    return None if box[0] is None else Path(box[0])


def set_aside_other_histories(root: Path, *, resumed: Path | None) -> Path | None:
    """Move every ``step_*`` under ``root`` that is not ``resumed``'s history — newer than ``resumed`` when it
    lies in ``root``, else all — into ``root/abandoned-<time>/`` (returned; None if nothing moved), and point
    ``latest`` at ``resumed`` (removed when it lies elsewhere or is None)."""
    ours = resumed is not None and resumed.resolve().parent == root.resolve() and bool(_STEP_DIR.match(resumed.name))
    upto = int(resumed.name.removeprefix("step_")) if ours and resumed is not None else -1
    stray = [p for s, p in step_dirs(root) if s > upto]
    dest = None
    if stray:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = root / f"abandoned-{stamp}"
        n = 1
        while dest.exists():
            n += 1
            dest = root / f"abandoned-{stamp}-{n}"
        dest.mkdir()
        for p in stray:
            os.rename(p, dest / p.name)
        _fsync_dir(dest)
        _fsync_dir(root)
        why = (f"newer than the resumed {resumed.name}" if ours and resumed is not None
               else "not the history of this run (trainer.resume=never)" if resumed is None
               else f"not the history of this run (it resumes {resumed})")
        say(f"moved {', '.join(p.name for p in stray)} ({why}) aside to {dest}; resume=auto follows this run "
            "from now on (delete that directory when it is no longer needed)")
    if ours and resumed is not None:
        if _read_latest(root) != resumed.name:
            _write_latest(root, resumed.name)
    else:
        (root / LATEST).unlink(missing_ok=True)
    return dest


# --- saving -------------------------------------------------------------------------------------


def _model_state(policy: MegatronRunner) -> dict[str, Any]:
    """The model's sharded state: one chunk's, or ``chunk<v>`` per model chunk under VPP.

    The nesting is only this dict's shape: on disk each tensor is stored under its Megatron key with
    global layer offsets, so a checkpoint written with any number of chunks loads with any other.
    """
    chunks = [unwrap_model(c) for c in policy.chunks]
    states = [_adapters_only(policy, c.sharded_state_dict()) for c in chunks]
    if len(chunks) == 1:
        return states[0]
    return {f"chunk{v}": state for v, state in enumerate(states)}


def _adapters_only(policy: MegatronRunner, state: dict[str, Any]) -> dict[str, Any]:
    """With LoRA only the adapters are saved (the frozen base is the model directory's, checked by hash)."""
    if not isinstance(policy, MegatronPolicy) or policy.lora is None:
        return state
    return {k: v for k, v in state.items() if is_lora_name(k)}


def _load_model_state(policy: MegatronRunner, state: dict[str, Any]) -> None:
    chunks = [unwrap_model(c) for c in policy.chunks]
    states = [state] if len(chunks) == 1 else [state[f"chunk{v}"] for v in range(len(chunks))]
    lora = isinstance(policy, MegatronPolicy) and policy.lora is not None
    for chunk, chunk_state in zip(chunks, states, strict=True):
        result = chunk.load_state_dict(chunk_state, strict=not lora)
        if lora and (result.unexpected_keys or any(is_lora_name(k) for k in result.missing_keys)):
            raise ValueError(f"the checkpoint's adapters do not fit this model: missing "
                             f"{[k for k in result.missing_keys if is_lora_name(k)][:4]}, "
                             f"unexpected {result.unexpected_keys[:4]}")


def _model_and_optimizer_state(policy: MegatronRunner, *, loading: bool) -> dict[str, Any]:
    model_sd = _model_state(policy)
    assert policy.optimizer is not None
    if loading:
        init_distributed_optimizer_state(policy.optimizer)
    # read by the distributed optimizer only; its default (fully_sharded_model_space) is deprecated
    # and dist_checkpointing no longer accepts its flattened ranges
    metadata = {"distrib_optim_sharding_type": "fully_reshardable", **cpu_distributed_optimizer_checkpoint_metadata()}
    return {"model": model_sd,
            "optimizer": policy.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=metadata)}


def _rng_state() -> dict[str, Any]:
    """Tensors and plain Python values only, so it loads with ``torch.load(weights_only=True)``."""
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    state = {"python": random.getstate(),
             "numpy": {"kind": kind, "key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(*, cfg: RLConfig, step: int, policy: MegatronPolicy, weight_version: int,
                    sampler_state: dict[str, int], model_dir: str, rollout_state: dict[str, Any] | None = None,
                    kl_ctrl_state: dict[str, float] | None = None, critic: MegatronRunner | None = None) -> Path:
    root = checkpoint_root(cfg)
    final, tmp = root / _step_name(step), root / f".tmp_{_step_name(step)}"
    rank = dist.get_rank()
    if rank == 0:
        remove_scratch(root)
        (tmp / "rng").mkdir(parents=True)
        (tmp / "megatron").mkdir()
        if critic is not None:
            (tmp / "critic").mkdir()
    dist.barrier()
    install_results_queue()  # Megatron's writer keeps a helper process: make it die with this rank
    install_worker_death_signal()  # and forks workers for each save: them too
    dist_checkpointing.save(_model_and_optimizer_state(policy, loading=False), str(tmp / "megatron"))
    if critic is not None:
        dist_checkpointing.save(_model_and_optimizer_state(critic, loading=False), str(tmp / "critic"))
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        assert policy.scheduler is not None and (critic is None or critic.scheduler is not None)
        torch.save({"step": step, "weight_version": weight_version, "scheduler": policy.scheduler.state_dict(),
                    "critic_scheduler": critic.scheduler.state_dict() if critic and critic.scheduler else None,
                    "sampler": sampler_state, "kl_ctrl": kl_ctrl_state, "rollout": rollout_state,
                    "world_size": dist.get_world_size()},
                   tmp / "trainer_state.pt")
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(asdict(cfg))))
        if policy.lora is not None:  # the base this checkpoint's adapters belong to
            write_record(tmp, cfg=policy.lora.cfg, base_model=model_dir,
                         dtype=cfg.actor_rollout_ref.actor.megatron.dtype)
    if cfg.trainer.save_hf_weights:  # collective: every rank streams, rank 0 writes
        save_hf_checkpoint(policy.export_weights(bucket_bytes=512 << 20), tmp / "hf", source_dir=model_dir,
                           key="trainer.save_hf_weights")
    elif rank == 0:
        (tmp / "hf").mkdir()
        copy_side_files(model_dir, tmp / "hf")
    dist.barrier()  # every rank's files are closed: all hash a share of them, rank 0 commits
    digests = sha256_collective(tmp, group=host_group.get())
    if rank == 0:
        commit(tmp, final, step=step, keep=cfg.trainer.max_checkpoints_to_keep, digests=digests)
    dist.barrier()
    return final


def remove_scratch(root: Path) -> None:
    """Delete what an interrupted save or commit left (``.tmp_step_*``, ``.old_step_*``, ``.deleting_step_*``)."""
    for pattern in _SCRATCH:
        for stale in root.glob(pattern) if root.is_dir() else []:
            shutil.rmtree(stale)


def commit(tmp: Path, final: Path, *, step: int, keep: int, digests: dict[str, str] | None = None) -> None:
    """Make the fully written ``tmp`` the checkpoint ``final`` (see the module docstring), then apply
    retention. Every step leaves a state that :func:`latest_complete` resolves to a complete checkpoint.
    ``digests``: the SHA-256 of files under ``tmp`` by relative path, already computed (the others are here)."""
    root = final.parent
    _write_manifest(tmp, step=step, digests=digests or {})
    old = root / f".old_{final.name}"
    if final.exists():  # a re-saved step: the old one goes only once the new one is in place
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_latest(root, final.name)
    if old.exists():
        shutil.rmtree(old)
    _prune(root, newest=step, keep=keep)


def _write_manifest(d: Path, *, step: int, digests: dict[str, str]) -> None:
    """Record every file under ``d`` (size, SHA-256), fsyncing files and directories.

    Rank 0 fsyncs every rank's files: on one node that flushes them all; on a shared file system each
    writer's data is already on the server when it closes the file (NFS close-to-open, Lustre, GPFS)."""
    files: dict[str, dict[str, Any]] = {}
    for dirpath, _, names in os.walk(d):
        for name in sorted(names):
            path = Path(dirpath) / name
            with path.open("rb") as f:
                os.fsync(f.fileno())
                files[path.relative_to(d).as_posix()] = {"bytes": os.fstat(f.fileno()).st_size}
        _fsync_dir(Path(dirpath))
    missing = [d / rel for rel in files if rel not in digests]
    digests = digests | {p.relative_to(d).as_posix(): h for p, h in sha256_many(missing).items()}
    for rel, entry in files.items():
        entry["sha256"] = digests[rel]
    with (d / MANIFEST).open("w") as f:
        json.dump({"format": 1, "step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(d)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    with tmp.open("w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, *, newest: int, keep: int) -> None:
    """Keep ``keep`` checkpoints counting ``newest``: delete complete ones older than it beyond that; never a
    newer or an incomplete one (``keep`` 0 keeps all)."""
    if keep <= 0:
        return
    older = [p for s, p in step_dirs(root) if s < newest and checkpoint_problem(p) is None]
    for path in older[:max(len(older) - (keep - 1), 0)]:
        doomed = root / f".deleting_{path.name}"
        os.rename(path, doomed)  # never a half-deleted step_* on disk
        shutil.rmtree(doomed)


# --- loading ------------------------------------------------------------------------------------


def _restore(model: MegatronRunner, directory: Path, scheduler_state: dict[str, Any]) -> int:
    """Load ``model``'s weights and optimizer state from ``directory`` and its scheduler's position, keeping this
    run's optimizer settings and schedule shape; return the saved LR decay length."""
    assert model.optimizer is not None and model.scheduler is not None
    configured = [{k: v for k, v in g.items() if k != "params"} for g in model.optimizer.param_groups]
    loaded = dist_checkpointing.load(_model_and_optimizer_state(model, loading=True), str(directory))
    _load_model_state(model, loaded["model"])
    model.optimizer.load_state_dict(loaded["optimizer"])
    for group, settings in zip(model.optimizer.param_groups, configured, strict=True):
        group.update(settings)  # the loaded groups carry the saved max_lr, betas, eps, …: this run's win
    scheduler = model.scheduler
    # Megatron's semantics: the schedule's shape from the config, only its position from the checkpoint
    scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler = True, False
    scheduler.load_state_dict(scheduler_state)
    return int(scheduler_state["lr_decay_steps"])


def _check_optimizer_kind(path: Path, policy: MegatronPolicy) -> None:
    """Megatron's distributed and plain optimizers save their state in different formats (0.16.1 fails
    deep in ``load_state_dict`` with ``KeyError: 'pre_wd_mult'``): name the key to keep instead."""
    key = "actor_rollout_ref.actor.megatron.use_distributed_optimizer"
    saved = bool(OmegaConf.select(OmegaConf.load(path / "config.yaml"), key))
    chained = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    now = any(isinstance(o, DistributedOptimizer) for o in chained)
    if saved != now:
        was, setting = str(saved).lower(), str(now).lower()  # as written in the config
        raise ValueError(f"{key}={setting}: {path} was saved with {key}={was}, whose optimizer state the other "
                         f"optimizer can't load; resume with {key}={was}")


def _check_expert_layout(path: Path, policy: MegatronPolicy) -> None:
    """An MoE model's optimizer is a chain of two (dense and expert parameters) at every EP (``moe_compat`` item 2),
    so its checkpoints reshard between any EP layouts. Checkpoints saved at EP = 1 before that hold one optimizer,
    which the chain can't load (a ``KeyError`` deep in dist_checkpointing): name the way out instead."""
    chained = len(getattr(policy.optimizer, "chained_optimizers", ())) > 1  # not with LoRA: frozen experts
    if policy.arch.moe is None or not chained:
        return
    common = dist_checkpointing.load_common_state_dict(str(path / "megatron"))
    if 0 not in common["optimizer"]:  # ChainedOptimizer.sharded_state_dict: one entry per optimizer, keys 0, 1
        key = "actor_rollout_ref.actor.megatron.expert_model_parallel_size"
        raise ValueError(f"{path} holds an MoE model's optimizer state as one optimizer (an EP = 1 checkpoint of "
                         f"hybridrl before experts had their own optimizer at every {key}), which this version "
                         f"can't load; start a new run from its weights (hybridrl export-hf {path} DIR, then "
                         "actor_rollout_ref.model.path=DIR, trainer.resume=never)")


_OPTIM = "actor_rollout_ref.actor.optim"
# the settings resume compares; every one is applied from the saved step except those in _FIXED
RESUME_SETTINGS = (*(f"{_OPTIM}.{f.name}" for f in fields(OptimConfig)), "trainer.total_training_steps")
_FIXED = {f"{_OPTIM}.optimizer": "its saved state (e.g. Adam's moments) does not fit another optimizer"}


def changed_settings(saved: DictConfig, cfg: RLConfig, *, path: Path) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, this run's value)`` for each of :data:`RESUME_SETTINGS` that differs between the
    checkpoint's config and ``cfg``; raises ``ValueError`` naming a key that can't change on resume."""
    now = OmegaConf.create(asdict(cfg))
    changes = [(k, OmegaConf.select(saved, k), OmegaConf.select(now, k)) for k in RESUME_SETTINGS]
    changes = [(k, old, new) for k, old, new in changes if old != new]
    for key, old, new in changes:
        if key in _FIXED:
            raise ValueError(f"{key}={new}: {path} was saved with {key}={old} and {_FIXED[key]}; resume with "
                             f"{key}={old}, or start a new run (trainer.resume=never)")
    return changes


def load_checkpoint(path: Path, *, cfg: RLConfig, policy: MegatronPolicy,
                    critic: MegatronRunner | None = None) -> dict[str, Any]:
    """Restore model, optimizer state, the scheduler's position (the actor's, and the critic's when given) and
    this rank's RNG; return the trainer state.

    Optimizer and LR-schedule *settings* are this run's (``cfg``), applied from the saved step: the
    checkpoint's param groups (lr, betas, eps, …) and schedule are replaced by the configured ones."""
    _check_optimizer_kind(path, policy)
    _check_expert_layout(path, policy)
    check_base(path, read_record(path), lora=None if policy.lora is None else policy.lora.cfg,
               base_model=cfg.actor_rollout_ref.model.path)
    changes = changed_settings(OmegaConf.load(path / "config.yaml"), cfg, path=path)  # type: ignore[arg-type]
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    saved_decay = _restore(policy, path / "megatron", state["scheduler"])
    assert policy.optimizer is not None and policy.scheduler is not None
    scheduler = policy.scheduler
    if changes or saved_decay != scheduler.lr_decay_steps:
        shown = "; ".join(f"{k}: {old} → {new}" for k, old, new in changes)
        say(f"resume from {path}: changed settings applied from optimizer step {scheduler.num_steps}: {shown}"
            f"{'; ' if shown else ''}LR decay over {scheduler.lr_decay_steps} optimizer steps (saved: {saved_decay}); "
            f"the learning rate is now {policy.optimizer.param_groups[0]['lr']:.4g}")
    if critic is not None:
        if state.get("critic_scheduler") is None:
            raise ValueError(f"{path} was saved without a critic; resume it with the critic off, or start a new run "
                             "(trainer.resume=never)")
        _restore(critic, path / "critic", state["critic_scheduler"])  # critic.optim.* settings: this run's too
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if state["world_size"] == dist.get_world_size() and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return state
