"""Build what a recipe needs but nobody has yet: synthetic data and start models (no model hub here).

``data.build_if_missing: arithmetic`` writes the arithmetic task's splits to ``data.train_files[0]``
(and ``data.val_files[0]``), ``arithmetic_preference`` the same problems as DPO pairs; ``gsm8k_tiny``
writes synthetic word problems in GSM8K's own format (:mod:`hybridrl.data.synthetic_gsm8k`) and
prepares them as ``hybridrl prepare gsm8k --from`` does.
``model.build_if_missing: tiny`` writes a random tiny model (the architecture below) with a char
tokenizer, ``tiny_bpe`` the same with a byte-level BPE tokenizer trained here on the synthetic GSM8K
text (:mod:`hybridrl.models.bpe_tokenizer`), ``tiny_moe`` a random tiny Qwen3-MoE with the char tokenizer
(``grpo_moe_tiny``'s), ``tiny_deepseek_v3`` a random tiny DeepSeek-V3 with it (``grpo_deepseek_v3_tiny``'s),
``tiny_vlm`` a random tiny Qwen2.5-VL with its processor (``grpo_vlm_tiny``'s; ``data.build_if_missing: dots`` its
image task), ``tiny_qwen3_vl`` a random tiny Qwen3-VL of the same sizes, and
``sft:<recipe>`` runs that SFT recipe with
``trainer.save_path`` set to the model path. It builds only inside the hybridrl cache
(``$HYBRIDRL_CACHE_DIR``, default ``~/.cache/hybridrl``), where the tiny recipes point: a path elsewhere
that does not exist is the user's (a typo, a model not downloaded yet) and is reported as a config error
naming its key, never filled with a toy model.
Results are cached: a path that exists is used as is, except a model this module built
from an SFT recipe that has changed since (``hybridrl_build.json`` records a hash of the recipe and
of the tiny-model/task settings below): that one is rebuilt, so a cached warm start never silently
comes from an older recipe. Delete a folder in the cache to rebuild it.

Only global rank 0 builds (under a file lock, so two runs never build the same thing at once);
other ranks wait for the result. Every build writes to a temporary path and renames it into place.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from hybridrl.config.errors import UserError
from hybridrl.paths import cache_dir, in_cache, recipes_dir
from hybridrl.tracking import say

if TYPE_CHECKING:
    from hybridrl.data.rows import Row

TINY_MODEL = dict(arch="qwen2", hidden=128, layers=4, heads=4, kv_heads=2, max_positions=256, tie=True, seed=0)
# grpo_moe_tiny's: TINY_MODEL's shape with a Qwen3-MoE MLP (8 experts of 128, top-2 renormalised) in every layer
TINY_MOE_MODEL = {**TINY_MODEL, "arch": "qwen3_moe",
                  "moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)}
# grpo_deepseek_v3_tiny's: TINY_MODEL's width and depth with every DeepSeek-V3 feature (tiny.DEEPSEEK_V3_DEFAULTS):
# multi-latent attention with a query LoRA (q_lora_rank 32, kv_lora_rank 24; heads of nope 16 + rope 8, values 16),
# layer 0 dense (first_k_dense_replace 1), then 8 routed experts of 128 in 2 groups of which 1 is chosen (n_group,
# topk_group), sigmoid scores with e_score_correction_bias, top-2 renormalised × routed_scaling_factor 2.5, a shared
# expert; untied embeddings, as DeepSeek-V3's
TINY_DEEPSEEK_V3_MODEL = {**TINY_MODEL, "arch": "deepseek_v3", "tie": False, "moe": dict(moe_intermediate_size=128)}
# grpo_vlm_tiny's: a random tiny Qwen2.5-VL (hybridrl.models.tiny_vlm: TINY_MODEL's language model, its default
# vision tower of depth 2, hidden 64) and the dots-counting task (hybridrl.data.dots; 56 × 56 images, 4 image tokens)
TINY_VLM_MODEL = {k: v for k, v in TINY_MODEL.items() if k not in ("arch", "max_positions")}
DOTS = dict(num_train=4000, num_test=200, min_dots=1, max_dots=9, seed=0)
ARITHMETIC = dict(min_digits=1, max_digits=2, operators=["+"], num_train=4000, num_test=200, seed=0)
GSM8K_TINY = dict(num_train=2000, num_test=64, seed=0)
TINY_BPE = dict(vocab_size=512, corpus_rows=2000, seed=0)  # BPE trained on this many synthetic GSM8K rows
BUILD_INFO = "hybridrl_build.json"  # in a model folder this module built: what it was built from
DATA_BUILD_INFO = "hybridrl_build.json"  # beside a data file this module built (".<stem>.hybridrl_build.json")
_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_USE_AGENT_STORE",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE")


DATA_KINDS = ("arithmetic", "arithmetic_preference", "gsm8k_tiny", "products", "arithmetic_tool_sft", "dots")
# each random start model's make_tiny_model arguments (tiny_bpe: TINY_MODEL's, with a BPE tokenizer trained here)
RANDOM_MODELS = {"tiny": TINY_MODEL, "tiny_bpe": TINY_MODEL, "tiny_moe": TINY_MOE_MODEL,
                 "tiny_deepseek_v3": TINY_DEEPSEEK_V3_MODEL, "tiny_vlm": TINY_VLM_MODEL,
                 "tiny_qwen3_vl": TINY_VLM_MODEL}
MODEL_KINDS = (*RANDOM_MODELS, "sft:<recipe>")


class WarmStartError(UserError):
    """A start model's SFT build ended without a model (e.g. its ``trainer.target_accuracy`` not reached)."""


