"""Orbax checkpoints of the params pytree, and the allowed-root check for weight paths.

The shapes are checked against the checkpoint's metadata *before* restoring,
for two reasons found in orbax 0.12.8: a target leaf without a sharding
restores whatever is on disk, silently ignoring the requested shape; and the
errors it does raise (structure mismatch, "not compatible with the stored
shape") are long tensorstore dumps that do not name the param. Checking first
turns every mismatch into one WeightsMismatch line that names the leaf (`read_layout` is
what the ingest pipeline's plan checks, `weights/plan.py`: nothing is read before it passes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hotswap.errors import CheckpointError, WeightsPathNotAllowed
from hotswap.model.spec import Params, path_name


def _checkpointer():
    """orbax's StandardCheckpointer, imported on first use: orbax and tensorstore add ~28 MB to
    every process that never reads or writes an orbax checkpoint (most serving ones)."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def resolve_weights_path(path: str | os.PathLike, allowed_root: str | os.PathLike | None) -> Path:
    """Resolve symlinks and `..`; refuse anything that lands outside `allowed_root`.

    A relative path is taken relative to the root (what a REST client naming
    "models/step_100" means). `allowed_root=None` allows any path: in-process
    callers already own the filesystem.
    """
    if allowed_root is None:
        return Path(path).expanduser().resolve()
    root = Path(allowed_root).expanduser().resolve()
    # resolve() follows every symlink that exists, so a link inside the root that
    # points outside it is judged by where it points, not where it sits.
    resolved = (root / Path(path).expanduser()).resolve()
    if not resolved.is_relative_to(root):
        raise WeightsPathNotAllowed(
            f"weights path {str(path)!r} resolves to {str(resolved)!r}, outside the allowed root {str(root)!r}"
        )
    return resolved


def save_params(params: Params, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write params as an orbax checkpoint at `path` (blocks until committed)."""
    path = Path(path).expanduser().resolve()  # orbax requires an absolute path
    if path.exists() and not overwrite:
        raise CheckpointError(f"orbax checkpoint path {str(path)!r} already exists; pass overwrite=True")
    try:
        with _checkpointer() as ckptr:
            ckptr.save(path, params, force=overwrite)
            # StandardCheckpointer is async: without the wait a caller could read a half-written dir.
            ckptr.wait_until_finished()
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"could not save orbax checkpoint to {str(path)!r}: {e}") from e
    return path


def read_layout(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Params name -> (shape, dtype) of every array the checkpoint holds, from its metadata
    (nothing else is read): what the ingest pipeline's plan checks before `restore_params`."""
    on_disk = _flat(_read_metadata(Path(path).expanduser().resolve()))
    return {name: (tuple(m.shape), np.dtype(m.dtype)) for name, m in on_disk.items()}


def restore_params(path: str | os.PathLike, abstract_params: Params | None = None) -> Params:
    """Read an orbax checkpoint into the params layout, as jax arrays.

    With `abstract_params` (ShapeDtypeStruct leaves, optionally sharded, checked against
    `read_layout` first: `weights/plan.py`), each leaf is restored in its shape; floating
    dtypes are cast to the abstract dtype (a float32 checkpoint into a bfloat16 engine).
    Leaves without a sharding go to the default device.
    """
    path = Path(path).expanduser().resolve()
    raw_tree = _read_metadata(path)
    on_disk = _flat(raw_tree)
    wanted = on_disk if abstract_params is None else _flat(abstract_params)

    # The target must mirror the on-disk structure (orbax compares them), so build
    # it from the metadata tree and fill in each leaf's wanted shape/dtype/sharding.
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat, treedef = jax.tree_util.tree_flatten_with_path(raw_tree, is_leaf=_is_array_meta)
    target_leaves = []
    for keypath, _ in flat:
        leaf = wanted[path_name(keypath)]
        target_leaves.append(
            jax.ShapeDtypeStruct(
                tuple(leaf.shape), np.dtype(leaf.dtype), sharding=_sharding_or(leaf, default)
            )
        )
    target = jax.tree_util.tree_unflatten(treedef, target_leaves)
    try:
        with _checkpointer() as ckptr:
            restored = ckptr.restore(path, target)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"could not restore orbax checkpoint {str(path)!r}: {_first_line(e)}") from e
    return _normalize(restored)


# --------------------------------------------------------------------------- helpers


def _read_metadata(path: Path) -> Any:
    """The checkpoint's tree of ArrayMetadata (shape, dtype), as orbax stored it."""
    if not path.is_dir():
        raise CheckpointError(f"no orbax checkpoint at {str(path)!r}: not a directory")
    if not (path / "_METADATA").is_file():
        raise CheckpointError(
            f"{str(path)!r} is not an orbax checkpoint (no _METADATA file); "
            "an unfinished save, or an HF safetensors directory?"
        )
    try:
        with _checkpointer() as ckptr:
            meta = ckptr.metadata(path)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"could not read orbax checkpoint metadata at {str(path)!r}: {e}") from e
    # 0.12.x returns StepMetadata(item_metadata=TreeMetadata(tree=...)); older ones the tree itself.
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict):
        # orbax only logs a warning and returns None when the array metadata is unreadable.
        raise CheckpointError(
            f"could not read the params tree of orbax checkpoint {str(path)!r}: "
            "its metadata is missing or corrupt (or it does not hold a params dict)"
        )
    return tree


def _is_array_meta(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _normalize(tree: Any) -> Any:
    """Dicts keyed "0".."n-1" back into lists: orbax versions differ on how lists round-trip."""
    if isinstance(tree, dict):
        out = {k: _normalize(v) for k, v in tree.items()}
        if out and all(isinstance(k, str) and k.isdigit() for k in out):
            idx = sorted(out, key=int)
            if [int(k) for k in idx] == list(range(len(idx))):
                return [out[k] for k in idx]
        return out
    if isinstance(tree, (list, tuple)):
        return [_normalize(v) for v in tree]
    return tree


def _flat(tree: Any) -> dict[str, Any]:
    """{"layers.3.wq": leaf}; names agree whether lists came back as lists or "0".. dicts."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_array_meta)
    return {path_name(kp): leaf for kp, leaf in flat}


def _sharding_or(leaf: Any, default: jax.sharding.Sharding) -> jax.sharding.Sharding:
    # Metadata leaves carry orbax ShardingMetadata, not a jax Sharding: the saved
    # mesh may not exist in this process, so without an abstract tree use `default`.
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.Sharding) else default


def _first_line(e: BaseException) -> str:
    # tensorstore errors embed a multi-KB JSON spec; the first line says what went wrong.
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
