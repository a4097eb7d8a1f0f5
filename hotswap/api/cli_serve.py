"""`hotswap serve [MODEL]`: the OpenAI-compatible server on uvicorn.

MODEL is an HF directory, a .gguf file, a Hugging Face Hub ID `org/name` or `tiny`; without
one it is SmolLM2-135M-Instruct (`cli.serve_model`).

Binds 127.0.0.1 unless told otherwise. On SIGTERM (or Ctrl-C) it stops admitting
work (503), lets in-flight requests finish within --shutdown-timeout, and exits 0.
Keys may come from HOTSWAP_API_KEY / HOTSWAP_ADMIN_KEY instead of the command
line, where other users could read them in `ps`.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys

from hotswap.config import ATTENTION_IMPLS

log = logging.getLogger("hotswap.api")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API with lifecycle routes")
    p.add_argument(
        "model_dir",
        nargs="?",
        default=None,
        help="HF-format model directory, .gguf file, Hub ID org/name, or 'tiny' (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--model", default=None, help="the same as MODEL_DIR")
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit of a Hub ID (default: main)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("HOTSWAP_API_KEY"), help="protects /v1/*")
    p.add_argument(
        "--admin-key", default=os.environ.get("HOTSWAP_ADMIN_KEY"), help="protects lifecycle routes"
    )
    p.add_argument("--weights-root", default=None, help="directory that /update_weights paths must lie under")
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients may use (first is reported)"
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None, help="default: sized from device memory")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="on TPU/GPU, the fraction of free device memory for params, KV cache and step temporaries "
        "when --num-pages is not given (CPU sizes the cache from max_num_seqs)",
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="devices to shard the model over (by heads)"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--attention", default="auto", choices=list(ATTENTION_IMPLS))
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-waiting", type=int, default=1024, help="queue bound; beyond it requests get 429")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds a 'drain' update waits")
    p.add_argument(
        "--max-version-lag",
        type=int,
        default=None,
        help="under the 'keep' update policy, recompute a running sequence whose oldest KV is more than "
        "this many weights versions old (AReaL's max_head_offpolicyness)",
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight work gets on SIGTERM"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=serve)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hotswap.api.server import create_app
    from hotswap.cli import serve_model
    from hotswap.engine.llm import LLM

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    model, name = serve_model(args.model or args.model_dir)
    if not _is_loopback(args.host) and args.admin_key is None:
        log.warning("binding %s without --admin-key: anyone who can reach it may swap the weights", args.host)
    llm = LLM(
        model,
        revision=args.revision,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        dtype=args.dtype,
        attention=args.attention,
        seed=args.seed,
        weights_root=args.weights_root,
        max_waiting=args.max_waiting,
        drain_timeout_s=args.drain_timeout,
        max_version_lag=args.max_version_lag,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    app = create_app(
        llm.engine,
        api_key=args.api_key,
        admin_key=args.admin_key,
        model_name=args.served_model_name or [name or llm.model_id],
        weights_root=args.weights_root,
    )
    ctx = app.state.ctx

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not ctx.shutting_down:
                log.info("signal %d: refusing new work, finishing in-flight requests", sig)
            ctx.shutting_down = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    # uvicorn re-raises a captured signal, after its graceful shutdown, to the handler that was
    # installed before it started; a no-op there lets a clean drain end with exit status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    Server(config).run()
    return 0


if __name__ == "__main__":  # python -m hotswap.api.cli_serve MODEL_DIR ...
    parser = argparse.ArgumentParser(prog="hotswap")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["serve", *sys.argv[1:]])
    sys.exit(ns.func(ns))
