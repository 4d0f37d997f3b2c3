"""Running the reward manager so that it cannot take the trainer down: time limits, error policy, workers, overlap.

``RewardRunner`` (built from ``reward.*``) runs the chosen reward manager, per rank, on that rank's samples::

    pending = runner.submit(batch)   # starts scoring
    ...                              # old / ref log-probs meanwhile, where the reward allows it
    scored = pending.result()        # Scored(output, errors): scores_B checked, one float per sample

- **Where it runs** (``reward.num_workers``): 0 — a thread of the trainer process (``thread.py``); N > 0 — N
  spawned worker processes, each building the plugin once and scoring a contiguous shard (``pool.py``).
- **Time limit** (``reward.timeout_s``): each pass over a batch must finish within it. A worker past it is
  killed and replaced; a thread cannot be stopped, so in thread mode a timeout always stops the run (with a
  hint to use workers). With workers, timed-out samples follow ``reward.on_error`` like any other failure.
- **Errors** (``reward.on_error``): ``raise`` stops the run with a ``RewardError`` naming the plugin, the
  sample (where known) and the original traceback. ``zero`` keeps going: the part of the batch whose call
  failed (raised, timed out in a worker, or crashed its worker) is **re-scored one sample at a time** — a batch
  call cannot say which sample broke it — in a second pass under the same time limit. Samples whose own call
  fails score 0.0 (``correct`` False), and so do samples queued behind a hung or crashed one in the same worker;
  they are counted (``reward/errors``, summed over DP ranks) and one warning line per call names the plugin,
  the samples and the errors. Samples re-scored alone get their single-sample score, which differs from the
  batch score only for a reward that compares samples within a call. Validation keeps a rank's worst-case
  wait (``max_wait_s``) below ``trainer.dist_timeout_s``.
- **Not errors of a sample**, whatever ``on_error``: an output of the wrong shape or type (the plugin is
  broken; ``guards.check_reward_scores``), a plugin that cannot be built in a worker, a worker that dies while
  starting. Non-finite scores pass through: the step guard skips the step (``guards.py``).
- **Overlap** (``overlaps_compute``): an optional ``ClassVar[bool]`` on the reward class. True: the reward may
  score while the trainer computes log-probs — it is thread-safe against the trainer and uses neither
  ``torch.distributed`` nor accelerator memory the trainer needs. Absent: False (``submit`` scores before it
  returns), the safe default for a plugin written before the flag existed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.guards import RewardContractError, check_reward_scores
from hybridrl.interfaces import RewardOutput, Scored
from hybridrl.registry import PluginError, PluginLoadError, Registry
from hybridrl.rewards.overlong import OverlongBufferConfig, overlong_penalty_B
from hybridrl.rewards.pool import PluginSpec, WorkerPool, start_timeout_s
from hybridrl.rewards.scoring import Failure, Part, RewardError, RewardTimeoutError
from hybridrl.rewards.thread import InThread

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ON_ERROR = ("raise", "zero")
OVERLAP_FLAG = "overlaps_compute"


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    name: str = "arithmetic"  # reward manager plugin (group hybridrl.reward_managers)
    # one scoring pass over a rank's batch (null: no limit); past it a worker is killed, a thread abandoned and the
    # run stopped (the module docstring)
    timeout_s: float | None = 600.0
    # one of ON_ERROR, for a reward call that raises, times out in a worker or crashes it: raise = stop the run naming
    # the plugin, the sample and the traceback; zero = re-score that part one sample at a time, failing samples score
    # 0.0 and are counted in reward/errors
    on_error: str = "raise"
    # 0: score in a thread of the trainer process; N > 0: in N spawned worker processes (killable; the plugin is
    # rebuilt in each from reward.name, reward.kwargs and the tokenizer path)
    num_workers: int = 0
    kwargs: dict[str, Any] = field(default_factory=dict)  # the reward plugin's Config
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO length penalty


class Job(Protocol):
    def wait(self) -> list[Part]: ...


class Backend(Protocol):
    kills_on_timeout: bool

    def start(self, batch: RolloutBatch, indices: list[int], *, each: bool) -> Job: ...

    def close(self) -> None: ...


class RewardRunner:
    def __init__(self, backend: Backend, *, name: str, on_error: str, timeout_s: float | None,
                 overlaps: bool, overlong: OverlongBufferConfig | None = None, max_response_length: int = 0) -> None:
        self.backend, self.on_error, self.timeout_s, self.overlaps = backend, on_error, timeout_s, overlaps
        self.name, self.what = name, f"reward.name={name!r}"
        self.overlong, self.max_response_length = overlong or OverlongBufferConfig(), max_response_length

    @classmethod
    def build(cls, cfg: RewardConfig, *, tokenizer: PreTrainedTokenizerBase, tokenizer_path: str,
              max_response_length: int = 0, **ctx: Any) -> RewardRunner:
        """The runner of ``reward.*``: the plugin built here (thread mode) or in each worker, with ctx ``tokenizer``
        (a worker reloads it from ``tokenizer_path``) and ``ctx`` (pickled to the workers); ``max_response_length``
        (``data.max_response_length``): where ``reward.overlong_buffer``'s penalty reaches its full size."""
        registry, what = Registry("reward_managers"), f"reward.name={cfg.name!r}"
        overlaps = overlaps_compute(registry.load(cfg.name, key="reward.name"), cfg.name)
        backend: Backend
        if cfg.num_workers:
            spec = PluginSpec(name=cfg.name, kwargs=dict(cfg.kwargs), tokenizer_path=tokenizer_path, ctx=ctx)
            backend = WorkerPool(spec, num_workers=cfg.num_workers, timeout_s=cfg.timeout_s, what=what)
        else:
            manager = registry.build(cfg.name, cfg.kwargs, key="reward.kwargs", tokenizer=tokenizer, **ctx)
            backend = InThread(manager, timeout_s=cfg.timeout_s)
        return cls(backend, name=cfg.name, on_error=cfg.on_error, timeout_s=cfg.timeout_s, overlaps=overlaps,
                   overlong=cfg.overlong_buffer, max_response_length=max_response_length)

    def submit(self, batch: RolloutBatch) -> PendingReward:
        """Start scoring ``batch``; it runs on while the caller computes, if the reward allows it (else done here)."""
        pending = PendingReward(self, batch, self.backend.start(batch, list(range(len(batch))), each=False))
        if not self.overlaps:
            pending.result()
        return pending

    def score(self, batch: RolloutBatch) -> Scored:
        return self.submit(batch).result()

    def training_scores(self, batch: RolloutBatch, pending: PendingReward) -> tuple[torch.Tensor, int]:
        """A training step's ``[B]`` sequence scores: the reward's plus DAPO's overlong penalty
        (``reward.overlong_buffer``, :mod:`hybridrl.rewards.overlong`; evaluation scores go without it); and how
        many samples failed to score (0.0 each under ``reward.on_error=zero``)."""
        scored = pending.result()
        penalty_B = overlong_penalty_B(self.overlong, batch.response_mask, max_length=self.max_response_length)
        return scored.output.scores_B + penalty_B.to(scored.output.scores_B.device), scored.errors

    @staticmethod
    def empty() -> Scored:
        """The scores of a batch without samples (a rank whose share of a round is empty)."""
        return Scored(output=RewardOutput(scores_B=torch.zeros(0), correct_B=None), errors=0)

    def close(self) -> None:
        self.backend.close()

    def _finish(self, batch: RolloutBatch, job: Job) -> Scored:
        parts = self._checked(job.wait())
        failed = [i for p in parts if p.failure is not None for i in p.indices]
        if failed:
            if self.on_error == "raise":
                raise self._error(next(p.failure for p in parts if p.failure is not None), batch)
            self._raise_if_unrecoverable(parts, batch)
            parts = [p for p in parts if p.failure is None] + self._checked(
                self.backend.start(batch, failed, each=True).wait())
            self._raise_if_unrecoverable(parts, batch)
        failures = [p.failure for p in parts if p.failure is not None]
        errors = sum(len(p.indices) for p in parts if p.failure is not None)
        if failures:
            warn(f"{self.what}: {errors} of {len(batch)} samples failed and score 0.0 (reward.on_error=zero; "
                 f"counted in reward/errors): " + _describe(failures, batch))
        env_failed = sum(m.env_error is not None for m in batch.meta)
        return Scored(output=with_env_rewards(merge(parts, batch), batch), errors=errors + env_failed)

    def _checked(self, parts: list[Part]) -> list[Part]:
        """``parts``, every output checked against the reward contract (a broken plugin stops the run)."""
        for p in parts:
            if p.output is not None:
                p.output.scores_B = check_reward_scores(p.output.scores_B, batch_size=len(p.indices), reward=self.name)
                correct = p.output.correct_B
                if correct is not None and tuple(correct.shape) != (len(p.indices),):
                    raise RewardContractError(f"{self.what} returned correct_B of shape {tuple(correct.shape)}; "
                                              f"expected ({len(p.indices)},)")
        return parts

    def _raise_if_unrecoverable(self, parts: list[Part], batch: RolloutBatch) -> None:
        if not self.backend.kills_on_timeout:
            stuck = next((p.failure for p in parts if p.failure is not None and p.failure.kind == "timeout"), None)
            if stuck is not None:
                raise self._error(stuck, batch)

    def _error(self, f: Failure, batch: RolloutBatch) -> RewardError:
        where = (f" on sample {_sample(f.sample, batch)} of this rank's {len(batch)}" if f.sample is not None
                 else "; the sample is not known (reward.on_error=zero re-scores one sample at a time and names it)")
        if f.kind == "timeout":
            hint = ("; the reward is stuck or too slow (raise reward.timeout_s, or null for no limit)" if
                    self.backend.kills_on_timeout else
                    "; the reward is stuck or too slow (raise reward.timeout_s, or null for no limit). A thread "
                    "cannot be stopped: reward.num_workers > 0 scores in worker processes that are killed at the "
                    "limit (then reward.on_error=zero scores timed-out samples 0 and goes on)")
            return RewardTimeoutError(f"{self.what}: scoring one batch took longer than {self.timeout_s} s{hint}")
        head = f"{self.what} raised {f.summary}" if f.kind == "raised" else f"{self.what}: {f.summary}"
        tail = f"\n\nOriginal traceback:\n{f.traceback}" if f.traceback else ""
        return RewardError(f"{head}{where}. reward.on_error=zero would score failing samples 0.0 and go on.{tail}")


