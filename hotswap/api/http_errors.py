"""HTTP error mapping: one table from error type to status and OpenAI error type.

Importable without jax (it imports only `hotswap.errors`), so clients and tools
can match on the same classes the server raises. Bodies have OpenAI's shape,
`{"error": {"message", "type", "code", "param"}}`, which the official client
turns into its typed exceptions (`BadRequestError`, `RateLimitError`, ...).
"""

from __future__ import annotations

from typing import Any

from hotswap.errors import (
    BaseVersionMismatch,
    CheckpointError,
    ConfigError,
    EngineAsleep,
    Forbidden,
    HotswapError,
    LifecycleConflict,
    NonFiniteWeights,
    PayloadError,
    PickleRefused,
    PromptTooLong,
    QueueFull,
    ReplicaFailed,
    ReplicaLost,
    RequestError,
    TransferError,
    Unauthorized,
    WeightsLost,
    WeightsMismatch,
    WeightsPathNotAllowed,
)


class ModelNotFound(HotswapError):
    """The request names a model this server does not serve."""

    status = 404
    code = "model_not_found"


class RequestNotFound(HotswapError):
    """An abort names a request id this server never ran (one that ended lately is not an error)."""

    status = 404
    code = "request_not_found"


class ShuttingDown(HotswapError):
    """The server received SIGTERM: in-flight work finishes, new work is refused."""

    status = 503
    code = "shutting_down"


class UnsupportedMediaType(HotswapError):
    status = 415
    code = "unsupported_media_type"


class PickleBodyRefused(UnsupportedMediaType):
    """A body whose bytes are a pickle, on an SGLang or vLLM route (their 415); never unpickled.
    hotswap's own `/update_weights` answers PickleRefused's 400, and a pickled field inside a JSON
    body (`serialized_named_tensors`) is a PickleRefused on every route."""

    code = "pickle_refused"


# The one table. Looked up along the exception's MRO, so a subclass without its own
# row inherits its parent's; the status column agrees with each class's `.status`
# (checked at import below) so engine code and HTTP code cannot drift apart.
ERROR_TABLE: dict[type[BaseException], tuple[int, str]] = {
    Unauthorized: (401, "authentication_error"),
    Forbidden: (403, "permission_error"),
    WeightsPathNotAllowed: (403, "permission_error"),
    ModelNotFound: (404, "not_found_error"),
    RequestNotFound: (404, "not_found_error"),
    EngineAsleep: (503, "service_unavailable_error"),  # before its parent LifecycleConflict (409)
    BaseVersionMismatch: (409, "conflict_error"),
    LifecycleConflict: (409, "conflict_error"),
    UnsupportedMediaType: (415, "invalid_request_error"),
    QueueFull: (429, "rate_limit_error"),
    ShuttingDown: (503, "service_unavailable_error"),
    WeightsLost: (503, "service_unavailable_error"),
    ReplicaLost: (503, "service_unavailable_error"),
    ReplicaFailed: (503, "service_unavailable_error"),
    PickleRefused: (400, "invalid_request_error"),
    TransferError: (400, "invalid_request_error"),
    PayloadError: (400, "invalid_request_error"),
    NonFiniteWeights: (400, "invalid_request_error"),
    WeightsMismatch: (400, "invalid_request_error"),
    CheckpointError: (400, "invalid_request_error"),
    PromptTooLong: (400, "invalid_request_error"),
    RequestError: (400, "invalid_request_error"),
    ConfigError: (400, "invalid_request_error"),
    HotswapError: (400, "invalid_request_error"),
}
for _cls, (_status, _) in ERROR_TABLE.items():
    assert _cls.status == _status, f"{_cls.__name__}: table says {_status}, class says {_cls.status}"

# Seconds a client should wait after a 429 or 503 before retrying (the queue drains in steps of
# ms; a sleeping engine wakes when its controller says so, so the client polls).
RETRY_AFTER_S = 1


def status_and_type(exc: BaseException) -> tuple[int, str]:
    """HTTP status and OpenAI error type; anything untyped is a 500."""
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return 500, "internal_server_error"


def error_body(
    message: str, *, status: int, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code or str(status), "param": param}}


def exception_body(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, OpenAI error body, extra headers) for any exception."""
    status, type_ = status_and_type(exc)
    code = getattr(exc, "code", None) if isinstance(exc, HotswapError) else "internal_error"
    message = str(exc) or type(exc).__name__
    if status == 500:
        message = f"internal error: {type(exc).__name__}: {message}"
    headers: dict[str, str] = {}
    if status in (429, 503):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = error_body(message, status=status, type_=type_, code=code, param=getattr(exc, "param", None))
    return status, body, headers


__all__ = [
    "ERROR_TABLE",
    "RETRY_AFTER_S",
    "BaseVersionMismatch",
    "CheckpointError",
    "ConfigError",
    "EngineAsleep",
    "Forbidden",
    "HotswapError",
    "LifecycleConflict",
    "ModelNotFound",
    "NonFiniteWeights",
    "PayloadError",
    "PickleBodyRefused",
    "PickleRefused",
    "PromptTooLong",
    "QueueFull",
    "ReplicaFailed",
    "ReplicaLost",
    "RequestError",
    "RequestNotFound",
    "ShuttingDown",
    "TransferError",
    "Unauthorized",
    "UnsupportedMediaType",
    "WeightsLost",
    "WeightsMismatch",
    "WeightsPathNotAllowed",
    "error_body",
    "exception_body",
    "status_and_type",
]
