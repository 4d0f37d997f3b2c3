"""Run on 2 gloo ranks by test_cpu_adaptations.py: each upstream CUDA assumption without its adaptation
(recording the error), then with it (recording that it works). Usage: torchrun ... cpu_probes.py OUT_DIR.

Order matters: each probe runs with exactly the adaptations it needs to reach its spot.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", module=r"megatron\.")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import ModelParallelConfig, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding  # noqa: E402
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, clip_grads, get_megatron_optimizer, grad_scaler  # noqa: E402
from megatron.core.pipeline_parallel import schedules  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.transformer.utils import get_default_causal_mask  # noqa: E402

from hybridrl.megatron import cpu  # noqa: E402

results: dict[str, Any] = {}


def error_of(fn: Callable[[], object]) -> str | None:
    """``"ExcType: message"`` of what ``fn`` raises, or None."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def record(name: str, fn: Callable[[], object]) -> None:
    try:
        results[name] = fn()
    except Exception:
        results[name] = "FAILED: " + traceback.format_exc(limit=4)


def noop_on_cuda() -> dict[str, bool]:
    """With CUDA 'available', apply_cpu_adaptations must leave everything upstream."""
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    try:
        before = (torch.cuda.current_device, schedules.torch, tensor_parallel.random.CudaRNGStatesTracker)
        cpu.apply_cpu_adaptations()
        after = (torch.cuda.current_device, schedules.torch, tensor_parallel.random.CudaRNGStatesTracker)
        return {"untouched": before == after, "mask_is_none": cpu.causal_attention_mask(4) is None,
                "no_kwargs": cpu.cpu_model_parallel_kwargs() == {}}
    finally:
        torch.cuda.is_available = real  # type: ignore[assignment]


class ScalarModel(torch.nn.Module):
    """The least a Megatron schedule needs: ``config`` and ``set_input_tensor``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
        self.model_type = ModelType.encoder_or_decoder
        self.w = torch.nn.Parameter(torch.ones(3))

    def set_input_tensor(self, tensor: object) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def run_schedule() -> float:
    model = ScalarModel()

    def step(data: Any, model: ScalarModel) -> tuple[torch.Tensor, Any]:
        return model(next(data)), lambda out: (out, {"loss": out.detach()})

    schedules.forward_backward_no_pipelining(
        forward_step_func=step, data_iterator=iter([torch.full((3,), 2.0)]), model=[model],
        num_microbatches=1, seq_length=1, micro_batch_size=1)
    return float(model.w.grad.sum())  # d(sum(2w))/dw = 2 per element → 6


def p2p_exchange(config: ModelParallelConfig) -> list[float]:
    comm = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
    if parallel_state.is_pipeline_first_stage():
        comm.send_forward(torch.arange(4.0).reshape(2, 1, 2), is_last_stage=False)
        return []
    return comm.recv_forward((2, 1, 2), is_first_stage=False).flatten().tolist()


def tied_gpt_model() -> list[float]:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=2,
                               pipeline_dtype=torch.float32, **cpu.cpu_model_parallel_kwargs())
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=16,
                     max_sequence_length=8, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=True)
    return model.shared_embedding_or_output_weight()[:2].flatten().tolist()  # equal on both stages


class Weights(MegatronModule):
    def __init__(self) -> None:
        super().__init__(TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1))
        self.w = torch.nn.Parameter(torch.ones(4))


def optimizer_step() -> dict[str, Any]:
    """SGD(lr=0.1) through Megatron DDP + optimizer on loss = sum(3·w), clip_grad=0.5: the grad norm is
    6 (4 grads of 3), clipped grads are 0.25, so w becomes 0.975."""
    ddp = DistributedDataParallel(Weights().config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  Weights())
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.0, clip_grad=0.5), [ddp])
    ddp.zero_grad_buffer()
    opt.zero_grad()
    (ddp.module.w * 3).sum().backward()
    finalize_model_grads([ddp])
    ok, grad_norm, _ = opt.step()
    return {"ok": ok, "grad_norm": grad_norm, "w": ddp.module.w.tolist()}


def bf16_optimizer_step() -> dict[str, Any]:
    """SGD(lr=1e-3) through Megatron DDP + its bf16 optimizer on loss = sum(w), bf16 w = 1: the update
    (−1e-3) is below bf16's resolution at 1 (2⁻⁸ just below 1), so the bf16 parameter stays 1.0 while the
    optimizer's fp32 main weight becomes 0.999."""
    model = Weights().bfloat16()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1e-3, weight_decay=0.0, clip_grad=0.0, bf16=True,
                                                 params_dtype=torch.bfloat16), [ddp])
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp.module.w.sum().backward()
    finalize_model_grads([ddp])
    ok, _, _ = opt.step()
    w = ddp.module.w
    return {"ok": ok, "dtype": str(w.dtype), "w": w.float().tolist(), "main": w.main_param.tolist()}


