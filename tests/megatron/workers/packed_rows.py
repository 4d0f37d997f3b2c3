"""Worker: packed rows (THD) in Megatron's forward against transformers on each sample alone (1 rank, gloo).

    python -m torch.distributed.run --nproc-per-node 1 packed_rows.py OUT_JSON MODEL_DIR [MODEL_DIR ...]

For each model: 5 samples of differing prompt and response lengths packed into one row (each sequence rounded up to 4
tokens, the row to 32), forward with ``PackedSeqParams``; writes the max |Δ| of every response token's logits against
transformers on that sample alone (``<name>``); the same with the samples in two shared-prompt groups packed in one
row (``<name>_shared``: blocks, explicit positions); and whether Megatron's local ``DotProductAttention`` still refuses
packed sequences (``upstream_refuses``: hybridrl/megatron/packed_attention.py works around it).
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from transformers import AutoModelForCausalLM

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.hf.arch import HFArch
from hybridrl.megatron.model import build_model_chunks
from hybridrl.megatron.parallel import ParallelConfig, destroy_parallel, init_parallel, seed_everything
from hybridrl.megatron.prefix_grouper import pack_groups_in_one_row
from hybridrl.megatron.rope_positions import positioned_rope
from hybridrl.megatron.runner import _packed_seq_params, _shared_prefix_params
from hybridrl.megatron.sequences import pack_sequences
from hybridrl.megatron.weights import load_hf_weights

torch.set_num_threads(1)
out, model_dirs = sys.argv[1], sys.argv[2:]
init_parallel(ParallelConfig())
seed_everything(0)
result: dict = {}
prompt_len, response_len = [4, 7, 2, 6, 5], [3, 1, 6, 5, 2]
P, T = max(prompt_len), max(response_len)

for model_dir in model_dirs:
    arch = HFArch.from_hf(model_dir)
    (model,) = build_model_chunks(arch, ParallelConfig())
    load_hf_weights([model], arch, model_dir)
    model.eval()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    V = arch.vocab_size
    g = torch.Generator().manual_seed(0)
    B = len(prompt_len)
    prompt_ids, prompt_mask = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
    response_ids, response_mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_len, response_len, strict=True)):
        prompt_ids[b, P - p:], prompt_mask[b, P - p:] = torch.randint(0, V, (p,), generator=g), 1
        response_ids[b, :r], response_mask[b, :r] = torch.randint(0, V, (r,), generator=g), 1
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                         response_mask=response_mask, rollout_logprobs=torch.zeros(B, T),
                         weight_version=torch.zeros(B, dtype=torch.long), group_index=torch.arange(B),
                         meta=[SampleMeta() for _ in range(B)], pad_token_id=0)
    rows = pack_sequences(batch, pad_token_id=0, multiple=4, total_multiple=32)
    with torch.no_grad():
        logits = model(rows.tokens_BS, rows.position_ids_BS, None, packed_seq_params=_packed_seq_params(rows))[..., :V]
        got_BTV = rows.at_responses(logits)
        worst = 0.0
        for b, (p, r) in enumerate(zip(prompt_len, response_len, strict=True)):
            alone = hf(torch.cat([prompt_ids[b, P - p:], response_ids[b, :r]])[None]).logits[0]
            worst = max(worst, float((got_BTV[b, :r] - alone[p - 1:p - 1 + r]).abs().max()))
        if arch.mla is not None:  # shared-prompt rows are refused with MLA (its RoPE is per layer)
            result[Path(model_dir).name] = worst
            continue
        # shared-prompt groups end to end (use_prefix_grouper + packing): samples 0, 2, 4 share one prompt, 1, 3 another
        owner = [0, 1, 0, 1, 0]
        shared_ids = prompt_ids.clone()
        shared_mask = prompt_mask.clone()
        for b, o in enumerate(owner):
            shared_ids[b], shared_mask[b] = prompt_ids[o], prompt_mask[o]
        shared = dataclasses.replace(batch, prompt_ids=shared_ids, prompt_mask=shared_mask)
        order = [0, 2, 4, 1, 3]
        part = shared.index(order)
        groups = pack_groups_in_one_row(part, [3, 2], pad_token_id=0)
        with positioned_rope(model, groups.position_ids_BS):
            logits = model(groups.tokens_BS, groups.position_ids_BS, None,
                           packed_seq_params=_shared_prefix_params(groups))[..., :V]
        got_BTV = groups.at_responses(logits)
        worst_shared = 0.0
        for j, b in enumerate(order):
            p, r = prompt_len[owner[b]], response_len[b]
            alone = hf(torch.cat([prompt_ids[owner[b], P - p:], response_ids[b, :r]])[None]).logits[0]
            worst_shared = max(worst_shared, float((got_BTV[j, :r] - alone[p - 1:p - 1 + r]).abs().max()))
    result[Path(model_dir).name] = worst
    result[Path(model_dir).name + "_shared"] = worst_shared
    result["shared_shape"] = list(groups.tokens_BS.shape)
    result["row_shape"] = list(rows.tokens_BS.shape)

attention = next(m for m in model.modules() if isinstance(m, DotProductAttention))
q = torch.zeros(32, 1, attention.num_attention_heads_per_partition, attention.hidden_size_per_attention_head)
try:  # Megatron's own forward, not the subclass's
    DotProductAttention.forward(attention, q, q, q, None, packed_seq_params=_packed_seq_params(rows))
    result["upstream_refuses"] = False
except AssertionError:
    result["upstream_refuses"] = True

destroy_parallel()
with open(out, "w") as f:
    json.dump(result, f)
print("OK", result)
