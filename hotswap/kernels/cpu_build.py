"""Build and register hotswap's C++ XLA FFI kernels for the CPU backend (`kernels/cpu/*.cc`).

Each source is compiled on first use with the system C++ compiler against the FFI headers
that ship with jaxlib (`jax.ffi.include_dir()`), with `-march=native` as llama.cpp builds
by default, and cached by a hash of source, shared headers, flags, compiler, jaxlib version and
the instruction set `-march=native` resolves to on this CPU (`cpu_target.native_target`) under
`kernels/` of hotswap's cache directory (`hotswap/cache_dir.py`: `$HOTSWAP_CACHE_DIR`, default
`~/.cache/hotswap`): about 3 s once per machine. Beside each library a small JSON manifest
names the target it was built for; a library whose manifest names another target (a cache
directory copied from another CPU, a renamed file) is rebuilt before anything loads it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from hotswap.cache_dir import cache_dir
from hotswap.errors import ConfigError
from hotswap.kernels.cpu_target import native_target

SOURCES = Path(__file__).with_name("cpu")
# -fopenmp-simd: only the `omp simd` pragmas (vector reductions), no OpenMP runtime.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fopenmp-simd")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _library_path(source: Path, cxx: str, target: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    headers = [h.read_bytes() for h in sorted(SOURCES.glob("*.h"))]  # shared by every kernel
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                *headers,
                " ".join(FLAGS).encode(),
                version.encode(),
                jax.__version__.encode(),
                target.encode(),
            ]
        )
    ).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{key}.so"


def _manifest(library: Path) -> Path:
    return library.with_suffix(".json")


def _built_for(library: Path) -> str | None:
    """The target the library's manifest names; None when either file is missing or unreadable."""
    try:
        return json.loads(_manifest(library).read_text())["target"] if library.exists() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _build(cxx: str, source: Path, out: Path, target: str) -> None:
    """Compile to a temporary name and rename: concurrent builders never see a partial file.
    The manifest is written first, so a library is never present without one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ConfigError(f"building a CPU kernel failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        _manifest(out).write_text(json.dumps({"target": target, "source": source.name}))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def built(name: str) -> Path:
    """`cpu/<name>.cc` built for this CPU: the cached library, or a new build when there is none
    or its manifest names another target. Raises ConfigError when it cannot build."""
    cxx = _compiler()
    if cxx is None:
        raise ConfigError("hotswap's CPU kernels need a C++ compiler (set CXX, or install g++)")
    source = SOURCES / f"{name}.cc"
    target = native_target(cxx)
    path = _library_path(source, cxx, target)
    if _built_for(path) != target:
        _build(cxx, source, path, target)
    return path


@functools.cache
def library(name: str) -> ctypes.CDLL:
    """`built(name)`, loaded (once per process)."""
    return ctypes.cdll.LoadLibrary(str(built(name)))


@functools.cache
def register(name: str, symbol: str) -> str:
    """Register the handler `symbol` of `cpu/<name>.cc` (built if needed) as an FFI target on
    the CPU platform; returns the target name. Raises ConfigError when it cannot build."""
    target = f"hotswap_{symbol}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library(name), symbol)), platform="cpu")
    return target


@functools.cache
def available() -> bool:
    """True when every CPU kernel builds and loads here (cached for the process). Registers
    every target, so a program loaded without tracing (programs/step_cache.py) finds them."""
    try:
        register("paged_attention", "HotswapPagedAttention")
        register("paged_attention", "HotswapPagedAttentionWrite")
        register("small_matmul", "HotswapSmallMatmul")
        register("small_matmul", "HotswapFixedMatmul")
        register("bf16_matmul", "HotswapBf16Matmul")
        register("routed_experts", "HotswapRoutedExperts")
        register("row_stats", "HotswapRowStats")
        register("keep_threshold", "HotswapKeepThreshold")
        register("categorical", "HotswapCategorical")
        register("all_finite", "HotswapAllFinite")
        register("convert_finite", "HotswapConvertFinite")
        register("lora_merge", "HotswapLoraMerge")
        register("int8_matmul", "HotswapInt8Matmuls")
        register("block_matmul", "HotswapBlockMatmul")
        register("block_matmul", "HotswapBlockRows")
    except (ConfigError, OSError):
        return False
    return True
