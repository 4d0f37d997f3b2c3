"""Worker: ``MegatronPolicy.greedy_matches`` at TP (argv[2]) and PP (argv[3]) vs transformers' argmax, row by row.

The responses are the HF model's own greedy continuations (every token a match), one with its third token replaced
by the second most likely one (a miss there; the tokens after it are judged after the replaced token, as teacher
forcing does), and random tokens (mostly misses)."""

import sys

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "parallel" / "workers"))
from rl_step import fixed_batch  # noqa: E402

from hybridrl.megatron.config import MegatronConfig, MicroBatching  # noqa: E402
from hybridrl.megatron.parallel import destroy_parallel, init_parallel, seed_everything  # noqa: E402
from hybridrl.megatron.policy import MegatronPolicy, parallel_config  # noqa: E402

torch.set_num_threads(1)
model_dir, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hf_config = AutoConfig.from_pretrained(model_dir)
batch = fixed_batch(hf_config.vocab_size, hf_config.pad_token_id)
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def logits_after(prompt: list[int], response: list[int]) -> torch.Tensor:
    """``[len(response), V]``: the logits that predict each response token."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        return hf(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) + len(response) - 1]


g = torch.Generator().manual_seed(5)
expected = torch.zeros(batch.response_ids.shape)
for b in range(len(batch)):
    prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()].tolist()
    n = int(batch.response_mask[b].sum())
    response: list[int] = []
    for t in range(n):  # greedy continuation, token by token
        nxt = logits_after(prompt, response + [0])[-1]
        order = nxt.argsort(descending=True)
        response.append(int(order[1] if (b % 4 == 1 and t == 2) else order[0]))
    if b % 4 == 2:
        response = torch.randint(0, hf_config.vocab_size, (n,), generator=g).tolist()
    batch.response_ids[b, :n] = torch.tensor(response)
    expected[b, :n] = (logits_after(prompt, response).argmax(-1) == torch.tensor(response)).float()
assert expected.sum() > 0 and (expected * batch.response_mask).sum() < batch.response_mask.sum()

init_parallel(parallel_config(MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)))
seed_everything(1)
policy = MegatronPolicy(model_dir=model_dir, megatron=MegatronConfig(tensor_model_parallel_size=tp,
                                                                     pipeline_model_parallel_size=pp),
                        optim=None, total_steps=1, pad_token_id=batch.pad_token_id)
got = policy.greedy_matches(batch, batching=MicroBatching(micro_batch_size=4))
if dist.get_rank() == 0:
    print(f"matches {int(got.sum())} of {int(batch.response_mask.sum())} tokens; expected {int(expected.sum())}")
assert torch.equal(got, expected), (got, expected)
destroy_parallel()
print("OK")