def kind_problem(kind: str | None, *, model: bool) -> str | None:
    """Why ``build_if_missing=kind`` is not a known build (None: it is, or nothing is to be built)."""
    if kind is None:
        return None
    known = (kind in RANDOM_MODELS or kind.startswith("sft:")) if model else kind in DATA_KINDS
    return None if known else f"valid: {', '.join(MODEL_KINDS if model else DATA_KINDS)} (or null)"


def will_build(kind: str | None, path: str, *, model: bool) -> bool:
    """``build_if_missing`` will build ``path``: a known build, a missing path, inside the cache."""
    return kind is not None and kind_problem(kind, model=model) is None and not Path(path).exists() and in_cache(path)


def outside_cache_problem(kind: str | None, path: str) -> str | None:
    """The hint for a missing ``path`` that ``build_if_missing`` will not build because it is not in the cache."""
    if kind is None or Path(path).exists() or in_cache(path):
        return None
    return (f"does not exist, and build_if_missing={kind} builds only inside the hybridrl cache {cache_dir()} "
            "($HYBRIDRL_CACHE_DIR), never at a path of yours; point it at an existing file/checkpoint")


def ensure_data(kind: str | None, train_files: list[str], val_files: list[str]) -> None:
    if kind is None:
        return
    if (problem := kind_problem(kind, model=False)) is not None:
        raise ValueError(f"data.build_if_missing={kind!r}: {problem}")
    if not train_files:
        raise ValueError(f"data.build_if_missing={kind} needs data.train_files to name the file to write")
    targets = [Path(train_files[0])] + ([Path(val_files[0])] if val_files else [])
    for key, path in zip(("data.train_files", "data.val_files"), targets, strict=False):
        if (problem := outside_cache_problem(kind, str(path))) is not None:
            raise ValueError(f"{key}: {path}: {problem}")
    write = _data_writers()[kind]
    key = _data_build_key(kind)
    info = targets[0].with_name(f".{targets[0].stem}.{DATA_BUILD_INFO}")

    def build() -> None:
        write(*targets)
        info.write_text(json.dumps({"kind": kind, "key": key}) + "\n")

    # rebuilt when its generator changed (a file without build info is the user's: kept)
    _once(targets, build, lambda: not all(p.exists() for p in targets) or _stale_info(info, key))


def _data_writers() -> dict[str, Callable[..., None]]:
    return {"arithmetic": write_arithmetic_task, "arithmetic_preference": write_arithmetic_preference,
            "gsm8k_tiny": write_gsm8k_tiny_task, "products": write_products_task,
            "arithmetic_tool_sft": write_tool_sft_task, "dots": write_dots_task}


def _data_build_key(kind: str) -> str:
    """Hash of what a built data kind depends on: its writer and the modules that generate its rows."""
    sources = [inspect.getsource(_data_writers()[kind]), f"{ARITHMETIC}{GSM8K_TINY}"]
    if kind in ("products", "arithmetic_tool_sft"):
        sources.append(inspect.getsource(importlib.import_module("hybridrl.data.tool_arithmetic")))
    if kind == "dots":
        sources += [f"{DOTS}", inspect.getsource(importlib.import_module("hybridrl.data.dots"))]
    return hashlib.sha256("\n".join(sources).encode()).hexdigest()[:16]


