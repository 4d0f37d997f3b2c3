"""Worker: a VLM policy on Megatron takes images — log-probs against transformers, one train step, the export.

    python -m torch.distributed.run --nproc-per-node 2 vlm_policy_step.py MODEL_DIR OUT_DIR LAYOUT [LAYOUT ...]

A layout is ``tp<a>pp<b>[cp<c>][-frozen|-sgd]`` (DP: what remains of the 2 ranks; ``-frozen``: ``freeze_vision_tower``;
``-sgd``: SGD at lr 1 without clipping, whose first step is minus the gradient, saved with transformers' gradient of the
same loss), run one after the other in the same ranks. A batch of 4 samples (one image of 6 placeholders, one of 4, text
only, two images), each DP rank its half, micro-batches of 2 (each with its own images); the loss is normalised over the
whole batch, so every DP size takes one step. Rank 0 saves ``OUT_DIR/<layout>.pt``: the largest |Δ log-prob| against
transformers (on every rank's rows), the step's metrics, the exported weights after it (language model and
``visual.*``), and — at DP = 2 — whether a fresh policy restored from the step's checkpoint state takes a second step
bitwise like the first one (the vision tower is in the checkpoint and the optimizer).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.checkpoint.rl import _model_and_optimizer_state, _restore
from hybridrl.config.schema import MegatronConfig, OptimConfig
from hybridrl.megatron.config import MicroBatching
from hybridrl.megatron.parallel import init_parallel, seed_everything
from hybridrl.megatron.policy import MegatronPolicy, parallel_config
from hybridrl.trainers.sft import nll_loss
from hybridrl.vlm.inputs import ImageInputs
from hybridrl.vlm.sglang_compat import transformers_rope_rules

torch.set_num_threads(1)
IMAGE, START, END = 200, 202, 203  # tests/support/tiny_vlm.py's ids
PAD, T = 209, 6
GRIDS = [[(1, 4, 6)], [(1, 4, 4)], [], [(1, 8, 2), (1, 2, 4)]]  # each sample's images


def patch_width(model_dir: str) -> int:
    """channels × temporal patch × patch² of the checkpoint's tower (patch 8 and 16 in tests/support/tiny_vlm.py)."""
    vision = json.loads((Path(model_dir) / "config.json").read_text())["vision_config"]
    return 3 * 2 * int(vision["patch_size"]) ** 2


def fixed_batch(model_dir: str) -> RolloutBatch:
    patch = patch_width(model_dir)
    g = torch.Generator().manual_seed(7)
    prompts, metas = [], []
    for b, grids in enumerate(GRIDS):
        ids = torch.randint(0, 200, (2 + b,), generator=g).tolist()
        for t, h, w in grids:
            ids += [START, *[IMAGE] * (t * h * w // 4), END, *torch.randint(0, 200, (2,), generator=g).tolist()]
        prompts.append(ids)
        patches = sum(t * h * w for t, h, w in grids)
        metas.append(SampleMeta(images=ImageInputs(pixel_values=torch.randn(patches, patch, generator=g),
                                                   image_grid_thw=torch.tensor(grids)) if grids else None))
    P = max(map(len, prompts))
    prompt_ids = torch.full((len(prompts), P), PAD)
    prompt_mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, ids in enumerate(prompts):
        prompt_ids[b, P - len(ids):], prompt_mask[b, P - len(ids):] = torch.tensor(ids), 1
    response_ids = torch.randint(0, 200, (len(prompts), T), generator=g)
    response_mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b in range(len(prompts)):
        response_mask[b, :3 + b % 4] = 1
    response_ids[response_mask == 0] = PAD
    n = len(prompts)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, rollout_logprobs=torch.zeros(n, T),
                        weight_version=torch.zeros(n, dtype=torch.long), group_index=torch.arange(n), meta=metas,
                        pad_token_id=PAD)


def hf_model(model_dir: str) -> Any:
    from transformers import AutoModelForImageTextToText

    with transformers_rope_rules():
        return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_response_logprobs(hf: Any, batch: RolloutBatch) -> list[torch.Tensor]:
    """transformers' log-prob of each sample's response tokens, one forward a sample (with autograd, if enabled)."""
    out = []
    for b in range(len(batch)):
        prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()]
        n = int(batch.response_mask[b].sum())
        ids = torch.cat([prompt, batch.response_ids[b, :n]])[None]
        img = batch.meta[b].images
        kw = {} if img is None else dict(pixel_values=img.pixel_values, image_grid_thw=img.image_grid_thw,
                                         mm_token_type_ids=(ids == IMAGE).int())
        logits = hf(input_ids=ids, **kw).logits[0, len(prompt) - 1:len(prompt) + n - 1]
        out.append(logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0])
    return out