class PendingReward:
    """Scores on their way; ``result()`` waits (each pass within ``reward.timeout_s``) and applies on_error."""

    def __init__(self, runner: RewardRunner, batch: RolloutBatch, job: Job) -> None:
        self._runner, self._batch, self._job = runner, batch, job
        self._scored: Scored | None = None

    @classmethod
    def finished(cls, scored: Scored) -> PendingReward:
        """Scores already in hand (dynamic sampling scores each round before it keeps groups)."""
        pending = cls.__new__(cls)
        pending._scored = scored
        return pending

    def result(self) -> Scored:
        if self._scored is None:
            self._scored = self._runner._finish(self._batch, self._job)
        return self._scored


def merge(parts: list[Part], batch: RolloutBatch) -> RewardOutput:
    """One output for the batch from its parts; failed samples score 0.0, are not correct, have no info."""
    b = len(batch)
    done = [p for p in parts if p.output is not None]
    if len(done) == 1 and len(parts) == 1 and parts[0].indices == list(range(b)):
        return done[0].output  # type: ignore[return-value]
    device = batch.response_ids.device
    scores_B = torch.zeros(b, dtype=torch.float32, device=device)
    with_correct = bool(done) and all(p.output.correct_B is not None for p in done)  # type: ignore[union-attr]
    correct_B = torch.zeros(b, dtype=torch.bool, device=device) if with_correct else None
    info: dict[str, list[object]] = {}
    for p in done:
        out, idx = p.output, torch.tensor(p.indices, device=device)
        assert out is not None
        scores_B[idx] = out.scores_B.to(device)
        if correct_B is not None:
            assert out.correct_B is not None
            correct_B[idx] = out.correct_B.to(device=device, dtype=torch.bool)
        for key, values in out.info.items():
            if len(values) != len(p.indices):
                raise RewardContractError(f"reward info[{key!r}] has {len(values)} entries for {len(p.indices)} "
                                          f"samples; expected one per sample")
            column = info.setdefault(key, [None] * b)
            for i, v in zip(p.indices, values, strict=True):
                column[i] = v
    return RewardOutput(scores_B=scores_B, correct_B=correct_B, info=info)