def write_arithmetic_task(train: Path, test: Path | None = None) -> None:
    """The tiny recipes' arithmetic splits (``ARITHMETIC``) at ``train`` (and ``test``), each written atomically."""
    from hybridrl.data.arithmetic import ArithmeticTaskConfig, arithmetic_splits
    from hybridrl.data.rows import write_rows

    targets = [Path(train)] + ([Path(test)] if test is not None else [])
    say(f"writing the arithmetic task ({ARITHMETIC}) to {', '.join(map(str, targets))}")
    for rows, path in zip(arithmetic_splits(ArithmeticTaskConfig(**ARITHMETIC)), targets, strict=False):
        tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
        write_rows(rows, tmp)
        tmp.rename(path)


def write_products_task(train: Path, test: Path | None = None) -> None:
    """2-digit products (:data:`hybridrl.data.tool_arithmetic.PRODUCTS`): ``grpo_tool_tiny``'s task."""
    from hybridrl.data.tool_arithmetic import PRODUCTS, product_splits

    say(f"writing the products task ({PRODUCTS}) to {train}" + (f", {test}" if test else ""))
    _write_splits(product_splits(), [Path(train)] + ([Path(test)] if test is not None else []))


def write_tool_sft_task(train: Path, test: Path | None = None) -> None:
    """Sums, differences and products with a 1-digit operand as SFT transcripts, half through the calculator
    (:func:`hybridrl.data.tool_arithmetic.tool_sft_splits`): ``sft_tool_tiny``'s data."""
    from hybridrl.data.tool_arithmetic import SMALL_PRODUCTS, TOOL_SFT, tool_sft_splits

    say(f"writing sums, differences ({TOOL_SFT}) and products with a 1-digit operand ({SMALL_PRODUCTS}) as calculator "
        f"transcripts to "
        f"{train}"
        + (f", {test}" if test else ""))
    _write_splits(tool_sft_splits(), [Path(train)] + ([Path(test)] if test is not None else []))


def write_dots_task(train: Path, test: Path | None = None) -> None:
    """Count the dots in a 56 × 56 image (``DOTS``; :mod:`hybridrl.data.dots`): ``grpo_vlm_tiny``'s task, in verl's
    multimodal layout (the images' PNG bytes in the rows)."""
    from hybridrl.data.dots import DotsTaskConfig, dots_splits

    say(f"writing the dots-counting task ({DOTS}) to {train}" + (f", {test}" if test else ""))
    _write_splits(dots_splits(DotsTaskConfig(**DOTS)), [Path(train)] + ([Path(test)] if test is not None else []))


def _write_splits(splits: Sequence[list[Row]], targets: list[Path]) -> None:
    """Each split at its target, written atomically (a temporary file renamed into place)."""
    from hybridrl.data.rows import write_rows

    for rows, path in zip(splits, targets, strict=False):
        tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
        write_rows(rows, tmp)
        tmp.rename(path)


def write_arithmetic_preference(train: Path, test: Path | None = None) -> None:
    """The arithmetic splits (``ARITHMETIC``) as DPO pairs: chosen = the answer, rejected = a plausible
    wrong one (:func:`hybridrl.data.preference.arithmetic_preference_rows`), each file written atomically."""
    from hybridrl.data.arithmetic import ArithmeticTaskConfig, arithmetic_splits
    from hybridrl.data.preference import arithmetic_preference_rows
    from hybridrl.data.rows import write_rows

    targets = [Path(train)] + ([Path(test)] if test is not None else [])
    say(f"writing the arithmetic task ({ARITHMETIC}) as preference pairs to {', '.join(map(str, targets))}")
    task = ArithmeticTaskConfig(**ARITHMETIC)  # type: ignore[arg-type]
    for split, (rows, path) in enumerate(zip(arithmetic_splits(task), targets, strict=False)):
        tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
        write_rows(arithmetic_preference_rows(rows, seed=task.seed + split), tmp)
        tmp.rename(path)


