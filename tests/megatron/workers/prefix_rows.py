"""Worker: Megatron's RoPE and position ids, and shared-prompt rows, against transformers (1 rank, gloo).

    python -m torch.distributed.run --nproc-per-node 1 prefix_rows.py MODEL_DIR OUT_JSON

Writes the max |Δ| of: Megatron with shifted position ids vs arange ones, without the workaround
(``ignored``: 0 while upstream ignores them) and with it vs transformers at those positions (``rope_vs_hf``);
the response-token logits of shared-prompt rows vs transformers on each sample alone (``rows_vs_hf``).
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.hf.arch import HFArch
from hybridrl.megatron.cpu import causal_attention_mask
from hybridrl.megatron.model import build_model_chunks
from hybridrl.megatron.parallel import ParallelConfig, destroy_parallel, init_parallel, seed_everything
from hybridrl.megatron.prefix_grouper import pack_groups, prompt_groups
from hybridrl.megatron.rope_positions import positioned_rope
from hybridrl.megatron.weights import load_hf_weights

torch.set_num_threads(1)
model_dir, out = sys.argv[1], sys.argv[2]
init_parallel(ParallelConfig())
seed_everything(0)
arch = HFArch.from_hf(model_dir)
(model,) = build_model_chunks(arch, ParallelConfig())
load_hf_weights([model], arch, model_dir)
model.eval()
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
V = arch.vocab_size
g = torch.Generator().manual_seed(0)
result = {}

with torch.no_grad():
    # 1. position ids: ignored upstream; applied inside positioned_rope (two rows, one restarting)
    S = 12
    ids_BS = torch.randint(0, V, (2, S), generator=g)
    arange_BS = torch.arange(S).expand(2, S)
    shifted_BS = torch.stack([torch.arange(S) + 5, torch.cat([torch.arange(6), torch.arange(2, 8)])])
    mask = causal_attention_mask(S)
    plain = model(ids_BS, arange_BS, mask)[..., :V]
    result["ignored"] = float((model(ids_BS, shifted_BS, mask)[..., :V] - plain).abs().max())
    with positioned_rope(model, shifted_BS):
        rope = model(ids_BS, shifted_BS, mask)[..., :V]
    hf_rope = hf(ids_BS, position_ids=shifted_BS).logits
    result["rope_vs_hf"] = float((rope - hf_rope).abs().max())
    result["rope_vs_plain"] = float((rope - plain).abs().max())  # must be far from 0
    result["after_context"] = float((model(ids_BS, arange_BS, mask)[..., :V] - plain).abs().max())

    # 2. shared-prompt rows: 2 prompts × 3 samples of differing lengths, vs each sample alone in transformers
    P, T = 6, 5
    prompts = [torch.randint(0, V, (4,), generator=g), torch.randint(0, V, (6,), generator=g)]
    response_len = [3, 5, 1, 2, 4, 5]
    B = len(response_len)
    prompt_ids, prompt_mask = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
    response_ids, response_mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for b, r in enumerate(response_len):
        p = prompts[b % 2]  # interleaved: grouping must find them
        prompt_ids[b, P - len(p):], prompt_mask[b, P - len(p):] = p, 1
        response_ids[b, :r], response_mask[b, :r] = torch.randint(0, V, (r,), generator=g), 1
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                         response_mask=response_mask, rollout_logprobs=torch.zeros(B, T),
                         weight_version=torch.zeros(B, dtype=torch.long), group_index=torch.arange(B) % 2,
                         meta=[SampleMeta() for _ in range(B)], pad_token_id=0)
    groups = prompt_groups(batch)
    result["groups"] = groups
    order = [i for grp in groups for i in grp]
    part = batch.index(order)
    rows = pack_groups(part, [len(grp) for grp in groups], pad_token_id=0)
    result["row_shape"] = list(rows.tokens_BS.shape)
    with positioned_rope(model, rows.position_ids_BS):
        logits = model(rows.tokens_BS, rows.position_ids_BS, rows.attention_mask)[..., :V]
    got_BTV = logits.reshape(-1, V)[rows.flat_response_index_BT().reshape(-1)].view(B, T, V)
    worst = 0.0
    for j, b in enumerate(order):
        p, r = prompts[b % 2], response_len[b]
        alone = hf(torch.cat([p, response_ids[b, :r]])[None]).logits[0]
        want_TV = alone[len(p) - 1:len(p) - 1 + r]  # the predictions of response tokens 0 … r-1
        worst = max(worst, float((got_BTV[j, :r] - want_TV).abs().max()))
    result["rows_vs_hf"] = worst

destroy_parallel()
with open(out, "w") as f:
    json.dump(result, f)
print("OK", result)