def with_env_rewards(out: RewardOutput, batch: RolloutBatch) -> RewardOutput:
    """``out`` with each sample's environment rewards (``SampleMeta.env_reward``, Σ over its episode) added to its
    score: a multi-turn sample scores reward.name's score + its environment's (reward ``environment`` scores 0, so
    the environment's rewards alone). A sample whose environment failed (``env_error``; reward.on_error=zero)
    scores 0.0 and is not correct."""
    if all(m.env_reward is None and m.env_error is None for m in batch.meta):
        return out
    kw = dict(dtype=out.scores_B.dtype, device=out.scores_B.device)
    env_B = torch.tensor([m.env_reward or 0.0 for m in batch.meta], **kw)  # type: ignore[arg-type]
    ok_B = torch.tensor([m.env_error is None for m in batch.meta], device=out.scores_B.device)
    correct_B = None if out.correct_B is None else out.correct_B & ok_B.to(out.correct_B.device)
    return dataclasses.replace(out, scores_B=(out.scores_B + env_B) * ok_B, correct_B=correct_B)


def overlaps_compute(cls: type, name: str) -> bool:
    """The reward class's optional ``overlaps_compute`` flag (absent: False)."""
    flag = getattr(cls, OVERLAP_FLAG, False)
    if not isinstance(flag, bool):
        raise PluginLoadError(f"reward_managers plugin {name!r}: `{OVERLAP_FLAG}` is {flag!r}; it must be a bool "
                              f"(True: may score while the trainer computes log-probs) or absent (False)")
    return flag


