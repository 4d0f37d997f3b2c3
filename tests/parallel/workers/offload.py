"""Worker: memory phases (``hybridrl.megatron.offload``) — RL steps with every offload key on vs off, and
offload → reload round trips of a trained actor.

    python -m torch.distributed.run --nproc-per-node N offload.py MODEL_DIR OUT_DIR RUN [RUN ...]

A run is one of ``rl_step.py``'s layout names, optionally ``.<dtype>`` (``megatron.dtype``, e.g.
``tp1pp1cp1-distopt.bfloat16``); Adam, ``token-mean``, ``rl_step.py``'s config and fixed batch. Each run
builds :class:`ActorRolloutRef` twice in turn, with every offload key off and with all on (actor
``param_offload``, ``grad_offload``, ``optimizer_offload``, ref ``param_offload``), and runs two RL steps
through the trainer's phases: ``generate`` (4 prompts, 2 tokens each; the samples are dropped: the batch
is fixed), old and ref log-probs, ``update_actor``, ``sync_weights``. The second step's ``generate``
offloads a trained actor (its gradients and Adam state exist), so the second update shows that the
state came back exactly. With offload on, it also records which storages were freed while offloaded and
the bytes each phase moved. Then, on the trained actor, an explicit offload → reload of everything:
parameters, ``main_grad``\\ s and optimizer state (moments, steps, fp32 main params) before and after.

Each rank saves ``OUT_DIR/<run>-rank<r>.pt``: ``off`` / ``on`` (per RL step: old/ref log-probs, entropy,
optimizer-step metrics, HF weights after the step), ``freed`` (what was checked to have storage size 0),
``phases`` (bytes moved per phase), ``round_trip`` (checks and bytes).
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from rl_step import N, config, fixed_batch, parse_layout

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.config.plan import Plan
from hybridrl.data.collate import PromptBatch
from hybridrl.hybrid import ActorRolloutRef
from hybridrl.interfaces import SamplingParams
from hybridrl.megatron.offload import PolicyOffload
from hybridrl.megatron.parallel import init_parallel, seed_everything
from hybridrl.megatron.policy import MegatronPolicy
from hybridrl.rollout.workers import EngineWorkers, build_engines
from hybridrl.trainers.components import actor_objective

torch.set_num_threads(1)

RL_STEPS = 2
GEN = SamplingParams(temperature=1.0, max_new_tokens=2, n=1)


def prompts_of(full: RolloutBatch) -> PromptBatch:
    """The fixed batch's prompts (its samples come in groups of ``N`` per prompt)."""
    rows, n = slice(None, None, N), len(full) // N
    return PromptBatch(input_ids=full.prompt_ids[rows], attention_mask=full.prompt_mask[rows],
                       index=torch.arange(n), meta=[SampleMeta() for _ in range(n)], pad_token_id=full.pad_token_id)


def state_tensors(policy: MegatronPolicy) -> dict[str, list[torch.Tensor]]:
    """What offload must move, enumerated from Megatron's side: parameters, DDP buffers and main_grads,
    the torch optimizers' parameters (fp32 main params, or the model's own / views of them) and state."""
    params = list(policy.parameters())
    out: dict[str, list[torch.Tensor]] = {
        "params": params, "buffers": [], "optimizer_params": [], "optimizer_state": [],
        "main_grads": [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]}
    for chunk in policy.chunks:
        if isinstance(chunk, DistributedDataParallel):
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                out["buffers"] += [t for t in (buffer.param_data, buffer.grad_data) if t is not None]
    if policy.optimizer is not None:
        for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
            out["optimizer_params"] += [q for g in opt.optimizer.param_groups for q in g["params"]]
            out["optimizer_state"] += [v for s in opt.optimizer.state.values() for v in s.values()
                                       if isinstance(v, torch.Tensor)]
    return out


def all_freed(tensors: list[torch.Tensor]) -> bool:
    return bool(tensors) and all(t.untyped_storage().size() == 0 for t in tensors)


def none_freed(tensors: list[torch.Tensor]) -> bool:
    return all(t.untyped_storage().size() > 0 for t in tensors)


