"""The ``hybridrl`` command. Each subcommand's work lives in its own module, imported only when run,
so ``hybridrl plugins`` or ``hybridrl validate`` never pay for importing torch or Megatron."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path


def _plugins(args: argparse.Namespace) -> int:
    from hybridrl.registry import all_entries, format_plugin_table

    print(format_plugin_table(all_entries()))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from hybridrl.config.offline_plan import main as offline_dry_run
    from hybridrl.config.offline_plan import trainer_of

    if (kind := trainer_of(args.overrides, args.trainer)) != "rl":
        if args.get or args.teacher_config:
            print(f"hybridrl validate: --get and --teacher-config are for RL recipes, not a {kind} one",
                  file=sys.stderr)
            return 2
        return offline_dry_run(kind, args.overrides, world_size=args.world_size, model_config=args.model_config)
    from hybridrl.config.dry_run import main as dry_run

    if not args.get:
        return dry_run(args.overrides, world_size=args.world_size, model_config=args.model_config,
                       teacher_config=args.teacher_config)
    from hybridrl.config.overrides import key_problem, schema_keys
    from hybridrl.config.schema import RLConfig
    from hybridrl.config.verl_keys import VERL_KEYS, lookup

    for key in args.get:  # a schema key, one inside a plugin block, or verl's
        if key_problem(RLConfig, key) is not None and lookup(key) is None:
            keys = [*schema_keys(RLConfig), *VERL_KEYS]
            close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
            print(f"hybridrl validate: --get {key!r} is not a config key"
                  + (f"; did you mean {' or '.join(close)}?" if close else " (see hybridrl/config/schema.py)"),
                  file=sys.stderr)
            return 2
    return dry_run(args.overrides, world_size=args.world_size, model_config=args.model_config, get=args.get,
                   teacher_config=args.teacher_config)


def _make_tiny_model(args: argparse.Namespace) -> int:
    if args.arch in ("qwen2_5_vl", "qwen3_vl"):
        from hybridrl.models.tiny_vlm import main as make_tiny_vlm

        return make_tiny_vlm(args)
    from hybridrl.models.tiny import main as make_tiny

    return make_tiny(args)


def _verify_model(args: argparse.Namespace) -> int:
    from hybridrl.megatron.verify import main as verify

    return verify(args)


def _export_hf(args: argparse.Namespace) -> int:
    from hybridrl.checkpoint.export import main as export

    return export(args)


def _prepare(args: argparse.Namespace) -> int:
    from hybridrl.data.prepare import main as prepare

    return prepare(args)


def _report(args: argparse.Namespace) -> int:
    from hybridrl.report import main as report

    return report(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridrl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("plugins", help="list every installed plugin: group, name, distribution, version")
    sp.set_defaults(fn=_plugins)

    sp = sub.add_parser(
        "validate",
        help="compose a recipe, check it statically and print the resolved topology (loads no weights)",
    )
    sp.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. recipe=grpo_tiny trainer.seed=3")
    sp.add_argument("--world-size", type=int, default=None,
                    help="ranks to plan for (default: trainer.nnodes × trainer.n_gpus_per_node)")
    sp.add_argument("--model-config", type=Path, default=None,
                    help="plan for another machine: read the architecture from this config.json and skip "
                         "the checks of local weights, tokenizer and data files (e.g. recipes/model_configs/*.json)")
    sp.add_argument("--teacher-config", type=Path, default=None,
                    help="with --model-config: the distillation teacher's config.json (default: its checkpoint's "
                         "when it is here, else the student's architecture)")
    sp.add_argument("--get", action="append", default=[], metavar="KEY",
                    help="after the checks pass, print KEY's resolved value (e.g. trainer.dist_timeout_s, or a verl "
                         "key such as actor_rollout_ref.actor.clip_ratio_low) on stdout, one line per --get, and the "
                         "plan on stderr (for launch scripts)")
    sp.add_argument("--trainer", choices=["rl", "sft", "dpo", "rm"], default=None,
                    help="which launcher the recipe is for: launch/train.py (rl), sft.py, dpo.py, rm.py (default: by "
                         "the recipe's name, sft_*, dpo_*, rm_*, else rl)")
    sp.set_defaults(fn=_validate)

    sp = sub.add_parser("make-tiny-model", help="write a random-weight HF checkpoint with a char tokenizer")
    sp.add_argument("out", help="output directory")
    sp.add_argument("--arch", choices=["qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe",
                                       "deepseek_v3", "qwen2_5_vl", "qwen3_vl"],
                    default="qwen2",
                    help="the MoE families get 4 experts, top-2, moe_intermediate_size = hidden (tiny.MOE_DEFAULTS; "
                         "mixtral: experts of --intermediate, tiny.MIXTRAL_DEFAULTS; glm4_moe: tiny.GLM4_MOE_DEFAULTS; "
                         "deepseek_v3: tiny.DEEPSEEK_V3_DEFAULTS); qwen2_5_vl / qwen3_vl: the text model of these "
                         "sizes (qwen3_vl: a qwen3) with tiny_vlm's vision tower and processor")
    sp.add_argument("--moe", action="append", default=[], metavar="KEY=VALUE",
                    help="an MoE family's config.json key over its defaults, VALUE read as JSON (repeatable), e.g. "
                         "--moe use_qk_norm=true --moe n_group=4 --moe q_lora_rank=null")
    sp.add_argument("--hidden", type=int, default=128)
    sp.add_argument("--layers", type=int, default=4)
    sp.add_argument("--heads", type=int, default=4)
    sp.add_argument("--kv-heads", type=int, default=2)
    sp.add_argument("--intermediate", type=int, default=None, help="MLP size (default: 3 × hidden)")
    sp.add_argument("--vocab", default="chars",
                    help="'chars' (char tokenizer, vocab = its size) or an int ≥ the char vocab (padded)")
    sp.add_argument("--max-positions", type=int, default=512)
    sp.add_argument("--tie", dest="tie", action="store_true", default=True, help="tie embeddings (default)")
    sp.add_argument("--no-tie", dest="tie", action="store_false")
    sp.add_argument("--seed", type=int, default=0)
    sp.set_defaults(fn=_make_tiny_model)

    sp = sub.add_parser(
        "verify-model",
        help="build the Megatron model from an HF checkpoint, compare logits with transformers, "
        "and check the HF->Megatron->HF round trip is bitwise",
    )
    sp.add_argument("model_dir", nargs="+",
                    help="HF checkpoint dir(s); several are checked in one launch of the ranks")
    sp.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    sp.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    sp.add_argument("--vpp", type=int, default=None,
                    help="virtual pipeline size: model chunks per stage (interleaved schedule; needs --pp ≥ 2)")
    sp.add_argument("--ep", type=int, default=1,
                    help="expert parallel size (MoE models: the experts split over this many ranks)")
    sp.add_argument("--etp", type=int, default=None,
                    help="expert tensor parallel size (each expert's matrices split over this many ranks; "
                         "default: --tp). Below --tp, EP spans the TP ranks (verl's TP=2, EP=8, ETP=1)")
    sp.add_argument("--first-stage-layers", type=int, default=None,
                    help="layers on the first pipeline stage (uneven split, Megatron's "
                         "num_layers_in_first_pipeline_stage); the stages after it share the rest equally")
    sp.add_argument("--last-stage-layers", type=int, default=None,
                    help="layers on the last pipeline stage (Megatron's num_layers_in_last_pipeline_stage)")
    sp.add_argument("--tolerance", type=float, default=1e-4, help="max |logit diff| allowed (fp32)")
    sp.add_argument("--seq-len", type=int, default=16)
    sp.add_argument("--batch", type=int, default=2)
    sp.add_argument("--timeout-s", type=float, default=900.0,
                    help="stop the verification ranks (all of them) after this many seconds (default 900)")
    sp.add_argument("--bucket-bytes", type=int, default=32 << 20,
                    help="size bound of the weight-export buckets checked by the round trip")
    sp.set_defaults(fn=_verify_model)

    sp = sub.add_parser("export-hf", help="write a training checkpoint's actor as an HF checkpoint")
    sp.add_argument("ckpt", help="<trainer.output_dir>/checkpoints/step_<k>")
    sp.add_argument("out", help="output directory (written atomically); must be new, empty, or an earlier export "
                                "to the same path, and outside CKPT")
    sp.add_argument("--overwrite", action="store_true",
                    help="replace OUT even if it holds other files (they are deleted once the export is in place)")
    kind = sp.add_mutually_exclusive_group()
    kind.add_argument("--merged", dest="adapter", action="store_false",
                      help="full HF weights (the default); a LoRA checkpoint's adapters merged: W + (alpha/r)·B·A")
    kind.add_argument("--adapter", dest="adapter", action="store_true",
                      help="a LoRA checkpoint's adapters as a peft folder (adapter_config.json + "
                           "adapter_model.safetensors) for the base model it names")
    sp.set_defaults(fn=_export_hf, adapter=False)

    sp = sub.add_parser(
        "prepare",
        help="write a task's data as OUT_DIR/train.parquet and test.parquet in the row layout data.train_files "
        "reads (prompt, ground_truth, data_source, the source's other columns)",
    )
    sp.add_argument("task", choices=["gsm8k", "math", "jsonl", "multimodal", "preference"],
                    help="gsm8k (question, answer ending '#### N'), math (problem, solution with \\boxed{}, or "
                         "MATH-500's answer column), jsonl (your rows: --question-key, --answer-key), multimodal "
                         "(geo3k-style rows: problem with one <image> per image, answer, images; written with the "
                         "image bytes), preference "
                         "(DPO pairs: prompt (--question-key), chosen, rejected; written instead of ground_truth)")
    sp.add_argument("out_dir", help="output directory; must be new or empty unless --overwrite")
    sp.add_argument("--from", dest="sources", action="append", metavar="[train=|test=]SOURCE",
                    help="a .jsonl/.parquet file in the dataset's own format or hf://NAME[:CONFIG][:SPLIT]; repeat to "
                         "concatenate; no prefix: train. Without --from: the task's public dataset (needs network)")
    sp.add_argument("--test-size", default=None, metavar="N|FRACTION",
                    help="no test source: split this many train rows (or this fraction) off as the test split")
    sp.add_argument("--seed", type=int, default=0, help="seed of the --test-size split")
    template = sp.add_mutually_exclusive_group()
    template.add_argument("--template", default=None,
                          help="instruction with a {question} placeholder (default: verl's for gsm8k and math, none "
                               "for jsonl)")
    template.add_argument("--no-template", action="store_true", help="the prompt is the raw question")
    sp.add_argument("--prompt-format", choices=["chat", "text"], default="chat",
                    help="chat: [{role: user, content: ...}] (default); text: a plain string")
    sp.add_argument("--question-key", default=None,
                    help="question column (default: question; math, multimodal: problem)")
    sp.add_argument("--answer-key", default=None, help="answer column (default: answer; math: solution)")
    sp.add_argument("--data-source", default=None,
                    help="the rows' data_source (default: the task name; jsonl, multimodal: the first source's stem)")
    sp.add_argument("--images-key", default="images",
                    help="multimodal: the column holding a row's images (paths, relative to the source file, or "
                         "{bytes}/{path} entries); default: images")
    sp.add_argument("--hf-name", default=None,
                    help="dataset loaded without --from (default: openai/gsm8k, DigitalLearningGmbH/MATH-lighteval); "
                         "a hub id or a local dataset directory")
    sp.add_argument("--hf-config", default=None, help="its config (default: main for openai/gsm8k)")
    sp.add_argument("--skip-bad", action="store_true",
                    help="skip rows whose final answer cannot be extracted (counted in a warning) instead of failing")
    sp.add_argument("--overwrite", action="store_true",
                    help="write into a non-empty OUT_DIR (replaces train.parquet and test.parquet)")
    sp.set_defaults(fn=_prepare)

    sp = sub.add_parser(
        "report",
        help="draw runs' curves (reward, eval pass@k, KL, entropy, lengths, time split, tokens/s) from their "
        "metrics.jsonl into one self-contained HTML page or PNGs; several runs are overlaid (needs hybridrl[report])",
    )
    sp.add_argument("runs", nargs="+", metavar="RUN",
                    help="a run's trainer.output_dir (its metrics.jsonl) or a metrics file (e.g. an earlier run's "
                         "metrics.<time>.jsonl); a run still going is fine")
    sp.add_argument("--out", default="report.html",
                    help="FILE.html: one page with the figures embedded (default report.html); DIR: one PNG per "
                         "figure; FILE.png: the one figure chosen with --figures")
    sp.add_argument("--name", action="append", default=None,
                    help="a run's name in the legends, once per RUN in order (default: its directory's name)")
    sp.add_argument("--figures", default=None,
                    help="comma-separated subset: overview, reward, eval, policy, rollout, critic, time, sft "
                         "(default: all that the runs have data for)")
    sp.add_argument("--smooth", type=float, default=0.6,
                    help="EMA weight of per-step curves in [0, 1), drawn over the faint raw curve (0: raw only)")
    sp.set_defaults(fn=_report)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "validate":  # Hydra overrides may follow the options
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