def hf_logprobs(model_dir: str, batch: RolloutBatch) -> torch.Tensor:
    out = torch.zeros(batch.response_ids.shape)
    with torch.no_grad():
        for b, logp in enumerate(hf_response_logprobs(hf_model(model_dir), batch)):
            out[b, :len(logp)] = logp
    return out


def hf_gradients(model_dir: str, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """transformers' gradient of the batch's token-mean NLL, under the checkpoint's tensor names."""
    hf = hf_model(model_dir)
    nll = -torch.cat(hf_response_logprobs(hf, batch)).sum() / int(batch.response_mask.sum())
    nll.backward()
    legacy = json.loads((Path(model_dir) / "config.json").read_text())["model_type"] == "qwen2_5_vl"  # visual.*
    return {(n.replace("model.visual.", "visual.").replace("model.language_model.", "model.") if legacy else n): p.grad
            for n, p in hf.named_parameters() if p.grad is not None}


def run_layout(model_dir: str, out_dir: Path, name: str) -> None:
    sizes, frozen, sgd = name.split("-")[0], name.endswith("-frozen"), name.endswith("-sgd")
    sizes, _, cp = sizes.partition("cp")
    tp, pp = (int(x) for x in sizes.removeprefix("tp").split("pp"))
    megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              context_parallel_size=int(cp or 1))
    init_parallel(parallel_config(megatron))
    seed_everything(1)

    def build() -> MegatronPolicy:
        optim = (OptimConfig(optimizer="sgd", lr=1.0, clip_grad=0.0) if sgd  # step 1: w -= grad
                 else OptimConfig(optimizer="adam", lr=1e-2, adam_eps=1e-6, clip_grad=1.0))
        return MegatronPolicy(model_dir=model_dir, megatron=megatron, total_steps=3, pad_token_id=PAD, optim=optim,
                              freeze_vision_tower=frozen)

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    full, micro = fixed_batch(model_dir), MicroBatching(micro_batch_size=2)
    batch = full.index(list(range(dp_rank * len(full) // dp, (dp_rank + 1) * len(full) // dp)))
    policy = build()
    before, _ = policy.compute_log_probs(batch, batching=micro)
    diff = torch.tensor(float((before - hf_logprobs(model_dir, batch)).abs().max()))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    step = policy.train_step(batch, nll_loss, batching=micro, loss_agg_mode="token-mean")
    exported = {k: v.clone() for bucket in policy.export_weights(bucket_bytes=1 << 16) for k, v in bucket}
    resumed = None
    if dp == 2 and not frozen and not sgd:
        ckpt = out_dir / f"{name}.ckpt"
        if dist.get_rank() == 0:
            ckpt.mkdir()
        dist.barrier()
        assert policy.scheduler is not None
        dist_checkpointing.save(_model_and_optimizer_state(policy, loading=False), str(ckpt))
        fresh = build()
        _restore(fresh, ckpt, policy.scheduler.state_dict())
        for p in (policy, fresh):
            p.train_step(batch, nll_loss, batching=micro, loss_agg_mode="token-mean")
        a, b = ({k: v for bucket in p.export_weights(bucket_bytes=1 << 16) for k, v in bucket} for p in (policy, fresh))
        resumed = all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    if dist.get_rank() == 0:
        torch.save({"logprob_diff": float(diff), "step": step, "exported": exported, "resumed_bitwise": resumed,
                    "hf_grads": hf_gradients(model_dir, full) if sgd else None}, out_dir / f"{name}.pt")
        print(f"{name}: max |Δ logprob| {float(diff):.2e} loss {step['loss']:.4f} grad_norm {step['grad_norm']:.4f}",
              flush=True)
    parallel_state.destroy_model_parallel()  # the next layout re-initialises the model-parallel groups


def main() -> None:
    for name in sys.argv[3:]:
        run_layout(sys.argv[1], Path(sys.argv[2]), name)


if __name__ == "__main__":
    main()
