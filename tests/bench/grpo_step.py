"""Benchmark: one GRPO step of the tiny workload, per stage, against a plain-transformers baseline.

    python tests/bench/grpo_step.py [--steps 12] [--warmup 2]

Workload (fixed): random tiny Qwen2 (hidden 128, 4 layers, char vocab), 16 prompts × 8 samples of
1–2 digit addition, ≤ 8 new tokens, 1 torch thread, one process (gloo world of 1). hybridrl runs its
real loop (hf engine → reward → Megatron log-probs → GRPO → Megatron update → in-place weight sync).
The baseline does the same step with transformers + torch.optim.AdamW only (generate, log-probs,
PPO-clip backward, step) — the cost of the math without the framework. Both run in this process so
the ratio is measured on the same machine state. Prints medians over the timed steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def hybridrl_steps(tmp: Path, model: Path, train: Path, steps: int, warmup: int) -> list[dict[str, float]]:
    from hybridrl.config.compose import compose_config
    from hybridrl.config.validate import validate
    from hybridrl.megatron.parallel import destroy_parallel
    from hybridrl.metrics import Timer
    from hybridrl.rollout.build import sampling_params
    from hybridrl.trainers.components import build_components
    from hybridrl.trainers.rl import compute_advantages, score

    cfg = compose_config(["recipe=grpo_tiny", f"actor_rollout_ref.model.path={model}",
                          "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{train}]",
                          "data.val_files=[]", "data.build_if_missing=null",
                          "actor_rollout_ref.actor.use_kl_loss=false",  # the fixed workload, whatever the recipe:
                          "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
                          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
                          "actor_rollout_ref.rollout.n=8", "data.max_response_length=8",
                          "trainer.logger=[]", f"trainer.output_dir={tmp / 'out'}",
                          f"trainer.total_training_steps={steps + warmup}"])
    c = build_components(cfg, validate(cfg, world_size=1))
    prompts, rows = c.prompts(), []
    try:
        for step in range(1, steps + warmup + 1):
            timer = Timer()
            with timer("step"):
                with timer("gen"):
                    batch = c.rollout.generate(next(prompts), sampling_params(cfg), seed=step)
                with timer("reward"):
                    score(batch, c.reward.submit(batch))
                with timer("old_log_prob"):
                    c.hybrid.compute_log_probs(batch)
                with timer("adv"):
                    compute_advantages(c, batch)
                with timer("update_actor"):
                    c.hybrid.update_actor(batch, seed=step)
                with timer("sync_weights"):
                    c.rollout.sync_weights()
            if step > warmup:
                rows.append(timer.times | {"samples": float(len(batch))})
    finally:
        c.close()
        destroy_parallel()
    return rows


def baseline_steps(model: Path, train: Path, steps: int, warmup: int) -> list[dict[str, float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.data.rows import read_rows
    from hybridrl.metrics import Timer

    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model)
    opt = torch.optim.AdamW(lm.parameters(), lr=2e-4, weight_decay=0.0)
    rows_data = [r for _, r in read_rows(train)]
    out = []
    for step in range(1, steps + warmup + 1):
        chunk = rows_data[(step * 16) % len(rows_data):][:16]
        timer = Timer()
        with timer("step"):
            with timer("gen"):
                enc = tok([r["prompt"] for r in chunk], return_tensors="pt", padding=True, padding_side="left")
                lm.eval()
                with torch.no_grad():
                    seqs = lm.generate(**enc, do_sample=True, max_new_tokens=8, num_return_sequences=8,
                                       pad_token_id=tok.pad_token_id, top_k=0, top_p=1.0)
            with timer("reward"):
                texts = tok.batch_decode(seqs[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                r = torch.tensor([float(t.strip() == chunk[i // 8]["ground_truth"]) for i, t in enumerate(texts)])
                g = r.view(16, 8)
                adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1)
            attn = (seqs != tok.pad_token_id).long()
            attn[:, :enc["input_ids"].shape[1]] = enc["attention_mask"].repeat_interleave(8, 0)
            with timer("old_log_prob"), torch.no_grad():
                old = torch.log_softmax(lm(seqs, attention_mask=attn).logits[:, :-1], -1).gather(
                    -1, seqs[:, 1:, None]).squeeze(-1)
            with timer("update_actor"):
                lm.train()
                new = torch.log_softmax(lm(seqs, attention_mask=attn).logits[:, :-1], -1).gather(
                    -1, seqs[:, 1:, None]).squeeze(-1)
                mask = attn[:, 1:].float()
                mask[:, :enc["input_ids"].shape[1] - 1] = 0
                ratio = (new - old).exp()
                pg = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.2))
                loss = (pg * mask).sum() / mask.sum()
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
                opt.step()
        if step > warmup:
            out.append(timer.times | {"samples": float(seqs.shape[0])})
    return out


def summary(name: str, rows: list[dict[str, float]]) -> dict[str, float]:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"\n{name}: median over {len(rows)} steps")
    for k in sorted(k for k in med if k.startswith("timing/")):
        stage = k.removeprefix("timing/")
        print(f"  {stage:<14} wall {med[k]:7.3f} s   cpu {med.get('timing_cpu/' + stage, float('nan')):7.3f} s")
    med["samples_per_cpu_s"] = med["samples"] / med["timing_cpu/step"]
    print(f"  samples per CPU-second: {med['samples_per_cpu_s']:.1f}")
    return med


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    from hybridrl.bootstrap import TINY_MODEL, write_arithmetic_task
    from hybridrl.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = make_tiny_model(tmp / "model", **TINY_MODEL)  # type: ignore[arg-type]
        write_arithmetic_task(tmp / "train.parquet")
        t0 = time.perf_counter()
        ours = summary("hybridrl", hybridrl_steps(tmp, model, tmp / "train.parquet", args.steps, args.warmup))
        base = summary("baseline (transformers + AdamW)", baseline_steps(model, tmp / "train.parquet", args.steps,
                                                                         args.warmup))
        print(f"\nratio hybridrl / baseline, median step: wall {ours['timing/step'] / base['timing/step']:.2f}x, "
              f"cpu {ours['timing_cpu/step'] / base['timing_cpu/step']:.2f}x "
              f"(bench took {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
