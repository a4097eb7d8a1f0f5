"""Same-process A/B of the C++ decode matmul (`kernels/cpu/small_matmul.cc`) against other
builds of it and XLA's dot, over a chain of bench-100m's layer matmuls.

    python benchmarks/matmul_bench.py [OLD_SOURCE.cc ...] [--rows 1,2,4,8,12,16,24,32] [--reps 15]
        [--min] [--shared] [--huge] [--no-xla] [--dtype float32|bfloat16]

The chain is 12 layers of q/k/v [768, 768|256|256], o [768, 768], gate/up [768, 2048] and
down [2048, 768], each layer its own f32 weights (302 MB, read from DRAM as in a decode step,
not from cache), calls grouped as the model groups them (`cpu_matmul.matmuls`). Each source
given is built (same flags as `cpu_build`) into a temp dir and registered under its own FFI
target; the worktree's kernel is "new". Timings are interleaved (old, new, xla, old, ...) and
the medians (or, with --min, the fastest reps: less swayed by other processes) printed with
GFLOP/s: this machine's speed drifts, so only ratios within one run mean anything. --shared
runs one layer's weights 12 times (25 MB, cache-resident: not a decode step), --huge puts the
weights on 2 MB pages first. --dtype bfloat16 runs a bf16 model's chain (151 MB of weights, the
activations rounded to bf16 between matmuls): "new" is then `cpu_matmul.matmuls` on bf16 x
(the `vdpbf16ps` kernel or XLA's bf16 dot with AVX512_BF16), "widen" the same x widened to f32
first (the f32-FMA tiles, XLA's f32 dot above their rows), "xla" XLA's bf16 dot with f32
accumulation at every row count.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.kernels import cpu_build, cpu_matmul

D, I, LAYERS = 768, 2048, 12
SHAPES = [(D, D), (D, 256), (D, 256), (D, D), (D, I), (D, I), (I, D)]


def build(source: Path, tag: int) -> str:
    """Compile `source` (its own dir on the include path) and register it as a new target."""
    out = Path(tempfile.mkdtemp()) / f"mm{tag}.so"
    cmd = [cpu_build._compiler(), *cpu_build.FLAGS, "-w", f"-I{jax.ffi.include_dir()}", f"-I{source.parent}"]
    subprocess.run([*cmd, str(source), "-o", str(out)], check=True)
    lib = ctypes.cdll.LoadLibrary(str(out))
    target = f"hotswap_bench_mm{tag}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.HotswapSmallMatmul), platform="cpu")
    return target


def collapse_to_huge_pages(a: jax.Array) -> None:
    """madvise(MADV_COLLAPSE) the 2 MB pages inside `a`'s buffer (Linux >= 6.1): a decode
    step that streams weights on 4 KB pages pays a page walk per weight row segment."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    p, huge = a.unsafe_buffer_pointer(), 2 << 20
    lo, hi = -(-p // huge) * huge, (p + a.nbytes) // huge * huge
    if hi > lo and libc.madvise(lo, hi - lo, 25) != 0:  # 25: MADV_COLLAPSE
        raise OSError(ctypes.get_errno(), "madvise(MADV_COLLAPSE) failed")


def ffi_matmuls(target: str):
    def mm(x, ws):
        out = [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in ws]
        return jax.ffi.ffi_call(target, out)(x, *ws)

    return mm


def chain(mm, dtype=jnp.float32):
    """The layers' matmuls on x held in `dtype` between them (a bf16 model's activations)."""

    def mms(x, ws):
        return [y.astype(dtype) for y in mm(x, ws)]

    @jax.jit
    def run(x, layers):
        x = x.astype(dtype)
        for ws in layers:
            q, k, v = mms(x, ws[0:3])
            x = x + mms(q, ws[3:4])[0] + 0.0 * (k.sum() + v.sum())
            g, u = mms(x, ws[4:6])
            x = x + mms(jax.nn.silu(g) * u, ws[6:7])[0]
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))  # keeps values O(1)
        return x.astype(jnp.float32)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path, nargs="*")
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32")  # 64, 512: a rollout step, a prefill
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shared", action="store_true", help="one layer's weights 12 times (25 MB: from L3)")
    ap.add_argument("--no-xla", action="store_true")
    ap.add_argument("--min", action="store_true", help="the fastest rep, not the median (a busy machine)")
    ap.add_argument("--huge", action="store_true", help="weights on 2 MB pages (MADV_COLLAPSE)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="of the weights")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    wdt = jnp.dtype(args.dtype)
    layers = [
        [jnp.asarray(rng.standard_normal(s, np.float32) * 0.02, wdt) for s in SHAPES] for _ in range(LAYERS)
    ]
    if args.shared:
        layers = [layers[0]] * LAYERS
    if args.huge:
        for w in (w for ws in layers for w in ws):
            collapse_to_huge_pages(w)
    fns = {f"old{i}": chain(ffi_matmuls(build(src, i))) for i, src in enumerate(args.old)}
    fns["new"] = chain(cpu_matmul.matmuls, wdt)
    if wdt == jnp.bfloat16:
        fns["widen"] = chain(lambda x, ws: cpu_matmul.matmuls(x.astype(jnp.float32), ws), wdt)
    if not args.no_xla:
        fns["xla"] = chain(lambda x, ws: [jnp.dot(x, w, preferred_element_type=jnp.float32) for w in ws], wdt)
    flops_per_row = 2 * LAYERS * sum(math.prod(s) for s in SHAPES)
    print("rows " + " ".join(f"{name:>16}" for name in fns) + "   (ms, GFLOP/s)")
    for m in [int(r) for r in args.rows.split(",")]:
        x = jnp.asarray(rng.standard_normal((m, D), np.float32))
        same = chain(lambda x, ws: [x.astype(jnp.float32) @ w.astype(jnp.float32) for w in ws], wdt)
        ref = np.asarray(same(x, layers))
        for name, f in fns.items():
            got = np.asarray(f(x, layers))
            if wdt == jnp.float32:
                np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3, err_msg=name)
            else:  # bf16 activations: a sum's order may flip a rounding, and 12 layers amplify it
                err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
                assert err < 2e-2, f"{name}: relative error {err:.3g} against the same chain in f32 sums"
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.reps):
            for name, f in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(x, layers))
                times[name].append(time.perf_counter() - t0)
        med = {name: (min if args.min else statistics.median)(ts) for name, ts in times.items()}
        cells = [f"{med[n] * 1e3:7.2f} ({flops_per_row * m / med[n] / 1e9:4.0f})" for n in fns]
        print(f"{m:4d} " + " ".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
