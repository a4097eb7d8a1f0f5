"""Would MKL's run-time-dispatched GEMMs beat what hotswap runs for many-row bf16 and int8
products? A probe for issue 44, not part of the engine: MKL is NOT a dependency of hotswap.

MKL comes from a scratch virtualenv outside the repository:

    python3 -m venv /tmp/mklvenv && /tmp/mklvenv/bin/pip install mkl numpy
    # MKL alone (the scratch venv has no jax):
    KMP_BLOCKTIME=0 MKL_NUM_THREADS=2 /tmp/mklvenv/bin/python benchmarks/mkl_probe.py
    # MKL, XLA:CPU and hotswap's kernels in one process (the comparison), loading MKL by path:
    KMP_BLOCKTIME=0 MKL_NUM_THREADS=2 JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.mkl_probe \\
        --mkl /tmp/mklvenv/lib/libmkl_rt.so.3
    # which code path MKL picked: MKL_VERBOSE=1 prints it with each call (--reps 1 keeps it short)

KMP_BLOCKTIME=0: Intel OpenMP's threads otherwise spin 200 ms after each MKL call, on the cores
XLA's threads then need (in one process that halved the XLA and hotswap figures).

Shapes: one bench-100m layer (hotswap/configs/bench-100m.json: hidden 768, intermediate 2048, 12
heads, 4 KV heads) as the model groups its calls: q/k/v fused [768, 1280], o [768, 768], gate/up
fused [768, 4096], down [2048, 768], for M rows of x. Each variant computes the whole layer;
variants are timed interleaved, best of --reps; GFLOP/s = 2 M sum(K N) / the best time. Weights
are cache-sized (12.6 MB bf16), so this is the compute side, not a decode step's DRAM stream.

    mkl_bf16       cblas_gemm_bf16bf16f32: bf16 x and W, f32 out
    mkl_s8u8       cblas_gemm_s8u8s32 of x (u8: quantized, + 128, as the VNNI kernels do; the
                   quantizing is not timed) and W (s8), int32 out. Row-major, MKL's u8 operand
                   is A (its column-major B: MKL swaps them), as checked against numpy
    xla_bf16_dot   jax.lax.dot_general on bf16 x and W with preferred_element_type=f32
    hotswap_bf16   cpu_matmul.bf16_matmuls (the vdpbf16ps kernel; needs AVX512_BF16)
    hotswap_int8   cpu_int8.matmuls(exact=False): int8 W, x quantized in the call (VNNI path)
    hotswap_int8_exact  cpu_int8.matmuls(exact=True): int8 W widened to f32, f32 FMA

Figures (AMD EPYC 9R14 / Zen 4 with AVX512_BF16 and AVX512_VNNI, 2 cores shared with other
work, load average ~4.4: ranges of two runs of 9 reps; MKL 2026.2.1, MKL_NUM_THREADS=2,
KMP_BLOCKTIME=0; GFLOP/s of the whole layer, one process):

    M     mkl_bf16  mkl_s8u8  xla_bf16_dot  hotswap_bf16  hotswap_int8  hotswap_int8_exact
    64    62-65     32-34     129-177       216-265       232-252       84-122
    512   58-75     36-44     155-211       145-180       216-274       69-83

MKL alone in the scratch venv: bf16 44-88, s8u8 22-45 at the same rows. MKL loses by 2-7x:
on this AMD CPU it loads libmkl_def.so (its generic code path; not libmkl_avx2 or
libmkl_avx512, so no vdpbf16ps or vpdpbusd) whatever MKL_ENABLE_INSTRUCTIONS (AVX512,
AVX512_E4) or MKL_CBWR (AVX2, AVX512, AVX512_E1) say, and MKL_VERBOSE=1 names no ISA: "oneMKL
2026 Update 2 Product build 20260915 for Intel(R) 64 architecture Intel(R) Architecture
processors, Lnx 2.60GHz lp64 intel_thread". Not integrated (the bar was > 20% over both).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys
import time
from pathlib import Path

import numpy as np

D, I, KV = 768, 2048, 256
# One layer's calls as [K, N] (weights fused as the model calls them).
SHAPES = [(D, D + 2 * KV), (D, D), (D, 2 * I), (I, D)]
ROW_MAJOR, NO_TRANS, FIX_OFFSET = 101, 111, 173  # mkl_cblas.h's enums


def find_mkl(path: str | None) -> ctypes.CDLL:
    """libmkl_rt from `path`, else from the running virtualenv's lib/ (pip's mkl wheel)."""
    found = [path] if path else sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    if not found:
        raise SystemExit("no libmkl_rt.so: run with the scratch venv's python or pass --mkl PATH")
    lib = ctypes.CDLL(found[0])
    p, i, f = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float  # MKL_INT: LP64's int32
    lib.cblas_gemm_bf16bf16f32.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    lib.cblas_gemm_s8u8s32.argtypes = [
        i,
        i,
        i,
        i,
        i,
        i,
        i,
        f,
        p,
        i,
        ctypes.c_int8,
        p,
        i,
        ctypes.c_int8,
        f,
        p,
        i,
        p,
    ]
    return lib


def mkl_kernels() -> list[str]:
    """The ISA-specific MKL libraries this process has loaded (libmkl_avx512, _avx2, _def, ...):
    which code path MKL's dispatcher picked for this CPU."""
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    names = {Path(line.split()[-1]).name for line in maps.splitlines() if "libmkl_" in line}
    return sorted(
        n for n in names if not n.startswith(("libmkl_rt", "libmkl_core", "libmkl_intel", "libmkl_gnu"))
    )


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """f32 -> bf16 (round to nearest even) as uint16 bits: numpy has no bf16 dtype."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def mkl_variants(lib, x: np.ndarray, ws: list[np.ndarray]) -> dict:
    """The MKL layers for x [M, K=768|2048 per call] (each call's x is a slice of one f32 x)."""
    m = x.shape[0]
    xs = [np.ascontiguousarray(x[:, :k]) for k, _ in SHAPES]
    xb, wb = [bf16_bits(a) for a in xs], [bf16_bits(w) for w in ws]
    cb = [np.empty((m, n), np.float32) for _, n in SHAPES]
    # W int8 [K, N] with per-column scales; x per-row scale, + 128 as u8.
    w8 = [np.clip(np.rint(w / (np.abs(w).max(0) / 127)), -127, 127).astype(np.int8) for w in ws]
    xq = [(np.rint(a / (np.abs(a).max(1, keepdims=True) / 127)) + 128).astype(np.uint8) for a in xs]
    c8 = [np.empty((m, n), np.int32) for _, n in SHAPES]
    co = np.zeros(1, np.int32)

    def bf16():
        for (k, n), a, w, c in zip(SHAPES, xb, wb, cb, strict=True):
            lib.cblas_gemm_bf16bf16f32(
                ROW_MAJOR, NO_TRANS, NO_TRANS, m, n, k, 1.0, a.ctypes.data, k, w.ctypes.data, n, 0.0, c.ctypes.data, n
            )  # fmt: skip

    def s8u8():
        for (k, n), a, w, c in zip(SHAPES, xq, w8, c8, strict=True):
            lib.cblas_gemm_s8u8s32(
                ROW_MAJOR, NO_TRANS, NO_TRANS, FIX_OFFSET, m, n, k, 1.0, a.ctypes.data, k, 0, w.ctypes.data, n, 0,
                0.0, c.ctypes.data, n, co.ctypes.data,
            )  # fmt: skip

    # The products' checks: bf16 against f32's, the int8 sums against numpy's.
    bf16()
    want = [xs[i].astype(np.float64) @ ws[i] for i in range(len(SHAPES))]
    for c, y in zip(cb, want, strict=True):
        assert np.abs(c - y).max() <= 0.02 * np.abs(y).max(), "mkl bf16 result off"
    s8u8()
    exact = xq[3].astype(np.int64) @ w8[3].astype(np.int64)
    assert np.array_equal(c8[3], exact), "mkl s8u8s32 result off"
    return {"mkl_bf16": bf16, "mkl_s8u8": s8u8}


def project_variants(x: np.ndarray, ws: list[np.ndarray]) -> dict:
    """XLA's bf16 dot and hotswap's kernels on the same layer (needs the project venv)."""
    import jax
    import jax.numpy as jnp

    from hotswap.kernels import cpu_int8, cpu_isa, cpu_matmul

    xs = [jnp.asarray(x[:, :k]) for k, _ in SHAPES]
    xb, wb = [a.astype(jnp.bfloat16) for a in xs], [jnp.asarray(w, jnp.bfloat16) for w in ws]
    scales = [np.abs(w).max(0, keepdims=True) / 127 for w in ws]
    w8 = [
        (jnp.asarray(np.clip(np.rint(w / s), -127, 127).astype(np.int8)), jnp.asarray(s.astype(np.float32)))
        for w, s in zip(ws, scales, strict=True)
    ]
    dot = lambda a, w: jax.lax.dot_general(a, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)  # noqa: E731
    out = {"xla_bf16_dot": (jax.jit(lambda xs, ws: [dot(a, w) for a, w in zip(xs, ws, strict=True)]), xb, wb)}
    if "avx512_bf16" in cpu_isa.runnable():
        out["hotswap_bf16"] = (
            jax.jit(lambda xs, ws: [cpu_matmul.bf16_matmuls(a, [w])[0] for a, w in zip(xs, ws, strict=True)]),
            xb,
            wb,
        )
    for name, exact in (("hotswap_int8", False), ("hotswap_int8_exact", True)):
        fn = jax.jit(
            lambda xs, ws, exact=exact: [
                cpu_int8.matmul(a, d, s, exact=exact) for a, (d, s) in zip(xs, ws, strict=True)
            ]
        )
        out[name] = (fn, xs, w8)
    return {
        name: (lambda fn=fn, a=a, w=w: jax.block_until_ready(fn(a, w))) for name, (fn, a, w) in out.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mkl", help="path of libmkl_rt.so (default: the running venv's)")
    ap.add_argument("--rows", default="64,512")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    lib = find_mkl(args.mkl)
    try:  # the project venv (run as a module from the repository): XLA and hotswap too
        import jax  # noqa: F401

        import hotswap.kernels  # noqa: F401

        project = True
    except ImportError:
        project = False
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32) for k, n in SHAPES]
    flops_per_row = 2 * sum(k * n for k, n in SHAPES)
    print(f"MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS', '(unset)')}, layer {SHAPES} as [K, N]")
    for m in [int(r) for r in args.rows.split(",")]:
        x = rng.standard_normal((m, I)).astype(np.float32)
        runs = mkl_variants(lib, x, ws)
        if project:
            runs |= project_variants(x, ws)
        best = dict.fromkeys(runs, float("inf"))
        for fn in runs.values():
            fn()  # warm (and compile)
        for _ in range(args.reps):
            for name, fn in runs.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
        if m == int(args.rows.split(",")[0]):
            print(f"MKL's ISA libraries loaded: {mkl_kernels()}")
        print(
            f"M={m}: "
            + ", ".join(f"{n} {flops_per_row * m / t / 1e9:.0f}" for n, t in best.items())
            + " GFLOP/s"
        )


if __name__ == "__main__":
    main()
