"""A local Ray for the fleet tests (one per module, small: a few logical CPUs, the smallest object
store) and a weights root of tiny seeded checkpoints: `seed0`, `seed1` (same shapes, other
weights) and `wide` (another intermediate size: a shape error)."""

from __future__ import annotations

import pytest
from fleet_load import FLEET_KNOBS  # noqa: F401  (the fleet tests' replica options)

from hotswap.checkpoint.create import create_checkpoint

RAY_CPUS = 4  # logical: two replicas of tensor_parallel_size 1 fit, three of 2 do not


@pytest.fixture(scope="module")
def ray_local():
    import ray  # the [ray] extra, part of [test]

    ray.init(
        num_cpus=RAY_CPUS,
        include_dashboard=False,
        object_store_memory=80 * 1024**2,
        log_to_driver=False,
        logging_level="warning",
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def fleet_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet-weights")
    for seed in (0, 1):
        create_checkpoint(root / f"seed{seed}", preset="tiny", arch="llama", seed=seed)
    create_checkpoint(root / "wide", preset="tiny", arch="llama", seed=2, overrides={"intermediate_size": 96})
    return root
