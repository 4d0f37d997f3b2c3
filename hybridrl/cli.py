"""The ``hybridrl`` command. Each subcommand's work lives in its own module, imported only when run,
so ``hybridrl plugins`` or ``hybridrl validate`` never pay for importing torch or Megatron."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _plugins(args: argparse.Namespace) -> int:
    from hybridrl.registry import all_entries, format_plugin_table

    print(format_plugin_table(all_entries()))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from hybridrl.config.dry_run import main as dry_run

    return dry_run(args.overrides, world_size=args.world_size, model_config=args.model_config)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from hybridrl.models.tiny import main as make_tiny

    return make_tiny(args)


def _verify_model(args: argparse.Namespace) -> int:
    from hybridrl.megatron.verify import main as verify

    return verify(args)


def _export_hf(args: argparse.Namespace) -> int:
    from hybridrl.export import main as export

    return export(args)


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
    sp.set_defaults(fn=_validate)

    sp = sub.add_parser("make-tiny-model", help="write a random-weight HF checkpoint with a char tokenizer")
    sp.add_argument("out", help="output directory")
    sp.add_argument("--arch", choices=["qwen2", "qwen3", "llama"], default="qwen2")
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
    sp.set_defaults(fn=_export_hf)
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