def expected_bytes(policy: MegatronPolicy) -> dict[str, int]:
    """The bytes offload should move, from Megatron's buffers: the param buffers (the distributed optimizer)
    or each parameter; the grad buffers; the optimizer's state and the main params it keeps apart."""
    buffers = [b for c in policy.chunks for b in c.buffers + c.expert_parallel_buffers]
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    param_buffers = [b.param_data for b in buffers if b.param_data is not None]
    params = sum(map(nbytes, param_buffers)) if param_buffers else sum(map(nbytes, set(policy.parameters())))
    tensors = state_tensors(policy)
    model = {t.untyped_storage()._cdata for t in tensors["buffers"] + tensors["params"]}
    main_params = [q for q in tensors["optimizer_params"] if q.untyped_storage()._cdata not in model]
    return {"params": params, "grads": sum(nbytes(b.grad_data) for b in buffers),
            "optimizer": sum(map(nbytes, tensors["optimizer_state"] + main_params))}


# what must be freed when a kind alone is offloaded, and what must stay (the fp32 optimizer updates the
# parameters themselves, the distributed one views of them: those are the parameters', not the optimizer's)
ALONE = {"params": (("params",), ("main_grads", "optimizer_state")),
         "grads": (("main_grads",), ("params", "optimizer_params", "optimizer_state")),
         "optimizer": (("optimizer_state",), ("params", "main_grads"))}


def round_trip(policy: MegatronPolicy) -> dict[str, Any]:
    """Offload everything, check it is gone, reload, check it is back bit for bit in the same storages;
    then each kind alone, checking that only its own storages go."""
    groups = state_tensors(policy)
    tensors = [t for ts in groups.values() for t in ts]
    before = [(t.detach().clone(), t.untyped_storage()._cdata, t.storage_offset(), t.data_ptr()) for t in tensors]

    def unchanged() -> bool:
        return all(torch.equal(t, v) and t.untyped_storage()._cdata == s and t.storage_offset() == o
                   for t, (v, s, o, _) in zip(tensors, before, strict=True))

    memory = PolicyOffload(policy, params=True, grads=True, optimizer=True)
    out: dict[str, Any] = {"expected": expected_bytes(policy), "tensors": len(tensors),
                           "grads_nonzero": any(bool(g.abs().sum()) for g in groups["main_grads"])}
    out["moved"] = memory.offload()
    out["freed"] = {k: all_freed(ts) for k, ts in groups.items() if ts}
    out["again"] = memory.offload()  # idempotent
    out["back"] = memory.reload()
    out["again_back"] = memory.reload()
    out["bitwise_same_storage"] = unchanged()
    out["same_data_ptr"] = sum(t.data_ptr() == p for t, (_, _, _, p) in zip(tensors, before, strict=True))
    out["alone"] = {}
    for kind, (gone, kept) in ALONE.items():
        alone = PolicyOffload(policy, **{kind: True})
        moved = alone.offload()
        checks = {"moved": moved == {kind: out["expected"][kind]}, **{f"freed {g}": all_freed(groups[g]) for g in gone},
                  **{f"kept {g}": none_freed(groups[g]) for g in kept}}
        alone.reload("params", "grads", "optimizer")
        out["alone"][kind] = {**checks, "bitwise_same_storage": unchanged()}
    return out


def record_phases(hybrid: ActorRolloutRef) -> tuple[list[tuple[str, str, str, dict[str, int]]], list[str]]:
    """Log every offload/reload the hybrid makes, with the current phase (set ``phase[0]``)."""
    log: list[tuple[str, str, str, dict[str, int]]] = []
    phase = [""]

    def logged(f: Any, who: str, op: str, *kinds: Any) -> Any:
        moved = f(*kinds)
        if moved:
            log.append((phase[0], who, op, moved))
        return moved

    for who, memory in (("actor", hybrid.actor_offload), ("ref", hybrid.ref_offload)):
        assert memory is not None
        for op in ("offload", "reload"):
            setattr(memory, op, partial(logged, getattr(memory, op), who, op))
    return log, phase