def fp16_loss_scaling() -> dict[str, Any]:
    """SGD(lr=0.1) through Megatron DDP + its fp16 optimizer on loss = sum(3·w), fp16 w = 1, dynamic loss
    scale from 2¹⁶ (hysteresis 1): the scaled fp16 grads 3·2¹⁶ and 3·2¹⁵ overflow (fp16's max is 65504), so
    both steps are skipped and the scale halves each time; at 2¹⁴ (grads 49152) the step runs on the
    unscaled grads: w = 1 − 0.1·3 = 0.7. Then a fresh scaler loads the scaler's state."""
    model = Weights().half()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.0, clip_grad=0.0, fp16=True,
                                                 params_dtype=torch.float16, initial_loss_scale=2.0**16,
                                                 hysteresis=1), [ddp])
    oks, scales = [], []
    for _ in range(3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        opt.scale_loss((ddp.module.w * 3).sum()).backward()
        finalize_model_grads([ddp])
        oks.append(opt.step()[0])
        scales.append(float(opt.get_loss_scale()))
    fresh = dynamic_grad_scaler()
    fresh.load_state_dict(opt.chained_optimizers[0].grad_scaler.state_dict())
    return {"ok": oks, "scales": scales, "main": ddp.module.w.main_param.tolist(), "loaded_scale": float(fresh.scale)}


def dynamic_grad_scaler() -> grad_scaler.DynamicGradScaler:
    return grad_scaler.DynamicGradScaler(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                                         growth_interval=1000, hysteresis=1)


class TwoWeights(MegatronModule):
    """w (1500 ones) and v (500 ones): the grad buffer (2000, padded) splits over DP=2 so that DP rank 1
    holds the end of w and all of v: two Adam states on one rank."""

    def __init__(self) -> None:
        super().__init__(TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1))
        self.w = torch.nn.Parameter(torch.ones(1500))
        self.v = torch.nn.Parameter(torch.ones(500))


def distributed_optimizer() -> tuple[DistributedDataParallel, Any]:
    """Megatron DDP + the distributed optimizer (Adam, lr 0.1, clip 0.5) over :class:`TwoWeights`."""
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = TwoWeights()
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.1, weight_decay=0.0, clip_grad=0.5,
                                                 use_distributed_optimizer=True), [ddp])
    return ddp, opt


def distributed_optimizer_step(ddp: DistributedDataParallel, opt: Any) -> dict[str, Any]:
    """loss = sum((rank + 1)·(w + v)): the DP-mean grad is 1.5 per entry (norm 1.5·√2000, clipped to
    0.5); Adam's first step moves each entry by lr (any grad scale), so every entry is 0.9 on both ranks
    once the updated shards are all-gathered. Returns the distinct values and each Adam state's step."""
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ((ddp.module.w.sum() + ddp.module.v.sum()) * (dist.get_rank() + 1)).backward()
    finalize_model_grads([ddp])
    ok, grad_norm, _ = opt.step()
    weights = torch.cat([ddp.module.w, ddp.module.v]).tolist()
    steps = [float(state["step"]) for state in opt.chained_optimizers[0].optimizer.state.values()]
    return {"ok": ok, "grad_norm": grad_norm, "weights": sorted({round(v, 6) for v in weights}), "steps": steps}


