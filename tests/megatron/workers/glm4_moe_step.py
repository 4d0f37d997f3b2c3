"""A GLM-4.5 actor on one rank (gloo world of 1) through ``MegatronPolicy`` and the ``hf`` engine: the routers' expert
biases in a bf16 model, log-probs against the engine's, R3 on its sigmoid grouped routing, and what training steps do
to the biases; prints one JSON line of measurements for ``test_glm4_moe.py``.

    python tests/megatron/workers/glm4_moe_step.py MODEL_DIR
"""

from __future__ import annotations

import json
import re
import sys

import torch
from router_replay_checks import MICRO, agree, logprob_diff, sample, used_routing  # this folder (sys.path[0])
from safetensors.torch import load_file

from hybridrl.config.schema import MegatronConfig, OptimConfig
from hybridrl.megatron.parallel import ParallelConfig, init_parallel, seed_everything
from hybridrl.megatron.policy import MegatronPolicy


def _biases(policy: MegatronPolicy) -> list[tuple[int, torch.Tensor]]:
    """Each MoE layer's router expert bias (the buffer itself), by layer index."""
    return [(int(re.findall(r"layers\.(\d+)\.", name)[0]), b) for chunk in policy.chunks
            for name, b in chunk.named_buffers() if name.endswith("router.expert_bias")]


def main() -> None:
    model = sys.argv[1]
    init_parallel(ParallelConfig())
    seed_everything(1)
    from transformers import AutoConfig

    pad = AutoConfig.from_pretrained(model).pad_token_id
    on_disk = {int(k.split(".")[2]): v for k, v in load_file(f"{model}/model.safetensors").items()
               if k.endswith("e_score_correction_bias")}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, pad, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    out: dict[str, object] = {}

    def policy(mode: str, dtype: str = "float32") -> MegatronPolicy:
        return MegatronPolicy(model_dir=model, megatron=MegatronConfig(dtype=dtype), optim=OptimConfig(lr=3e-2),
                              total_steps=4, pad_token_id=pad, router_replay=mode)

    bf16 = policy("disabled", "bfloat16")
    out["bf16_biases"] = [(str(b.dtype), torch.equal(b, on_disk[i])) for i, b in _biases(bf16)]
    del bf16
    fp32 = sample(model, "float32", prompts, pad)
    plain = policy("disabled")
    out["fp32_logprob_diff"] = logprob_diff(plain, fp32)[0]
    r3 = policy("R3")
    out["r3_used_equals_engine"] = agree(fp32, used_routing(r3, fp32))
    fp32.advantages = torch.randn(fp32.response_mask.shape, generator=g) * fp32.response_mask
    fp32.old_logprobs = fp32.rollout_logprobs

    def loss(logp, ent, mb, *, normalizer):  # noqa: ANN001, ANN202
        return -(logp * mb.advantages).sum() / normalizer, {}

    before = {i: b.clone() for i, b in _biases(plain)}
    steps = [plain.train_step(fp32, loss, batching=MICRO, loss_agg_mode="token-mean") for _ in range(2)]
    out["grad_norms"] = [s.get("grad_norm") for s in steps]
    out["biases_kept"] = all(torch.equal(b, before[i]) for i, b in _biases(plain))
    out["weights_moved"] = logprob_diff(plain, fp32)[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
