"""The machine's physical limits, probed in the same run: GEMV bandwidth and matmul FLOP/s.

A decode step is bounded by streaming the weights from DRAM (GEMV bandwidth) or by matmul
throughput; `bench.py` turns these into each batch size's tok/s limit.
"""

from __future__ import annotations

import statistics
import time


def timeit(fn, repeats: int) -> float:
    """Median wall time of fn() over `repeats` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


PROBE_BYTES = 512 << 20  # the GEMV probe's working set: 16x a 32 MB L3, about the model's 0.4 GB


class GemvProbe:
    """Memory bandwidth: bytes/s streaming f32 matrices through a matrix-vector product.

    Eight 64 MiB matrices are read in turn, so every call streams from DRAM as a decode step
    does (its 0.4 GB of weights never fit in cache). One 64 MiB matrix read over and over
    measured 75-90 GB/s here where eight in turn measured 62-65: the 32 MB L3 kept part of
    it, and a limit that counts cache hits the model cannot have would not be a limit.

    Two readers: XLA's dot (single-threaded for a matrix-vector product) and, where it
    builds, hotswap's threaded C++ GEMV (`kernels/cpu_matmul.py`). The limit is the faster
    of the two: one our own kernel beats would not be a limit either. Both are reported.
    """

    def __init__(self, calls: int = 24):
        import jax
        import jax.numpy as jnp

        from hotswap.kernels import cpu_build, cpu_matmul

        n = 4096
        count = max(PROBE_BYTES // (n * n * 4), 1)
        self.mats = [jnp.full((n, n), 1.0 + i, jnp.float32) for i in range(count)]
        self.x = jnp.ones((1, n), jnp.float32)
        self.calls = calls
        self.readers = {"xla": jax.jit(lambda x, w: x @ w)}
        if jax.default_backend() == "cpu" and cpu_build.available():
            self.readers["hotswap"] = jax.jit(cpu_matmul.matmul)
        for f in self.readers.values():  # compile, and fault every matrix in
            jax.block_until_ready([f(self.x, w) for w in self.mats])

    def _read(self, f) -> float:
        times = []
        for i in range(self.calls):
            w = self.mats[i % len(self.mats)]
            t = time.perf_counter()
            f(self.x, w).block_until_ready()
            times.append(time.perf_counter() - t)
        return self.mats[0].nbytes / statistics.median(times)

    def close(self) -> None:
        """Free the matrices (512 MiB)."""
        self.mats.clear()

    def __call__(self) -> dict:
        """{"gemv_bytes_per_s": the faster reader, "gemv_bytes_per_s_<reader>": each}."""
        got = {f"gemv_bytes_per_s_{name}": self._read(f) for name, f in self.readers.items()}
        return {"gemv_bytes_per_s": max(got.values()), **got}


def probe_matmul_flops() -> float:
    """f32 matmul FLOP/s of XLA's dot on [512, 2048] @ [2048, 2048], median of 5."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((512, 2048), jnp.float32)
    b = jnp.ones((2048, 2048), jnp.float32)
    mm = jax.jit(lambda a, b: a @ b)
    return 2 * 512 * 2048 * 2048 / timeit(lambda: mm(a, b).block_until_ready(), 5)


def copy_bandwidth(mb: int = 256, reps: int = 5) -> dict[str, float]:
    """GB/s of read + written bytes copying a `mb` MB array (far past the L3) on 1 and on 2
    threads (halves of it), best of `reps` each: what the DRAM gives a streaming kernel here."""
    import threading

    import numpy as np

    src = np.ones(mb << 18, np.float32)
    dst = np.empty_like(src)
    out = {}
    for threads in (1, 2):
        spans = [(p[0], p[-1] + 1) for p in np.array_split(np.arange(src.size), threads)]
        best = float("inf")
        for _ in range(reps):
            workers = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in spans]
            t = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = min(best, time.perf_counter() - t)
        out[f"copy_{threads}t_GBps"] = 2 * src.nbytes / best / 1e9
    return out