def distributed_optimizer_state(ddp: DistributedDataParallel, opt: Any, loading: bool,
                                metadata: dict[str, Any]) -> dict[str, Any]:
    """Model + optimizer sharded state as hybridrl's checkpoints build it (``metadata`` for the optimizer)."""
    model = ddp.module.sharded_state_dict()
    return {"model": model, "optimizer": opt.sharded_state_dict(model, is_loading=loading, metadata=metadata)}


def distributed_optimizer_checkpoint(ddp: DistributedDataParallel, opt: Any, metadata: dict[str, Any]) -> Any:
    """The optimizer state in Megatron's ``fully_reshardable`` format: per checkpoint key, the number of
    entries and their distinct values."""
    state = distributed_optimizer_state(ddp, opt, False, {"distrib_optim_sharding_type": "fully_reshardable",
                                                          **metadata})["optimizer"]
    if state["param_state"] is None:  # gathered on DP rank 0 only
        return None
    return {t.key: [t.data.numel(), sorted({round(v, 12) for v in t.data.tolist()})]
            for tensors in state["param_state"].values() for t in tensors.values()}


def distributed_optimizer_resume(ddp: DistributedDataParallel, opt: Any, ckpt_dir: Path) -> dict[str, Any]:
    """Save ``ddp``/``opt`` after their step as hybridrl does, resume into fresh pairs, take one more step.
    Records the upstream failures first: a fresh optimizer's state dict, the model-space loader's missing
    ``step``, and one ``step`` tensor shared by all parameters after ``load_state_dict``; then resumes
    with the adaptations."""
    from megatron.core import dist_checkpointing

    metadata = {"distrib_optim_sharding_type": "fully_reshardable",
                **cpu.cpu_distributed_optimizer_checkpoint_metadata()}
    if dist.get_rank() == 0:
        ckpt_dir.mkdir()
    dist.barrier()
    dist_checkpointing.save(distributed_optimizer_state(ddp, opt, False, metadata), str(ckpt_dir))

    def resumed() -> dict[str, Any]:
        fresh_ddp, fresh_opt = distributed_optimizer()
        cpu.init_distributed_optimizer_state(fresh_opt)
        state = distributed_optimizer_state(fresh_ddp, fresh_opt, True, metadata)
        loaded = dist_checkpointing.load(state, str(ckpt_dir))
        fresh_ddp.module.load_state_dict(loaded["model"])
        fresh_opt.load_state_dict(loaded["optimizer"])
        adam = fresh_opt.chained_optimizers[0].optimizer
        return {"shard": sum(state["exp_avg"].numel() for state in adam.state.values()),
                "exp_avg": sorted({round(v, 12) for state in adam.state.values() for v in state["exp_avg"].tolist()}),
                "after_step": distributed_optimizer_step(fresh_ddp, fresh_opt)}

    def steps_after_upstream_load() -> list[float]:
        """Upstream's own ``load_state_dict(state_dict())`` (run by ``sharded_state_dict(is_loading=True)``),
        then a step: each Adam state should read 2 (the dummy step and this one)."""
        fresh_ddp, fresh_opt = distributed_optimizer()
        cpu.init_distributed_optimizer_state(fresh_opt)
        inner = fresh_opt.chained_optimizers[0]
        inner.load_state_dict(inner.state_dict())
        return distributed_optimizer_step(fresh_ddp, fresh_opt)["steps"]

    fresh = distributed_optimizer()
    out: dict[str, Any] = {
        "state_without": error_of(lambda: distributed_optimizer_state(*fresh, True, metadata)),
        "step_without": error_of(resumed),
        "shared_step_without": steps_after_upstream_load(),
    }
    cpu.load_torch_adam_step_in_distributed_optimizer()
    out["with"] = resumed()
    return out


