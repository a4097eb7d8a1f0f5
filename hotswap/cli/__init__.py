"""`hotswap serve | create-model | aot | demo | bench | fleet serve`: one argparse entry, each command in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

from hotswap import host_memory
from hotswap.cli.bench import BenchmarksNotFound, checkout
from hotswap.cli.models import (
    DEFAULT_MODEL_NAME,
    SMOLLM2_INSTALL,
    TINY,
    DefaultModelMissing,
    default_model_dir,
    serve_model,
    smollm2_gguf,
)
from hotswap.cli.platform import pick_jax_platform
from hotswap.errors import HotswapError

__all__ = [
    "DEFAULT_MODEL_NAME",
    "SMOLLM2_INSTALL",
    "TINY",
    "BenchmarksNotFound",
    "DefaultModelMissing",
    "checkout",
    "default_model_dir",
    "main",
    "serve_model",
    "smollm2_gguf",
]

# One module per command, each owning its parser (`add_parser(sub)`).
COMMANDS = ("create_model", "serve", "aot", "demo", "bench", "fleet")
# Commands that run an engine: they start with 2 MB pages for its buffers (host_memory.py) and
# on the CPU where there is no accelerator (platform.py).
ENGINE_COMMANDS = ("serve", "bench", "demo")


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] in ENGINE_COMMANDS:
        pick_jax_platform()  # before JAX loads, and inherited by the restart below
    if argv is None and words and words[0] in ENGINE_COMMANDS:
        host_memory.maybe_reexec(words)  # before anything large is allocated
    parser = argparse.ArgumentParser(prog="hotswap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"hotswap.cli.{name}").add_parser(sub)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HotswapError as e:  # bad input (a path, a config, a peer name): one line, not a traceback
        print(f"hotswap {args.command}: error: {e}", file=sys.stderr)
        return 2
