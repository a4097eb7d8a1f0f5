"""JAX's persistent compilation cache for hotswap's steps, and what warm-up got from it.

Owns two things:
- `enable`: called when an Engine is created (not at `import hotswap`, so a JAX cache the user
  configured stays theirs). It points JAX's persistent compilation cache at `xla/<cpu>/` under
  hotswap's cache directory (`hotswap/cache_dir.py`), so a new process with the same model,
  engine shapes and backend loads the warm-up's programs instead of compiling them again.
  `<cpu>` is this host's CPU model and instruction sets (`kernels/cpu_target.host().key`):
  JAX's own key does not name them, and XLA:CPU compiles for the host's features, so a
  cache directory carried to another CPU starts a fresh cache there instead of running code
  built for instructions it may lack.
  Off with `EngineConfig.compilation_cache=False` (`LLM(compilation_cache=False)`) or
  `HOTSWAP_COMPILATION_CACHE=0`. When `jax_compilation_cache_dir` is already set (by
  `jax.config.update` or `JAX_COMPILATION_CACHE_DIR`), that cache is used and left as it is.
- `CompileCounter`: counts the programs JAX hands to XLA and those of them loaded from that
  cache, from JAX's monitoring events; warm-up shows the counts in its progress bar.

The C++ CPU kernels are XLA FFI custom calls: a loaded program finds its targets by name, so
they must be registered before it is loaded. Tracing the step registers them
(`kernels/cpu_build.register`), and JAX traces and lowers a program (its cache key is the
lowered program) before it looks in the cache, so they always are.

JAX writes only programs that took at least `jax_persistent_cache_min_compile_time_secs` to
compile (1 s by default). A small model's steps compile in about that time, more or less with
the machine's load, so with that default a start-up would load some steps and compile the
rest, changing from run to run. When hotswap turns the cache on, it
writes every program (threshold 0) unless that threshold was changed from JAX's default:
loading one takes milliseconds.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax
from jax import monitoring

from hotswap.cache_dir import cache_dir
from hotswap.kernels.cpu_target import host

ENV = "HOTSWAP_COMPILATION_CACHE"
_JAX_MIN_COMPILE_TIME = 1.0  # jax_persistent_cache_min_compile_time_secs's default (jax/_src/config.py)
# Every program JAX hands to XLA, compiled or loaded, records one of these (jax/_src/interpreters/pxla.py).
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# ... and one of these when it was loaded from the persistent cache (jax/_src/compiler.py).
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def enable(on: bool = True) -> Path | None:
    """Turn JAX's persistent compilation cache on at `cache_dir()/"xla"/<cpu>`, unless `on` is False,
    `$HOTSWAP_COMPILATION_CACHE` is `0`, or JAX's cache directory is already set (then that one
    is used as it is). Returns the directory in use, or None when hotswap turned nothing on.
    Off never turns off a cache already on in this process (the user's, or an earlier Engine's)."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    if not on or os.environ.get(ENV, "1") == "0":
        return None
    path = cache_dir() / "xla" / host().key
    jax.config.update("jax_compilation_cache_dir", str(path))
    if jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_MIN_COMPILE_TIME:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


class CompileCounter:
    """`with CompileCounter() as c: ...`: `c.programs` handed to XLA meanwhile, `c.loaded` of
    them from the persistent cache (the rest were compiled), over every thread. JAX records
    both events in the compiling thread, so `c.mine()` gives the calling thread's own counts:
    warm-up's threads share one counter (one listener, registered before they start) and each
    reads what its step took."""

    def __init__(self):
        self._counts: dict[int, list[int]] = {}  # thread -> [programs, loaded]

    def _add(self, i: int) -> None:
        self._counts.setdefault(threading.get_ident(), [0, 0])[i] += 1

    def _on_event(self, name: str, **_kw) -> None:
        if name == _CACHE_HIT:
            self._add(1)

    def _on_duration(self, name: str, _secs: float, **_kw) -> None:
        if name == _BACKEND_COMPILE:
            self._add(0)

    @property
    def programs(self) -> int:
        return sum(c[0] for c in list(self._counts.values()))

    @property
    def loaded(self) -> int:
        return sum(c[1] for c in list(self._counts.values()))

    def mine(self) -> tuple[int, int]:
        """(programs, loaded) of the calling thread so far."""
        return tuple(self._counts.get(threading.get_ident(), (0, 0)))

    def __enter__(self) -> CompileCounter:
        monitoring.register_event_listener(self._on_event)
        monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_listener(self._on_event)
        monitoring.unregister_event_duration_listener(self._on_duration)


def describe(counts: dict[str, int]) -> str:
    """`3 compiled, 8 from cache`: warm-up's bucket counts for its progress bar (zeros left out)."""
    return ", ".join(f"{n} {what.replace('_', ' ')}" for what, n in counts.items() if n)