class Chunk(MegatronModule):
    """One model chunk of the interleaved-schedule probe: ``h -> tanh(h·w)``; chunk 0 of stage 0 reads data."""

    def __init__(self, config: TransformerConfig, w: torch.Tensor, *, first: bool) -> None:
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder
        self.w = torch.nn.Parameter(w.clone())
        self.first = first
        self.input: torch.Tensor | None = None

    def set_input_tensor(self, tensor: Any) -> None:
        self.input = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh((x if self.first else self.input) * self.w)


def interleaved_chunk_weights() -> list[torch.Tensor]:
    """The 4 chunks' weights in model order: (stage 0, chunk 0), (1, 0), (0, 1), (1, 1)."""
    return [torch.linspace(0.5, 1.5, 4) + 0.1 * i for i in range(4)]


def interleaved_data() -> list[torch.Tensor]:
    return [torch.arange(24.0).view(3, 2, 4) / 10 + m for m in range(4)]  # 4 micro-batches [s, b, h]


def interleaved_grads(batched: bool) -> list[list[float]]:
    """This rank's 2 chunks' grads after Megatron's interleaved schedule (PP=2 × VPP=2, 4 micro-batches,
    loss = mean over micro-batches of sum(out²)), with ``batch_p2p_comm`` as given."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    config = TransformerConfig(num_layers=4, hidden_size=4, num_attention_heads=1, pipeline_model_parallel_size=2,
                               virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                               batch_p2p_comm=batched, batch_p2p_sync=False)
    weights = interleaved_chunk_weights()
    chunks = [Chunk(config, weights[2 * v + pp_rank], first=pp_rank == 0 and v == 0) for v in range(2)]

    def step(data: Any, model: Chunk) -> tuple[torch.Tensor, Any]:
        out = model(next(data))
        return out, lambda o: (o.pow(2).sum(), {"loss": o.pow(2).sum().detach()})

    schedules.get_forward_backward_func()(
        forward_step_func=step, data_iterator=[iter(interleaved_data()) for _ in chunks], model=chunks,
        num_microbatches=4, seq_length=3, micro_batch_size=2)
    return [c.w.grad.tolist() for c in chunks]


def interleaved_expected_grads() -> list[list[float]]:
    """The same loss's grads computed in one process (autograd through the 4 chunks in model order)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    weights = [w.clone().requires_grad_(True) for w in interleaved_chunk_weights()]
    loss = torch.zeros(())
    for x in interleaved_data():
        for w in weights:
            x = torch.tanh(x * w)
        loss = loss + x.pow(2).sum() / 4
    loss.backward()
    return [weights[2 * v + pp_rank].grad.tolist() for v in range(2)]