def rl_steps(hybrid: ActorRolloutRef, workers: EngineWorkers, batch: RolloutBatch, prompts: PromptBatch, *,
             check: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": [], "freed": {}, "phases": []}
    if check:
        log, phase = record_phases(hybrid)
    for step in range(1, RL_STEPS + 1):
        b = batch.index(list(range(len(batch))))  # a fresh copy: the phases fill in fields
        if check:
            phase[0] = "generate"
        workers.generate(prompts, GEN, seed=step)
        if check:  # everything waits on the host through generation
            actor, ref = state_tensors(hybrid.actor), state_tensors(hybrid.ref)  # type: ignore[arg-type]
            out["freed"][f"step{step}/generate"] = {
                **{f"actor_{k}": all_freed(v) for k, v in actor.items() if v}, "ref_params": all_freed(ref["params"])}
            phase[0] = "old_log_prob"
        entropy_BT = hybrid.compute_log_probs(b)
        if check:
            phase[0] = "ref_log_prob"
        hybrid.compute_ref_log_probs(b)
        if check:  # the ref goes back to the host right after its pass
            out["freed"][f"step{step}/after_ref"] = {
                "ref_params": all_freed(state_tensors(hybrid.ref)["params"])}  # type: ignore[arg-type]
            phase[0] = "update_actor"
        metrics = hybrid.update_actor(b, seed=7 + step)
        if check:
            phase[0] = "sync_weights"
        workers.sync_weights()
        weights = {k: v for bucket in hybrid.actor.export_weights(bucket_bytes=1 << 20) for k, v in bucket}
        out["steps"].append({"old_logprobs": b.old_logprobs, "ref_logprobs": b.ref_logprobs, "entropy": entropy_BT,
                             "metrics": metrics, "weights": weights})
    if check:
        out["phases"] = log
    return out


def run(model_dir: str, out_dir: Path, name: str, full: RolloutBatch) -> None:
    start = time.perf_counter()
    layout_name, _, dtype = name.partition(".")
    layout, distributed_optimizer = parse_layout(layout_name)
    result: dict[str, Any] = {}
    for offload in (False, True):
        init_parallel(layout)
        seed_everything(1)
        dp, dp_rank, B = (parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank(),
                          len(full))
        mine = list(range(dp_rank * B // dp, (dp_rank + 1) * B // dp))
        cfg = config(model_dir, layout, "token-mean", distributed_optimizer=distributed_optimizer)
        aor = cfg.actor_rollout_ref
        aor.actor.megatron.dtype = dtype or "float32"
        m = aor.actor.megatron
        m.param_offload = m.grad_offload = m.optimizer_offload = aor.ref.megatron.param_offload = offload
        plan, problems = Plan.build(cfg, world_size=dist.get_world_size(), device_type="cpu")
        assert not problems, problems
        hybrid = ActorRolloutRef(aor, plan=plan, objective=actor_objective(cfg), pad_token_id=full.pad_token_id)
        workers = EngineWorkers(build_engines(cfg, plan, pad_token_id=full.pad_token_id), trainer=hybrid,
                                bucket_megabytes=aor.rollout.update_weights_bucket_megabytes)
        got = rl_steps(hybrid, workers, full.index(mine), prompts_of(full), check=offload)
        result["on" if offload else "off"] = got["steps"]
        if offload:
            result["freed"], result["phases"] = got["freed"], got["phases"]
            result["round_trip"] = round_trip(hybrid.actor)
        workers.shutdown()
        parallel_state.destroy_model_parallel()
    torch.save(result, out_dir / f"{name}-rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        rt = result["round_trip"]
        print(f"{name}: {time.perf_counter() - start:.1f}s; round trip moved {rt['moved']} (expected "
              f"{rt['expected']}), {rt['same_data_ptr']}/{rt['tensors']} tensors at the same address after", flush=True)
        for phase, who, op, moved in result["phases"]:
            print(f"  {phase:>13} {who:>5} {op:>7}: " + ", ".join(f"{k} {v} B" for k, v in moved.items()), flush=True)


def main() -> None:
    model_dir, out_dir, runs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    full = fixed_batch(hf.vocab_size, hf.pad_token_id)
    for name in runs:
        run(model_dir, out_dir, name, full)
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main()
