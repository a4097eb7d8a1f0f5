"""N data-parallel replicas on Ray behind an existing router, and the fleet-wide commit.

`Fleet` (driver.py) starts the replicas (replica.py, placement.py) and changes their weights as
one (commit.py over api/routes_fleet.py); `hotswap fleet serve` (cli/fleet.py) puts
sglang-router in front of them and a small controller app (controller_app.py) beside it.
Ray is the optional extra `hotswap[ray]`: this package imports it only when a fleet starts.
"""

from hotswap.errors import FleetDoesNotFit, ReplicaFailed, ReplicaLost
from hotswap.fleet.commit import Committed
from hotswap.fleet.driver import Fleet

__all__ = ["Committed", "Fleet", "FleetDoesNotFit", "ReplicaFailed", "ReplicaLost"]
