"""The JAX platform of the engine commands when the user names none."""

from __future__ import annotations

import glob
import importlib.util
import os


def pick_jax_platform(environ=os.environ) -> None:
    """`JAX_PLATFORMS=cpu` for `serve`, `bench` and `demo` on a machine without a TPU or a GPU.

    The `[aot]` extra installs libtpu (to compile for TPU on any host). Left to choose, JAX then
    initialises libtpu first, which, with no TPU attached, prints `INVALID_ARGUMENT: unexpected
    worker hostname ...` lines before JAX falls back to the CPU. A TPU shows as /dev/accel* (or
    /dev/vfio on newer VMs); a GPU needs JAX's CUDA plugin, and then JAX chooses as usual. A
    platform the user set (`JAX_PLATFORMS`) is kept.
    """
    if environ.get("JAX_PLATFORMS"):
        return
    if glob.glob("/dev/accel*") or os.path.exists("/dev/vfio"):
        return
    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return
    environ["JAX_PLATFORMS"] = "cpu"
