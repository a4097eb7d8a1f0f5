"""A fleet's typed errors (HotswapError, so the HTTP table and the CLI answer them as the rest)."""

from __future__ import annotations

from hotswap.errors import ConfigError, HotswapError


class FleetDoesNotFit(ConfigError):
    """replicas x tensor_parallel_size asks for more devices (or CPUs) than the Ray cluster has:
    refused before any replica starts."""

    code = "fleet_does_not_fit"


class ReplicaLost(HotswapError):
    """A replica stopped answering (its process died, its node went away) during a fleet
    operation; the fleet update is dropped everywhere and no replica commits."""

    status = 503
    code = "replica_lost"


class ReplicaFailed(HotswapError):
    """A replica's server did not start (the log's tail says why)."""

    status = 500
    code = "replica_failed"
