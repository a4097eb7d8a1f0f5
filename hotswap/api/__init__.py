"""HTTP layer: an OpenAI-compatible server with lifecycle routes (the only place that does HTTP I/O).

`hotswap.api.http_errors` imports without jax; `create_app` is loaded on first use so
importing this package stays cheap for clients that only want the error types.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from hotswap.api.server import create_app

        return create_app
    raise AttributeError(f"module 'hotswap.api' has no attribute {name!r}")