def max_wait_s(cfg: RewardConfig) -> float | None:
    """The longest a rank may wait for one batch's scores: the pass and, under on_error=zero, the re-scoring
    pass; with workers, a (replacement) worker start before each. None: no limit."""
    if cfg.timeout_s is None:
        return None
    passes = 2 if cfg.on_error == "zero" else 1
    start = start_timeout_s(cfg.timeout_s) if cfg.num_workers > 0 else 0.0
    return passes * (cfg.timeout_s + (start or 0.0))


def config_problems(cfg: RewardConfig, *, dist_timeout_s: float) -> list[tuple[str, object, str]]:
    """``(key, value, message)`` for every problem of ``reward.*`` that the runner owns."""
    out: list[tuple[str, object, str]] = []
    if cfg.on_error not in ON_ERROR:
        out.append(("reward.on_error", cfg.on_error, f"valid: {', '.join(ON_ERROR)}"))
    if cfg.num_workers < 0:
        out.append(("reward.num_workers", cfg.num_workers,
                    "must be ≥ 0 (0: score in a thread of the trainer process; N: in N worker processes)"))
    try:
        overlaps_compute(Registry("reward_managers").load(cfg.name, key="reward.name"), cfg.name)
    except PluginError as e:
        if isinstance(e, PluginLoadError) and OVERLAP_FLAG in str(e):
            out.append(("reward.name", cfg.name, str(e)))  # (a missing plugin is reported with the plugins)
    t, worst = cfg.timeout_s, max_wait_s(cfg)
    if t is not None and worst is not None and 0 < t < dist_timeout_s <= worst:
        out.append(("reward.timeout_s", t,
                    f"a rank may wait up to {worst:g} s for one batch's scores (reward.on_error={cfg.on_error}: "
                    f"{2 if cfg.on_error == 'zero' else 1} pass(es) of reward.timeout_s"
                    + (f", each after a worker start of up to {start_timeout_s(t):g} s" if cfg.num_workers else "")
                    + f") while the other ranks wait in a collective: keep that below trainer.dist_timeout_s="
                    f"{dist_timeout_s:g} (lower reward.timeout_s or raise trainer.dist_timeout_s)"))
    return out


def warn(message: str) -> None:
    """A warning line on stderr from any rank (``tracking.say`` speaks for rank 0 only)."""
    print(f"[hybridrl] WARNING rank {os.environ.get('RANK', '0')}: {message}", file=sys.stderr, flush=True)


def _sample(i: int, batch: RolloutBatch) -> str:
    return f"{i} (dataset row {int(batch.group_index[i])})"


def _describe(failures: list[Failure], batch: RolloutBatch, limit: int = 3) -> str:
    shown = [f"sample {_sample(f.sample, batch)}: {f.summary}" if f.sample is not None else f.summary
             for f in failures[:limit]]
    return "; ".join(shown) + (" …" if len(failures) > limit else "")
