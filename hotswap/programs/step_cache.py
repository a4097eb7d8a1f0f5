"""Compiled steps kept between processes, loaded without tracing or lowering them again.

JAX's persistent compilation cache (`compile_cache.py`) is keyed by the lowered program, so
even a warm start traces and lowers every bucket's step before it can look the program up:
for a 30-layer model that is a second or more of a few-second start. This cache is keyed by
everything the program is made from instead, so a hit needs neither:

- the step's code: every source file of the hotswap package (`.py`, and the C++ kernels'
  `.cc`/`.h`), hashed once per process;
- JAX, jaxlib, the backend's platform and version, `XLA_FLAGS`, `LIBTPU_INIT_ARGS`, and
  JAX's configuration (the settings that shape tracing: x64, matmul precision, ...);
- the host's CPU model and instruction sets (`kernels/cpu_target.host()`): XLA:CPU compiles
  for them, so an entry made on another CPU is a miss, never run;
- the model config, the Backend's attention, platform and deterministic mode, and the arguments' tree, shapes, dtypes and
  shardings (the bucket).

An entry is the PJRT executable's own serialized bytes (what JAX's cache stores too) and a
JSON file with what JAX would have learnt by lowering: output shapes and dtypes, the
inputs the program kept, the donated ones. Nothing is unpickled. It covers the step jitted
as one program (`step.fused_jit`: the C++ and Pallas kernels) on one device; other steps
(the reference attention's two programs, sharded meshes) go through JAX's cache alone.

Only a program compiled in this process is stored: one that JAX itself loaded from its
cache does not serialize whole again (its machine code is not kept). So after an upgrade
whose programs JAX's cache still holds, starts go through JAX's cache until its entries
are gone (delete `xla/` to refill both). An entry that is missing, stale or unreadable is a
miss. It lives in `steps/` under hotswap's cache directory, and is on exactly when JAX's
persistent cache is (`compile_cache.enable`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax._src import compiler, core, stages
from jax._src.interpreters import pxla

from hotswap.cache_dir import cache_dir
from hotswap.kernels.backend import Backend
from hotswap.kernels.cpu_target import host

FORMAT = 1  # bump when an entry's layout changes
# `load` builds JAX's executable objects itself (jax._src), as JAX does for its own cache: on
# another minor version the cache is not used (their constructors are not a public API).
TESTED_JAX = "0.10."
_PACKAGE = Path(__file__).resolve().parent.parent  # hotswap/
_SOURCES = (".py", ".cc", ".h")
_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
# JAX settings that decide where caches live, not what a program is.
_NOT_PROGRAM = ("cache", "log", "explain", "debug_key_reuse")


@functools.cache
def code_hash() -> str:
    """sha256 of every hotswap source file (path and bytes): any edit is a new program."""
    h = hashlib.sha256()
    for path in sorted(p for p in _PACKAGE.rglob("*") if p.suffix in _SOURCES and p.is_file()):
        h.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def eligible(args: tuple, backend: Backend) -> bool:
    """A fused step whose every array argument sits on one and the same device, on the JAX
    whose internals `load` rebuilds a `Compiled` from (tested on 0.10)."""
    if backend.read_then_write or not jax.__version__.startswith(TESTED_JAX):
        return False
    devices = {d for x in jax.tree.leaves(args) if isinstance(x, jax.Array) for d in x.sharding.device_set}
    return len(devices) <= 1


def _device(args: tuple) -> jax.Device:
    for x in jax.tree.leaves(args):
        if isinstance(x, jax.Array):
            return next(iter(x.sharding.device_set))
    return jax.devices()[0]


def _key(leaves: list, tree, cfg: Any, backend: Backend, device: jax.Device) -> str:
    client = device.client
    settings = sorted(
        (k, v) for k, v in jax.config.values.items() if not any(word in k for word in _NOT_PROGRAM)
    )
    parts = [
        FORMAT,
        jax.__version__,
        jaxlib.__version__,
        client.platform,
        client.platform_version,
        device.device_kind,
        host().key,
        [os.environ.get(name, "") for name in _ENV],
        settings,
        code_hash(),
        repr(cfg),
        backend.attention,
        backend.platform,
        backend.deterministic,  # which kernels the step calls (`Backend` doc)
        str(tree),
        [(x.shape, str(x.dtype), repr(getattr(x, "sharding", None))) for x in leaves],
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]


def _paths(key: str) -> tuple[Path, Path]:
    root = cache_dir() / "steps"
    return root / f"{key}.json", root / f"{key}.bin"


def _compile_options(device: jax.Device, n_in: int, n_out: int):
    """The options a one-device program is built with (as JAX builds them for `jit`)."""
    opts = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=1,
        device_assignment=np.array([[device]]),
        backend=device.client,
    )
    opts.executable_build_options.allow_spmd_sharding_propagation_to_parameters = [False] * n_in
    opts.executable_build_options.allow_spmd_sharding_propagation_to_output = [False] * n_out
    return opts


def _skeleton(tree) -> Any:
    """A tree of nested tuples as nested JSON lists of 0s (None: some node is not a tuple)."""
    nested = jax.tree.unflatten(tree, [0] * tree.num_leaves)
    return nested if jax.tree.structure(_tuples(nested)) == tree else None


def _tuples(skeleton: Any) -> Any:
    return tuple(_tuples(x) for x in skeleton) if isinstance(skeleton, (list, tuple)) else skeleton


def store(compiled: stages.Compiled, args: tuple, *, cfg: Any, backend: Backend) -> None:
    """Keep `compiled` (just compiled from `step.fused_jit` on `args`) for later processes.
    Best effort: an entry that cannot be written is skipped."""
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None or unloaded.host_callbacks or unloaded.ordered_effects or unloaded.mut:
        return
    out_tree = _skeleton(compiled.out_tree)
    if out_tree is None:
        return
    leaves, tree = jax.tree.flatten((args, {}))
    device = _device(args)
    meta = {
        "name": unloaded.name,
        "out": [[list(a.shape), str(a.dtype)] for a in unloaded.output_avals],
        "kept": sorted(unloaded.kept_var_idx),
        "donated": [info.donated for info in jax.tree.leaves(compiled.args_info)],
        "out_tree": out_tree,
    }
    meta_path, blob_path = _paths(_key(leaves, tree, cfg, backend, device))
    try:
        blob = device.client.serialize_executable(unloaded.xla_executable)
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        for path, data in ((blob_path, blob), (meta_path, json.dumps(meta).encode())):
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)  # atomic; the JSON goes last, so a reader never sees half an entry
    except (OSError, RuntimeError, TypeError, ValueError, AttributeError):
        return


def load(args: tuple, *, cfg: Any, backend: Backend) -> stages.Compiled | None:
    """The step compiled earlier for exactly these arguments, or None."""
    leaves, tree = jax.tree.flatten((args, {}))
    device = _device(args)
    meta_path, blob_path = _paths(_key(leaves, tree, cfg, backend, device))
    if device.platform == "cpu":
        from hotswap.kernels import cpu_build

        # Tracing registers the C++ kernels' FFI targets; a program loaded untraced needs
        # them too (they resolve by name when it is deserialized).
        cpu_build.available()
    try:
        meta = json.loads(meta_path.read_bytes())
        if len(meta["donated"]) != len(leaves):
            return None
        out_tree = jax.tree.structure(_tuples(meta["out_tree"]))
        blob = blob_path.read_bytes()
        in_avals = [core.ShapedArray(x.shape, x.dtype) for x in leaves]
        out_avals = [core.ShapedArray(tuple(shape), np.dtype(dt)) for shape, dt in meta["out"]]
        kept = set(meta["kept"])
        kept_avals = [a for i, a in enumerate(in_avals) if i in kept]
        sharding = jax.sharding.SingleDeviceSharding(device)
        devices = sharding._internal_device_list
        exe = device.client.deserialize_executable(
            blob, devices, _compile_options(device, len(kept_avals), len(out_avals))
        )
        in_layouts, out_layouts = pxla._get_layouts_from_executable(
            exe, [None] * len(kept_avals), [None] * len(out_avals), 0, kept_avals, out_avals
        )
        in_shardings = [sharding] * len(kept_avals)
        unloaded = pxla.UnloadedMeshExecutable(
            xla_executable=exe,
            device_list=devices,
            backend=device.client,
            input_avals=kept_avals,
            input_shardings=in_shardings,
            output_avals=out_avals,
            output_shardings=[sharding] * len(out_avals),
            committed=True,
            name=meta["name"],
            unordered_effects=[],
            ordered_effects=[],
            keepalive=[],
            host_callbacks=[],
            kept_var_idx=kept,
            mut=None,
            xla_in_layouts=in_layouts,
            dispatch_in_layouts=pxla.get_dispatch_layouts(in_layouts, in_shardings, kept_avals),
            xla_out_layouts=out_layouts,
            all_args_info=None,
            pgle_profiler=None,
        )
        info = tree.unflatten([stages.ArgInfo(a, d) for a, d in zip(in_avals, meta["donated"], strict=True)])
        return stages.Compiled(unloaded.load(), [], info, out_tree, no_kwargs=False)
    except (OSError, KeyError, TypeError, ValueError, AttributeError, jax.errors.JaxRuntimeError):
        return None
