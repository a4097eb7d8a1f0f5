"""`hotswap serve [MODEL]`: the OpenAI-compatible server on uvicorn.

MODEL is an HF directory, a .gguf file, a Hugging Face Hub ID `org/name` or `tiny`; without
one it is SmolLM2-135M-Instruct (`cli/models.py`). The engine options are `EngineArgs`'.

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

from hotswap.args import EngineArgs

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
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("HOTSWAP_API_KEY"), help="protects /v1/*")
    p.add_argument(
        "--admin-key", default=os.environ.get("HOTSWAP_ADMIN_KEY"), help="protects lifecycle routes"
    )
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients may use (first is reported)"
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight work gets on SIGTERM"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    EngineArgs.add_cli_args(p, "serve")
    p.set_defaults(func=serve)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hotswap.api.server import create_app
    from hotswap.cli.models import serve_model
    from hotswap.engine.llm import LLM

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    model, name = serve_model(args.model or args.model_dir)
    if not _is_loopback(args.host) and args.admin_key is None:
        log.warning("binding %s without --admin-key: anyone who can reach it may swap the weights", args.host)
    llm = LLM(model, **EngineArgs.from_cli_args(args, "serve").kwargs("serve"))
    app = create_app(
        llm.engine,
        api_key=args.api_key,
        admin_key=args.admin_key,
        model_name=args.served_model_name or [name or llm.model_id],
        weights_root=args.weights_root,
        tool_call_parser=args.tool_call_parser,
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
