"""`hotswap aot MODEL --topology NAME`: compile for a TPU slice on this host (`hotswap/programs/tpu_slice.py`)."""

from __future__ import annotations

import argparse
import json
import sys

from hotswap.args import EngineArgs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "aot", help="compile every program for a TPU slice on this host and report its memory (needs [aot])"
    )
    p.add_argument("model", help="HF model directory (config.json is enough) or a preset (e.g. llama-3-8b)")
    p.add_argument("--topology", required=True, help="TPU slice: v5e:2x4, v6e:2x2, v5p:2x2x1, v5e:1x1, ...")
    p.add_argument(
        "--buckets",
        default="all",
        choices=["all", "largest", "decode"],
        help="'largest': the largest decode and prefill steps only; 'decode': the largest decode step only",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    EngineArgs.add_cli_args(p, "aot")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hotswap.programs import tpu_slice

    engine = EngineArgs.from_cli_args(args, "aot").kwargs("aot")
    acfg = tpu_slice.AotConfig(topology=args.topology, buckets=args.buckets, **engine)
    report = tpu_slice.compile_for(
        args.model, acfg, progress=lambda line: print(line, file=sys.stderr, flush=True)
    )
    print(json.dumps(report, indent=2) if args.json else tpu_slice.table(report))
    problem = tpu_slice.does_not_fit(report)
    if problem is not None:
        print(f"hotswap aot: error: {problem}", file=sys.stderr)
        return 1
    return 0