def rng_draws() -> dict[str, Any]:
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():
        tp_draw = torch.rand(2).tolist()
    default_draw = torch.rand(2).tolist()
    x = torch.ones(3, requires_grad=True)
    tensor_parallel.checkpoint(lambda t: (t * 3).sin(), False, x).sum().backward()
    return {"tp_draw": tp_draw, "default_draw": default_draw, "checkpoint_grad": x.grad.tolist(),
            "expected_grad": (3 * torch.cos(torch.full((3,), 3.0))).tolist()}


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results["noop_on_cuda"] = noop_on_cuda()

    # World of 2 as TP=2 (no adaptation applied yet).
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    results["rotary_without"] = error_of(lambda: RotaryEmbedding(
        kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True).get_emb(4))
    results["causal_mask_upstream"] = error_of(lambda: get_default_causal_mask(4))
    results["causal_mask_ours"] = cpu.causal_attention_mask(3).int().tolist()
    results["seed_without"] = error_of(lambda: tensor_parallel.model_parallel_cuda_manual_seed(7))
    results["fork_without"] = error_of(lambda: tensor_parallel.get_cuda_rng_tracker().fork().__enter__())
    results["recompute_without"] = error_of(lambda: tensor_parallel.checkpoint(
        lambda t: t * 2, False, torch.ones(2, requires_grad=True)))

    cpu.use_cpu_as_current_device()
    record("rotary_with", lambda: list(RotaryEmbedding(kv_channels=8, rotary_percent=1.0).get_emb(4).shape))
    results["schedule_without"] = error_of(run_schedule)
    cpu.use_cpu_in_pipeline_schedules()
    record("schedule_with", run_schedule)
    cpu.use_cpu_rng_tracker()
    record("rng_with", rng_draws)

    # World of 2 as PP=2.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    results["p2p_without"] = error_of(lambda: p2p_exchange(ModelParallelConfig(pipeline_dtype=torch.float32)))
    record("p2p_with", lambda: p2p_exchange(ModelParallelConfig(pipeline_dtype=torch.float32,
                                                                **cpu.cpu_model_parallel_kwargs())))
    dist.barrier()
    results["tied_without"] = error_of(tied_gpt_model)
    dist.barrier()
    cpu.use_cpu_in_tied_embedding_setup()
    record("tied_with", tied_gpt_model)

    # World of 2 as DP=2.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    grad = torch.nn.Parameter(torch.ones(2))
    grad.grad = torch.ones(2)
    results["grad_norm_without"] = error_of(lambda: clip_grads.get_grad_norm_fp32([grad.grad]))
    results["clip_assert_upstream"] = error_of(lambda: clip_grads.clip_grad_by_total_norm_fp32([grad], 1.0, 10.0))
    results["optimizer_without"] = error_of(optimizer_step)
    cpu.use_cpu_in_optimizer()
    record("optimizer_with", optimizer_step)
    results["bf16_optimizer_without"] = error_of(bf16_optimizer_step)
    cpu.use_cpu_in_float16_optimizer()
    record("bf16_optimizer_with", bf16_optimizer_step)
    results["grad_scaler_without"] = error_of(dynamic_grad_scaler)
    upstream_scaler_load = grad_scaler.DynamicGradScaler.load_state_dict
    cpu.use_cpu_in_grad_scaler()
    scaler = dynamic_grad_scaler()
    results["grad_scaler_load_without"] = error_of(lambda: upstream_scaler_load(scaler, scaler.state_dict()))
    record("fp16_optimizer_with", fp16_loss_scaling)
    results["distopt_without"] = error_of(distributed_optimizer)
    cpu.use_cpu_in_distributed_optimizer()
    ddp, opt = distributed_optimizer()
    record("distopt_with", lambda: distributed_optimizer_step(ddp, opt))
    results["distopt_ckpt_without"] = error_of(lambda: distributed_optimizer_checkpoint(ddp, opt, {}))
    record("distopt_ckpt_with", lambda: distributed_optimizer_checkpoint(
        ddp, opt, cpu.cpu_distributed_optimizer_checkpoint_metadata()))
    cpu.use_cpu_in_dist_checkpointing()
    record("distopt_resume", lambda: distributed_optimizer_resume(ddp, opt, out_dir / "distopt_ckpt"))

    # World of 2 as CP=2: RotaryEmbedding slices its table for this CP rank (chunks r, 3 - r of 4).
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    table = torch.arange(8.0).view(8, 1, 1, 1)
    cp_group = parallel_state.get_context_parallel_group()
    results["cp_rope_without"] = error_of(lambda: rope_utils.get_pos_emb_on_this_cp_rank(table, 0, cp_group))
    cpu.use_cpu_in_cp_rope()
    record("cp_rope_with", lambda: rotary_pos_embedding.get_pos_emb_on_this_cp_rank(
        table, 0, cp_group).flatten().tolist())

    # World of 2 as PP=2 × VPP=2: the interleaved schedule with batched and unbatched p2p.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    record("interleaved_expected", interleaved_expected_grads)
    record("interleaved_batched", lambda: interleaved_grads(batched=True))
    record("interleaved_unbatched", lambda: interleaved_grads(batched=False))

    patched = (torch.cuda.current_device, schedules.torch, tensor_parallel.random.CudaRNGStatesTracker,
               type(tensor_parallel.get_cuda_rng_tracker()))
    cpu.apply_cpu_adaptations()
    cpu.apply_cpu_adaptations()
    results["idempotent"] = patched == (torch.cuda.current_device, schedules.torch,
                                        tensor_parallel.random.CudaRNGStatesTracker,
                                        type(tensor_parallel.get_cuda_rng_tracker()))

    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
