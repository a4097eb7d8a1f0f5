"""Paged attention for XLA:CPU: a C++ XLA FFI custom call (`cpu/paged_attention.cc`).

The jnp reference gathers every page a row reads into a new buffer and then runs many
tiny dots; on XLA:CPU that was most of a decode step. The C++ kernel reads the keys in
place through the block table with an online softmax, on XLA's intra-op threads. It has
the semantics of `reference.decode_attention` / `prefill_attention` (the cache as it was
before the step, plus the step's own K/V), so the engine keeps its read-then-write steps.

The kernel is compiled on first use with the system C++ compiler against the FFI headers
that ship with jaxlib (`jax.ffi.include_dir()`), with `-march=native` as llama.cpp builds
by default, and cached by a hash of source, flags, compiler and jaxlib version under
`$HOTSWAP_CACHE_DIR` (default `~/.cache/hotswap`). `available()` says whether it built;
the engine's `attention="auto"` falls back to the jnp reference when it did not.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.errors import ConfigError

SOURCE = Path(__file__).with_name("cpu") / "paged_attention.cc"
TARGET = "hotswap_paged_attention"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


def cache_dir() -> Path:
    return Path(os.environ.get("HOTSWAP_CACHE_DIR") or Path.home() / ".cache" / "hotswap") / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        b"\0".join(
            [SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), jax.__version__.encode()]
        )
    ).hexdigest()[:16]
    return cache_dir() / f"paged_attention-{key}.so"


def _build(cxx: str, out: Path) -> None:
    """Compile to a temporary name and rename: concurrent builders never see a partial file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ConfigError(
                f"building the CPU attention kernel failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}"
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> None:
    """Build (once per machine) and register the kernel; raises ConfigError when it cannot."""
    cxx = _compiler()
    if cxx is None:
        raise ConfigError("the CPU attention kernel needs a C++ compiler (set CXX, or install g++)")
    path = _library_path(cxx)
    if not path.exists():
        _build(cxx, path)
    lib = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.HotswapPagedAttention), platform="cpu")


@functools.cache
def available() -> bool:
    """True when the kernel builds and loads here (the answer is cached for the process)."""
    try:
        load()
    except (ConfigError, OSError):
        return False
    return True


def paged_attention(
    q: jax.Array,
    pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    block_tables: jax.Array,
    q_positions: jax.Array,
    chunk_starts: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float,
) -> jax.Array:
    """Attention of a [B, C] step over the cache before the step plus the step's own K/V.

    q: [B, C, Hq, hd]; pages: [num_pages, page_size, 2*Hkv, hd] (read only); k_new, v_new:
    [B, C, Hkv, hd]; block_tables: int32 [B, P] (only the pages before each chunk are read);
    q_positions: int32 [B, C]; chunk_starts, kv_lens: int32 [B]. Row b's chunk starts at
    chunk_starts[b] and its tokens sit end to end in the flattened [B*C] step (several rows
    of one sequence in a packed prefill; one token per row in decode). Queries at or past
    kv_lens[b] are padding and come back as zeros.
    """
    load()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return call(
        q,
        pages,
        k_new.astype(q.dtype),
        v_new.astype(q.dtype),
        i32(block_tables),
        i32(q_positions),
        i32(chunk_starts),
        i32(kv_lens),
        scale=np.float32(scale),
    )
