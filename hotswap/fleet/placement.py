"""Where a fleet's replicas go: one Ray placement group per replica, its devices in one bundle on
one node (STRICT_PACK), so a tensor-parallel replica's chips sit together; and the check that
the fleet fits, made before anything starts.

A replica of tensor_parallel_size k asks for k of the cluster's accelerator (GPU or TPU, Ray's
resource names) and one CPU for its server; on a machine without one, k CPUs, each one JAX CPU
device of the replica (`--xla_force_host_platform_device_count`).
"""

from __future__ import annotations

import dataclasses

from hotswap.errors import FleetDoesNotFit

ACCELERATORS = ("TPU", "GPU")  # Ray's resource names, the first the cluster has is used


@dataclasses.dataclass(frozen=True)
class Demand:
    """What one replica asks Ray for: `kind` devices, `tp` of them, in one bundle."""

    kind: str  # "TPU", "GPU" or "CPU"
    tp: int

    def bundle(self) -> dict[str, float]:
        if self.kind == "CPU":
            return {"CPU": float(self.tp)}
        return {self.kind: float(self.tp), "CPU": 1.0}


def demand(tp: int, resources: dict[str, float]) -> Demand:
    kind = next((k for k in ACCELERATORS if resources.get(k, 0) > 0), "CPU")
    return Demand(kind, tp)


def check_fits(replicas: int, tp: int, total: dict[str, float], per_node: list[dict[str, float]]) -> Demand:
    """FleetDoesNotFit unless `replicas` replicas of `tp` devices fit: in all, and each on one node."""
    if replicas < 1 or tp < 1:
        raise FleetDoesNotFit(f"replicas ({replicas}) and tensor_parallel_size ({tp}) must be at least 1")
    need = demand(tp, total)
    have = int(total.get(need.kind, 0))
    if replicas * tp > have:
        raise FleetDoesNotFit(
            f"{replicas} replicas x tensor_parallel_size {tp} need {replicas * tp} {need.kind} devices; "
            f"the Ray cluster has {have}"
        )
    largest = max((int(n.get(need.kind, 0)) for n in per_node), default=0)
    if tp > largest:
        raise FleetDoesNotFit(
            f"a replica of tensor_parallel_size {tp} needs {tp} {need.kind} devices on one node; "
            f"the largest node has {largest}"
        )
    return need


def cluster() -> tuple[dict[str, float], list[dict[str, float]]]:
    """The connected Ray cluster's resources: in all, and per live node."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return ray.cluster_resources(), nodes


def reserve(need: Demand, timeout_s: float):
    """One replica's placement group, ready (FleetDoesNotFit if Ray cannot place it in time)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([need.bundle()], strategy="STRICT_PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise FleetDoesNotFit(f"Ray could not place a replica's bundle {need.bundle()} in {timeout_s:.0f} s")
    return group
