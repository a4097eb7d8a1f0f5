"""`hotswap create-model`: write a seeded random-weight HF-format checkpoint."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("create-model", help="write a seeded random-weight HF-format checkpoint")
    p.add_argument("--preset", default="tiny", choices=["tiny", "bench-100m"])
    p.add_argument(
        "--arch", default="llama", choices=["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hotswap.checkpoint.create import create_checkpoint

    print(create_checkpoint(args.out, preset=args.preset, arch=args.arch, seed=args.seed))
    return 0