def write_gsm8k_tiny_task(train: Path, test: Path | None = None) -> None:
    """``GSM8K_TINY`` synthetic rows in GSM8K's format, prepared (chat prompts with GSM8K's instruction,
    ``ground_truth``, ``data_source=gsm8k``, the worked solution kept as ``answer``) into ``train``/``test``."""
    from hybridrl.data.prepare import PrepareConfig, prepare
    from hybridrl.data.rows import write_rows
    from hybridrl.data.synthetic_gsm8k import gsm8k_like_rows

    say(f"writing the synthetic GSM8K-format task ({GSM8K_TINY}) to {train}" + (f", {test}" if test else ""))
    n_train = int(GSM8K_TINY["num_train"])
    rows = gsm8k_like_rows(n_train + int(GSM8K_TINY["num_test"]), seed=int(GSM8K_TINY["seed"]))
    work = train.with_name(f".gsm8k-tiny.tmp-{os.getpid()}")
    try:
        sources = {"train": [str(write_rows(rows[:n_train], work / "source" / "train.jsonl"))],
                   "test": [str(write_rows(rows[n_train:], work / "source" / "test.jsonl"))]}
        prepare(work / "prepared", PrepareConfig(task="gsm8k", sources=sources))
        if test is not None:
            (work / "prepared" / "test.parquet").rename(test)
        (work / "prepared" / "train.parquet").rename(train)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def make_tiny_bpe_model(out: Path) -> None:
    """``TINY_MODEL`` with a BPE tokenizer (``TINY_BPE``) trained on synthetic GSM8K text."""
    from hybridrl.data.synthetic_gsm8k import gsm8k_like_rows
    from hybridrl.models.bpe_tokenizer import train_bpe_tokenizer
    from hybridrl.models.tiny import make_tiny_model

    rows = gsm8k_like_rows(int(TINY_BPE["corpus_rows"]), seed=int(TINY_BPE["seed"]) + 1)  # not the data's rows
    corpus = [f"{r['question']} Let's think step by step and output the final answer after \"####\".\n"
              f"{r['answer']}" for r in rows]
    tokenizer = train_bpe_tokenizer(corpus, vocab_size=int(TINY_BPE["vocab_size"]),
                                    model_max_length=int(TINY_MODEL["max_positions"]))
    make_tiny_model(out, tokenizer=tokenizer, **TINY_MODEL)  # type: ignore[arg-type]


def ensure_model(kind: str | None, path: str, *, key: str = "actor_rollout_ref.model") -> None:
    """Build the model at ``path`` as ``kind`` says, unless it exists; ``key``: its config block (errors name it)."""
    if kind is None:
        return
    if (problem := kind_problem(kind, model=True)) is not None:
        raise ValueError(f"{key}.build_if_missing={kind!r}: {problem}")
    if (problem := outside_cache_problem(kind, path)) is not None:
        raise ValueError(f"{key}.path={path!r}: {problem}")
    out = Path(path)
    if kind in RANDOM_MODELS:
        def build() -> None:
            from hybridrl.models.tiny import TinyModelSpec, make_tiny_model

            what = (f"a BPE tokenizer {TINY_BPE} trained on synthetic GSM8K" if kind == "tiny_bpe"
                    else "a char tokenizer")
            spec = RANDOM_MODELS[kind]
            say(f"making a random tiny model {spec} with {what} at {out}")
            tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
            if kind == "tiny_bpe":
                make_tiny_bpe_model(tmp)
            elif kind in ("tiny_vlm", "tiny_qwen3_vl"):
                from hybridrl.models.tiny_vlm import make_tiny_vlm

                make_tiny_vlm(tmp, text=TinyModelSpec(**TINY_VLM_MODEL),  # type: ignore[arg-type]
                              family="qwen3_vl" if kind == "tiny_qwen3_vl" else "qwen2_5_vl")
            else:
                make_tiny_model(tmp, **spec)  # type: ignore[arg-type]
            tmp.rename(out)
    elif kind.startswith("sft:"):
        recipe, key_name = kind.removeprefix("sft:"), key
        key = _sft_build_key(recipe)

        def build() -> None:
            script = recipes_dir().parent / "launch" / "sft.py"
            tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
            cmd = [sys.executable, str(script), f"recipe={recipe}", f"trainer.save_path={tmp}"]
            why = "it was built from an older version of the recipe" if _stale_build(out, key) else "none there"
            say(f"start model {out}: {why}; building it with the SFT recipe '{recipe}' ({' '.join(cmd[1:])}); "
                f"this runs once and is cached")
            env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV}
            if (code := subprocess.run(cmd, check=False, env=env, preexec_fn=_die_with_parent).returncode) != 0:
                raise WarmStartError(f"{key_name}.build_if_missing=sft:{recipe}: building {out} failed (`python "
                                     f"launch/sft.py recipe={recipe}` exited {code}; its last line above says why); "
                                     "nothing was cached, the next run tries again")
            (tmp / BUILD_INFO).write_text(json.dumps({"recipe": recipe, "key": key}) + "\n")
            if out.exists():  # stale: swap the new one in, then drop the old one
                old = out.with_name(f".{out.name}.old-{os.getpid()}")
                out.rename(old)
                tmp.rename(out)
                shutil.rmtree(old)
            else:
                tmp.rename(out)

        _once([out], build, lambda: not out.exists() or _stale_build(out, key))
        return
    _once([out], build)


