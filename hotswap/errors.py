"""Typed errors for every layer of hotswap.

Importable without jax so the HTTP layer (and clients) can use them. Each class
carries the HTTP status it maps to; `hotswap.api.http_errors` turns that into one
table for the server.
"""

from __future__ import annotations


class HotswapError(Exception):
    """Base class. `status` is the HTTP status code the server answers with."""

    status: int = 400
    code: str = "bad_request"


class ConfigError(HotswapError):
    """An unsupported architecture or config field value (names the field)."""

    code = "unsupported_config"


class ProgramError(HotswapError):
    """A program the engine runs failed to lower or compile (names the program)."""

    status = 500
    code = "compile_failed"


class DeviceMemoryError(ConfigError):
    """The model, its KV cache and the steps' temporaries do not fit the device memory (says by how much)."""

    code = "does_not_fit"


class CheckpointError(HotswapError):
    """A checkpoint directory or file could not be read as HF safetensors."""

    code = "bad_checkpoint"


class CheckpointNotFound(CheckpointError):
    """A model is neither a local path nor a Hub ID found online or in the Hub cache (names both)."""

    status = 404
    code = "checkpoint_not_found"


class WeightsMismatch(CheckpointError):
    """A tensor is missing, unexpected, or has the wrong shape/dtype (names it)."""

    code = "weights_mismatch"


class NonFiniteWeights(WeightsMismatch):
    """A tensor contains NaN or Inf (names it)."""

    code = "non_finite_weights"


class PayloadError(HotswapError):
    """A weight payload sent over the wire could not be decoded safely."""

    code = "bad_payload"


class PickleRefused(PayloadError):
    """Pickle / torch.save payloads are never unpickled."""

    code = "pickle_refused"


class TransferError(PayloadError):
    """A device-to-device weight pull failed: unreachable peer, timeout, peer gone, bad offer."""

    code = "transfer_failed"


class WeightsPathNotAllowed(HotswapError):
    """A weights path lies outside the allowed root."""

    status = 403
    code = "path_not_allowed"


class RequestError(HotswapError):
    """A generation request is invalid (bad sampling parameter, bad prompt). `param`: the
    request field at fault, when one is (the OpenAI error body's `param`)."""

    code = "invalid_request"
    param: str | None = None

    @classmethod
    def of_field(cls, field: str, why: str) -> RequestError:
        """ "field: why", with `param` set to the field."""
        err = cls(f"{field}: {why}")
        err.param = field
        return err


class PromptTooLong(RequestError):
    """The prompt (plus max_tokens) does not fit max_model_len."""

    code = "prompt_too_long"


class LifecycleConflict(HotswapError):
    """A lifecycle call conflicts with the engine's current state."""

    status = 409
    code = "conflict"


class BaseVersionMismatch(LifecycleConflict):
    """A delta update (`base_version`) names a weights version other than the one serving: its
    tensors were computed against other weights, so applying them would serve a mix. Refused
    before anything changes; the message names both versions."""

    code = "base_version_mismatch"


class EngineAsleep(LifecycleConflict):
    """Generation or an update was asked of a sleeping engine.

    A subclass of LifecycleConflict (so `except LifecycleConflict` still catches it), but
    HTTP 503 with Retry-After rather than 409: the engine will serve again after a wakeup,
    so clients should retry later; the official OpenAI client retries a 503 by itself.
    """

    status = 503
    code = "engine_asleep"


class WeightsLost(HotswapError):
    """An in-place weight update failed on the device after the serving weights were released
    (a bad source is refused before that): nothing serves until an update loads a full set."""

    status = 503
    code = "weights_lost"


class QueueFull(HotswapError):
    """Backpressure: the waiting queue is at capacity."""

    status = 429
    code = "queue_full"


class Unauthorized(HotswapError):
    """A missing or wrong bearer key."""

    status = 401
    code = "unauthorized"


class Forbidden(HotswapError):
    """A valid key without the right to this route (the api key on an admin route)."""

    status = 403
    code = "forbidden"


class FleetDoesNotFit(ConfigError):
    """A fleet's replicas x tensor_parallel_size asks for more devices (or CPUs) than the Ray
    cluster has: refused before any replica starts (hotswap/fleet/)."""

    code = "fleet_does_not_fit"


class ReplicaLost(HotswapError):
    """A fleet replica stopped answering (its process died, its node went away) while the fleet
    staged an update: the update is dropped everywhere and no replica commits."""

    status = 503
    code = "replica_lost"


class ReplicaFailed(HotswapError):
    """A fleet replica's server did not start, or no replica is in service."""

    status = 503
    code = "replica_failed"
