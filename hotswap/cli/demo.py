"""`hotswap demo`: the parser; the job is `hotswap/rl/train_while_serving.py`'s."""

from __future__ import annotations

import argparse

DEFAULT_STEPS = 400  # about 2 minutes on 2 CPU cores, compile included (reward plateaus after ~150)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="train a tiny model with GRPO while serving it, hot-swapping weights every step",
        description=_doc(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="GRPO steps (= weight updates)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="completions per prompt (the GRPO group size)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")
    p.add_argument("--lr", type=float, default=3e-3, help="adam learning rate")
    p.add_argument(
        "--policy", default="drain", choices=["drain", "abort", "keep"], help="update_weights policy"
    )
    p.add_argument("--via-http", action="store_true", help="drive a `hotswap serve` subprocess over REST")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant engine; the mismatch is its own score of each token against the rollout's (0.0)",
    )
    p.add_argument("--model", default=None, help="HF model dir (default: a fresh tiny checkpoint in --out)")
    p.add_argument("--out", default="runs/demo", help="output directory (plot, metrics, model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=None, help="table row every N steps (default: ~20 rows)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def parse(argv: list[str]) -> argparse.Namespace:
    """`parse(["--steps", "3"])`: the demo's arguments, for running it in process (tests, notebooks)."""
    parser = argparse.ArgumentParser(prog="hotswap")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["demo", *argv])


def _doc() -> str:
    from hotswap.rl import train_while_serving

    return train_while_serving.__doc__


def run(args: argparse.Namespace) -> int:
    from hotswap.rl import train_while_serving

    return train_while_serving.main(args)