def _die_with_parent() -> None:
    """In the warm start's SFT process: a SIGTERM when the run that started it dies (Linux ``PR_SET_PDEATHSIG``), so a
    killed launcher's rank, which exits, does not leave a build running (the build's files are temporary ones)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG; set by the thread that runs subprocess.run


def _sft_build_key(recipe: str) -> str:
    """Hash of what an SFT-built start model depends on: the recipe file and the tiny settings here."""
    text = _recipe_text(recipe)
    # the settings of the builds the recipe names (so a change to one task does not rebuild the other's models)
    extra = "".join(f"\n{settings}" for kind, settings in (("gsm8k_tiny", GSM8K_TINY), ("tiny_bpe", TINY_BPE),
                                                            ("tiny_moe", TINY_MOE_MODEL),
                                                            ("tiny_deepseek_v3", TINY_DEEPSEEK_V3_MODEL),
                                                            ("tiny_vlm", TINY_VLM_MODEL),
                                                            ("tiny_qwen3_vl", TINY_VLM_MODEL), ("dots", DOTS))
                    if kind in text)
    if "arithmetic_tool_sft" in text:  # the transcripts' layout is part of the warm start
        extra += "\n" + inspect.getsource(importlib.import_module("hybridrl.data.tool_arithmetic"))
    return hashlib.sha256(f"{text}\n{TINY_MODEL}\n{ARITHMETIC}{extra}".encode()).hexdigest()[:16]


def _recipe_text(recipe: str) -> str:
    """The recipe file's text and, recursively, that of the recipes its ``defaults`` list names (a change to
    ``sft_tiny`` is a change to ``sft_tiny_early``, which starts from it)."""
    path = recipes_dir() / "recipe" / f"{recipe}.yaml"
    if not path.exists():
        return recipe
    text = path.read_text()
    parents = re.findall(r"^\s*-\s*([\w.]+)\s*$", text.split("defaults:", 1)[1], re.M) if "defaults:" in text else []
    return text + "".join(f"\n{_recipe_text(p)}" for p in parents if p not in ("_self_", recipe))


def _stale_build(out: Path, key: str) -> bool:
    """``out`` was built here from different inputs (a model without build info is the user's: kept)."""
    return _stale_info(out / BUILD_INFO, key)


def _stale_info(info: Path, key: str) -> bool:
    """The build info ``info`` names another key than ``key`` (no build info: not built here, never stale)."""
    if not info.exists():
        return False
    try:
        return json.loads(info.read_text()).get("key") != key
    except (OSError, ValueError):
        return True


def _once(targets: list[Path], build: Callable[[], None], needed: Callable[[], bool] | None = None) -> None:
    """Build ``targets`` on global rank 0 while ``needed()`` (default: one is missing); other ranks wait."""
    if needed is None:
        def needed() -> bool:
            return not all(p.exists() for p in targets)
    if not needed():
        return
    if int(os.environ.get("RANK", "0")) != 0:
        _wait_for(targets, needed)
        return
    targets[0].parent.mkdir(parents=True, exist_ok=True)
    with _lock(targets[0].with_name(f".{targets[0].name}.lock")):
        if needed():  # another run may have built it meanwhile
            build()


def _wait_for(targets: list[Path], needed: Callable[[], bool], timeout_s: float = 3600.0) -> None:
    t0 = time.monotonic()
    while needed():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"rank {os.environ.get('RANK')}: {targets} did not appear within {timeout_s:.0f} s")
        time.sleep(1.0)


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
