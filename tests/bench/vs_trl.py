"""Benchmark: hybridrl against TRL's ``GRPOTrainer`` on the same work, samples per CPU-second and peak RSS.

    python tests/bench/vs_trl.py [--workloads w1 w2] [--steps 8] [--warmup 2] [--w2-steps 2] [--eval]

Both sides start from the same HF checkpoint and prompts, with the same batch shape and the same
objective: GRPO advantages (group mean/std), PPO-clip ε = 0.2 with token-mean aggregation over the
step (TRL ``loss_type=dapo``), no KL (``beta=0``), one optimizer step per RL step
(``num_iterations=1``, one mini-batch), AdamW lr 1e-4 constant, clip-grad 1.0, fp32, temperature 1,
no eval inside the timed steps.

- **W1**: the grpo_tiny start model (the SFT warm start ``hybridrl/bootstrap.py`` builds: hidden 128,
  4 layers, char vocabulary) on its arithmetic parquet; 16 prompts × 8 samples, ≤ 8 new tokens.
- **W2**: a ~4× wider model (hidden 512, 8 layers), 32 prompts × 8, responses from a few tokens to 256
  with a long tail (:mod:`w2_task`: a random start whose lengths are forced by its stop ids — no SFT).

hybridrl runs its real loop (``trainer.fit``: hf engine → reward → [old log-probs] → GRPO → Megatron
update → in-place weight sync), TRL its real ``train()``. Each side is its own process with 1 torch
thread, both started at once so they see the same machine state (the cores here are shared); each
step is timed in wall and CPU seconds of its process (``time.process_time``; per step, warm-up steps
dropped; medians), plus each process's peak RSS (``getrusage``, children included). hybridrl's per-stage
split comes from its own ``timing_cpu/*`` metrics. ``--eval``: greedy accuracy on the held-out split
after training, the same code on both sides (W1 only: W2's reward is a keyword, not a task).
The last line is the ratio. Without TRL installed (``pip install -e '.[bench]'``) it says so and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).parent
LR, SEED = 1e-4, 1


@dataclass(frozen=True, kw_only=True)
class Workload:
    prompts: int
    n: int
    max_new_tokens: int
    reward: str  # "arithmetic" | "keyword"
    hybridrl_overrides: list[str] = field(default_factory=list)


WORKLOADS = {
    # hybridrl's defaults: packed rows, and (use_prefix_grouper null: on here) a prompt's 8 samples after one copy of
    # the prompt — prompts are ~2× as long as the answers here
    "w1": Workload(prompts=16, n=8, max_new_tokens=8, reward="arithmetic"),
    # token-budget micro-batches (use_dynamic_bsz): the long tail does not pad every row to 256
    "w2": Workload(prompts=32, n=8, max_new_tokens=256, reward="keyword", hybridrl_overrides=[
        "reward.name=keyword", "+reward.kwargs.keywords=['7']", "+reward.kwargs.mode=any",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048"]),
}


def peak_rss_mib() -> float:
    """Peak resident set of this process and of its largest waited-for child (KiB on Linux)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def cpu_s() -> float:
    """CPU seconds of this process (all threads) and its waited-for children."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


# ---- the two sides (each runs in its own process: ``--side``) ----

def _composes(compose_config: Callable[[list[str]], object], override: str) -> bool:
    from hybridrl.config.errors import ConfigError

    try:
        compose_config(["recipe=grpo_tiny", override])
    except ConfigError:
        return False
    return True


def run_hybridrl(wl: Workload, model: Path, train: Path, out: Path, steps: int, before: bool = False) -> dict:
    from hybridrl.config.compose import compose_config
    from hybridrl.config.validate import validate
    from hybridrl.megatron.parallel import destroy_parallel
    from hybridrl.trainers.components import build_components
    from hybridrl.trainers.rl import fit

    B = wl.prompts * wl.n
    overrides = wl.hybridrl_overrides
    if before:  # an older tree may not know a key this one turns on: run it without, and say so
        overrides = [o for o in overrides if _composes(compose_config, o)]
        for dropped in sorted(set(wl.hybridrl_overrides) - set(overrides)):
            print(f"before: {dropped} dropped (not a key of that tree)", flush=True)
    cfg = compose_config([
        "recipe=grpo_tiny", f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.build_if_missing=null",
        f"data.train_files=[{train}]", "data.val_files=[]", "data.build_if_missing=null",
        f"data.train_batch_size={wl.prompts}", f"data.max_response_length={wl.max_new_tokens}",
        f"actor_rollout_ref.rollout.n={wl.n}", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.actor.use_kl_loss=false", f"actor_rollout_ref.actor.ppo_mini_batch_size={wl.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={B}", "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={B}", f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "algorithm.use_kl_in_reward=false",
        "trainer.logger=[jsonl]", f"trainer.output_dir={out}", f"trainer.total_training_steps={steps}",
        "trainer.test_freq=0", "trainer.val_before_train=false", f"trainer.seed={SEED}", *overrides])
    c = build_components(cfg, validate(cfg, world_size=1))
    try:
        fit(c)
        weights = {k: v.clone() for b in c.hybrid.actor.export_weights(bucket_bytes=1 << 26) for k, v in b}
    finally:
        c.close()
        destroy_parallel()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per_step = [{"wall": r["timing/step"], "cpu": r["timing_cpu/step"], "samples": B,
                 "score": r["reward/mean"], "response_len": r["response/length_mean"],
                 "old_logprob_pass": r.get("actor/old_logprob_pass", 1.0),
                 **{k.removeprefix("timing_cpu/"): v for k, v in r.items() if k.startswith("timing_cpu/")}}
                for r in rows]
    return {"steps": per_step, "weights": weights}


def run_trl(wl: Workload, model: Path, train: Path, out: Path, steps: int) -> dict:
    import pandas as pd
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from w2_task import keyword_reward

    from hybridrl.hf.arch import eos_token_ids

    def arithmetic_reward(completions: list[str], ground_truth: list[str], **_: object) -> list[float]:
        return [float(c.strip() == g.strip()) for c, g in zip(completions, ground_truth, strict=True)]

    per_step: list[dict] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *_: object, **__: object) -> None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *_: object, **__: object) -> None:
            per_step.append({"wall": time.perf_counter() - self.t0, "cpu": time.process_time() - self.c0,
                             "samples": wl.prompts * wl.n})

        def on_log(self, _args: object, _state: object, _control: object, logs: dict | None = None,
                   **__: object) -> None:
            if logs and "reward" in logs and per_step:
                per_step[-1]["score"] = logs["reward"]
                per_step[-1]["response_len"] = logs.get("completions/mean_length", float("nan"))

    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=wl.prompts * wl.n, num_generations=wl.n,
        max_completion_length=wl.max_new_tokens, loss_type="dapo", beta=0.0, num_iterations=1, epsilon=0.2,
        scale_rewards="group", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, bf16=False, fp16=False, use_cpu=True, report_to=[], logging_steps=1,
        save_strategy="no", max_steps=steps, temperature=1.0, top_p=1.0, top_k=0, seed=SEED,
        generation_kwargs={"eos_token_id": eos_token_ids(model)}, dataloader_num_workers=0,
        log_completions=False, disable_tqdm=True)
    rows = pd.read_parquet(train)[["prompt", "ground_truth"]]
    trainer = GRPOTrainer(model=lm, reward_funcs=arithmetic_reward if wl.reward == "arithmetic" else keyword_reward,
                          args=args, train_dataset=Dataset.from_pandas(rows), processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    return {"steps": per_step, "weights": {k: v.detach().clone() for k, v in lm.state_dict().items()}}


def heldout_accuracy(model: Path, weights: dict, test: Path) -> float:
    """Greedy accuracy on the held-out arithmetic split of ``model`` with ``weights`` (HF names)."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.hf.arch import eos_token_ids

    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    missing, unexpected = lm.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    rows = pd.read_parquet(test)
    enc = tok(list(rows["prompt"]), return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        seqs = lm.generate(**enc, do_sample=False, max_new_tokens=8, eos_token_id=eos_token_ids(model),
                           pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(seqs[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(t.strip() == g.strip() for t, g in zip(texts, rows["ground_truth"], strict=True)) / len(rows)


def side_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    wl = WORKLOADS[args.workload]
    out = Path(args.out)
    t0 = cpu_s()
    paths = (Path(args.model), Path(args.train), out / args.side, args.steps + args.warmup)
    result = (run_trl(wl, *paths) if args.side == "trl"
              else run_hybridrl(wl, *paths, before=args.side == "before"))
    steps = result["steps"][args.warmup:]
    summary = {"steps": steps, "process_cpu_s": cpu_s() - t0, "peak_rss_mib": peak_rss_mib()}
    if args.test:
        summary["heldout_accuracy"] = heldout_accuracy(Path(args.model), result["weights"], Path(args.test))
    (out / f"{args.side}.json").write_text(json.dumps(summary))


# ---- the driver ----

def prepare(workload: str, tmp: Path) -> tuple[Path, Path, Path | None]:
    """``(start model, train parquet, held-out parquet or None)`` of a workload."""
    from hybridrl.bootstrap import ensure_data, ensure_model
    from hybridrl.paths import cache_dir

    tiny = Path(cache_dir()) / "tiny"
    train, test = tiny / "arithmetic" / "train.parquet", tiny / "arithmetic" / "test.parquet"
    ensure_data("arithmetic", [str(train)], [str(test)])
    if workload == "w1":
        model = tiny / "sft-qwen2"
        ensure_model("sft:sft_tiny", str(model))  # grpo_tiny's warm start (built once, cached)
        return model, train, test
    sys.path.insert(0, str(HERE))
    from w2_task import make_w2_model

    return make_w2_model(tmp / "w2-model"), train, None


def median(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")


def report(workload: str, ours: dict, trl: dict, before: dict | None = None) -> float:
    o, t = ours["steps"], trl["steps"]
    o_rate, t_rate = median(o, "samples") / median(o, "cpu"), median(t, "samples") / median(t, "cpu")
    not_stages = {"wall", "cpu", "samples", "score", "response_len", "step", "old_logprob_pass"}
    stages = sorted({k for r in o + (before["steps"] if before else []) for k in r} - not_stages)
    print(f"\n== {workload}: medians over {len(o)} (hybridrl) / {len(t)} (TRL) timed steps ==")
    print(f"{'':10} {'CPU s/step':>11} {'wall s/step':>12} {'samples/CPU-s':>14} {'peak RSS MiB':>13} "
          f"{'reward':>7} {'resp len':>9}")
    sides = [("hybridrl", o, o_rate, ours), ("TRL", t, t_rate, trl)]
    if before is not None:
        b = before["steps"]
        sides.append(("before", b, median(b, "samples") / median(b, "cpu"), before))
    for name, rows, rate, res in sides:
        print(f"{name:10} {median(rows, 'cpu'):11.3f} {median(rows, 'wall'):12.3f} {rate:14.1f} "
              f"{res['peak_rss_mib']:13.0f} {median(rows, 'score'):7.3f} {median(rows, 'response_len'):9.1f}")
    for name, rows, _, _ in sides[:1] + sides[2:]:
        split = ", ".join(f"{s} {median(rows, s):.3f}" for s in stages if s != "step")
        print(f"{name} CPU s per stage: {split}; old-log-prob pass ran: {median(rows, 'old_logprob_pass'):.0f}")
    if "heldout_accuracy" in ours:
        print(f"held-out greedy accuracy after the run: hybridrl {ours['heldout_accuracy']:.3f}, "
              f"TRL {trl['heldout_accuracy']:.3f}")
    ratio = o_rate / t_rate
    print(f"{workload} ratio hybridrl / TRL, samples per CPU-second: {ratio:.2f}x; "
          f"peak RSS {ours['peak_rss_mib']:.0f} vs {trl['peak_rss_mib']:.0f} MiB")
    return ratio


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["w1", "w2"], choices=sorted(WORKLOADS))
    p.add_argument("--steps", type=int, default=8, help="timed RL steps per side (W2: --w2-steps)")
    p.add_argument("--w2-steps", type=int, default=2, help="timed RL steps per side on W2 (CPU-minutes each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps per side (W1; W2: --w2-warmup)")
    p.add_argument("--w2-warmup", type=int, default=0, help="untimed first W2 steps (its one-time costs are "
                   "seconds against ~100 CPU-s per step)")
    p.add_argument("--eval", action="store_true", help="W1: held-out greedy accuracy after training, both sides")
    p.add_argument("--before", metavar="SRC", help="also run the hybridrl of this source tree (e.g. `git archive "
                   "HEAD | tar -x -C SRC`) as a third process: the before/after split in one run")
    p.add_argument("--side", choices=["hybridrl", "trl", "before"], help=argparse.SUPPRESS)
    for hidden in ("--workload", "--model", "--train", "--test", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        side_main(args)
        return 0
    try:
        import trl
    except ImportError:
        print("vs_trl: skipped — TRL is not installed (pip install -e '.[bench]' installs trl==1.16.0)")
        return 0
    print(f"hybridrl vs TRL {trl.__version__}, 1 torch thread per side, both sides at once")
    ratios = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for workload in args.workloads:
            model, train, test = prepare(workload, tmp)
            steps, warmup = (args.steps, args.warmup) if workload == "w1" else (args.w2_steps, args.w2_warmup)
            out = tmp / workload
            out.mkdir()
            t0 = time.perf_counter()
            procs = {}
            for side in ("hybridrl", "trl") + (("before",) if args.before else ()):
                cmd = [sys.executable, __file__, "--side", side, "--workload", workload, "--model", str(model),
                       "--train", str(train), "--out", str(out), "--steps", str(steps), "--warmup", str(warmup)]
                if args.eval and test is not None:
                    cmd += ["--test", str(test)]
                log = (out / f"{side}.log").open("w")
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([args.before, os.environ.get("PYTHONPATH", "")])
                       } if side == "before" else None
                procs[side] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
            for side, (proc, log) in procs.items():
                if proc.wait() != 0:
                    log.close()
                    print((out / f"{side}.log").read_text()[-6000:])
                    raise SystemExit(f"vs_trl: the {side} side of {workload} failed (its log is above)")
                log.close()
            results = {side: json.loads((out / f"{side}.json").read_text()) for side in procs}
            print(f"({workload}: both sides took {time.perf_counter() - t0:.0f} s)")
            ratios[workload] = report(workload, results["hybridrl"], results["trl"], results.get("before"))
    print("\nsamples per CPU-second, hybridrl / TRL: " + ", ".join(f"{w} {r:.2f}x" for w, r in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
