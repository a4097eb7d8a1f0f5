"""A replica's refusal, raised in the fleet as the replica raised it: the body's `code` names
the HotswapError subclass (api/http_errors.py writes `code` from the class), so a shape error
on a replica is a WeightsMismatch in `Fleet.update_weights`, naming the replica."""

from __future__ import annotations

import httpx

from hotswap.api import http_errors  # noqa: F401  (defines the HTTP-only subclasses the walk finds)
from hotswap.errors import HotswapError


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _by_code() -> dict[str, type[HotswapError]]:
    table: dict[str, type[HotswapError]] = {}
    for cls in _subclasses(HotswapError):
        table.setdefault(cls.__dict__.get("code") or cls.code, cls)
    return table


def raise_for(response: httpx.Response, where: str) -> None:
    """Nothing for a 2xx; else the replica's error as its own type (HotswapError for a code
    this side does not know), the message prefixed by `where`."""
    if response.is_success:
        return
    try:
        error = response.json()["error"]
        code, message = str(error.get("code")), str(error.get("message"))
    except (ValueError, KeyError, TypeError, AttributeError):
        code, message = "", response.text[:500]
    cls = _by_code().get(code, HotswapError)
    exc = cls(f"{where}: {message}")
    if cls is HotswapError:
        exc.status = response.status_code  # keep the replica's status where the type is unknown
    raise exc
