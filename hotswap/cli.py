"""`hotswap serve | create-model | demo | bench`: one argparse entry, each command in its own module."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from hotswap.errors import HotswapError


def default_model_dir() -> Path:
    """The embedded default model (the `tiny` preset), created once under a cache dir."""
    from hotswap.checkpoint.create import create_checkpoint

    root = Path(os.environ.get("HOTSWAP_CACHE", Path.home() / ".cache" / "hotswap"))
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


def _create_model(args) -> int:
    from hotswap.checkpoint.create import create_checkpoint

    out = create_checkpoint(args.out, preset=args.preset, arch=args.arch, seed=args.seed)
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hotswap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("create-model", help="write a seeded random-weight HF-format checkpoint")
    p.add_argument("--preset", default="tiny", choices=["tiny", "bench-100m"])
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "mistral"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_create_model)

    for module in ("hotswap.api.cli_serve", "hotswap.demo", "hotswap.bench"):
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != module:  # a real import error inside the module must surface
                raise

    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HotswapError as e:  # bad input (a path, a config, a peer name): one line, not a traceback
        print(f"hotswap {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
