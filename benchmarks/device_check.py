"""The prepared device check: what a lent TPU (or GPU) must show, in one run of a few minutes.

    python benchmarks/device_check.py [--json PATH] [--budget-s S]   # on the accelerator
    python benchmarks/device_check.py --smoke [--json PATH]          # on CPU, tiny shapes, seconds

`benchmarks/device_check.sh` installs what the platform needs and wraps this with timeouts.
Parts, each a JSON entry with `ok` (a part past the time budget is recorded as skipped):

- `kernel_tests`: tests/kernels/test_kernels.py and tests/kernels/test_reference_attention.py on the device
  platform (not with --smoke: the suite runs them on CPU). On TPU the Pallas kernel compiles
  with Mosaic; elsewhere it only runs interpreted (it uses TPU scalar prefetch), so on GPU these
  check the jnp reference under XLA:GPU and the kernel's interpreted semantics.
- `kernel`: Pallas == the jnp reference on a few awkward shapes, f32 and bf16, head_dim 64/128.
- `engine`: `LLM(attention="pallas")` == `LLM(attention="reference")` through `generate`
  (chunked prefill, prefix hits, decode): greedy tokens and log-probs, f32 and bf16.
- `decode`: decode tok/s at batch 1/32/128 over 1,024-token contexts for a Llama-3.2-1B-shaped
  random bf16 model (hotswap/configs/llama-3.2-1b.json), timed on the engine's jitted step
  (`runner.run_step`, the engine's own decode inputs and one host copy per step, as serving
  runs it), and the fraction of the chip's HBM bandwidth it reaches: the bytes a step must read
  (every weight but the embedding table, the B embedding rows, and each row's KV pages)
  divided by the step time and the chip's peak.

f32 comparisons run with `jax.default_matmul_precision("highest")`: TPU's default runs f32
matmuls as bf16 passes, which would make two exact implementations differ by ~1e-2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# Peak HBM bandwidth per chip (bytes/s): the denominators of the measured fraction.
PEAK_BYTES_PER_S = {
    "v5e": 819e9,
    "v6e": 1640e9,
    "v5p": 2765e9,
    "v4": 1228e9,
    "H200": 4.8e12,
    "H100": 3.35e12,
}


def chip_name(device) -> str | None:
    """The PEAK_BYTES_PER_S key of a jax device, from its device_kind ("TPU v5 lite", "NVIDIA H200")."""
    kind = device.device_kind.lower()
    for needle, name in (
        ("v5 lite", "v5e"),
        ("v5e", "v5e"),
        ("v6", "v6e"),
        ("v5p", "v5p"),
        ("v5", "v5p"),
        ("v4", "v4"),
        ("h200", "H200"),
        ("h100", "H100"),
    ):
        if needle in kind:
            return name
    return None


class Budget:
    """Wall-clock budget shared by the parts: a part that would start past it is skipped."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _attn_case(rng, *, b, c, hq, hkv, hd, ps, p, dtype, start):
    num_pages = b * p + 2
    pages = rng.standard_normal((num_pages, ps, 2 * hkv, hd), np.float32)
    tables = rng.permutation(np.arange(1, num_pages))[: b * p].reshape(b, p).astype(np.int32)
    lens = np.array([max(1, min(p * ps, start + c - i * 3)) for i in range(b)], np.int32)
    lens[-1] = 0  # a padding row
    pos = np.stack([np.arange(n - c, n) if n else np.zeros(c) for n in lens]).astype(np.int32)
    q = rng.standard_normal((b, c, hq, hd), np.float32)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(pages, dtype),
        jnp.asarray(tables),
        jnp.asarray(pos),
        jnp.asarray(lens),
    )


def check_kernel(smoke: bool) -> dict:
    """Pallas against the jnp reference: max |difference| per case (compiled on TPU)."""
    from hotswap.kernels import ragged_paged_attention, reference

    rng = np.random.default_rng(0)
    hds = (16,) if smoke else (64, 128)
    ctx = 40 if smoke else 1000
    cases = []
    for hd in hds:
        for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)):
            for c in (1, 16):  # a decode batch, a prefill chunk over cached pages
                if smoke and (c == 16) == (dtype == jnp.float32):
                    continue  # two cases: f32 decode, bf16 prefill
                p = -(-(ctx + c) // 16)
                args = _attn_case(rng, b=3, c=c, hq=8, hkv=2, hd=hd, ps=16, p=p, dtype=dtype, start=ctx)
                scale = 1.0 / math.sqrt(hd)
                with jax.default_matmul_precision("highest"):
                    ref = jax.jit(reference.paged_attention, static_argnames="scale")(*args, scale=scale)
                q, pages, *rest = args  # the kernel reads the lane-folded layout (Backend.page_shape)
                out = ragged_paged_attention.paged_attention(
                    q, reference.fold_pages(pages), *rest, scale=scale
                )
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                cases.append(
                    {"hd": hd, "dtype": jnp.dtype(dtype).name, "c": c, "max_abs_err": err, "ok": err <= tol}
                )
    mode = "compiled" if jax.default_backend() == "tpu" else "interpreted"
    return {"ok": all(x["ok"] for x in cases), "pallas": mode, "cases": cases}


def check_engine(smoke: bool, workdir: Path) -> dict:
    """Greedy generate with the Pallas kernel against the jnp reference, same weights."""
    from hotswap import LLM, SamplingParams
    from hotswap.checkpoint.create import create_checkpoint

    shapes = (
        {"hd16": {}}
        if smoke
        else {
            "hd64": {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
            "hd128": {"hidden_size": 512, "intermediate_size": 1024, "head_dim": 128},
        }
    )
    new = 1 if smoke else 16
    long = list(range(3, 43))  # 40 tokens: chunked at 32 per step; round 2 hits its full pages
    rounds = [[long, [1, 2, 3, 4, 5], list(range(7, 28))], [long, long[:24] + list(range(300, 309))]]
    if smoke:  # one prefill call: the fewest programs to compile (interpreted)
        rounds = [[long[:20], [1, 2, 3, 4, 5]]]
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    runs = []
    for shape, overrides in shapes.items():
        model_dir = create_checkpoint(
            workdir / shape, preset="tiny", arch="llama", seed=3, overrides=overrides
        )
        for dtype in ("float32",) if smoke else ("float32", "bfloat16"):
            outs = {}
            for impl in ("reference", "pallas"):
                ctx = (
                    jax.default_matmul_precision("highest")
                    if dtype == "float32"
                    else contextlib.nullcontext()
                )
                with ctx:
                    llm = LLM(
                        model_dir,
                        attention=impl,
                        dtype=dtype,
                        page_size=16,
                        max_model_len=128,
                        max_num_seqs=4,
                        max_num_batched_tokens=32,
                        warmup=False,
                    )
                    outs[impl] = [o.outputs[0] for r in rounds for o in llm.generate(r, sp, use_tqdm=False)]
            same = [
                a.token_ids == b.token_ids for a, b in zip(outs["reference"], outs["pallas"], strict=True)
            ]
            diff = (
                max(
                    float(np.max(np.abs(np.subtract(a.logprobs, b.logprobs))))
                    for a, b, s in zip(outs["reference"], outs["pallas"], same, strict=True)
                    if s
                )
                if any(same)
                else float("inf")
            )
            # f32: identical tokens; bf16: the two accumulate in different orders, so a near-tie
            # may flip a token (and its continuation): most sequences identical, close log-probs.
            ok = (
                all(same) and diff <= 1e-3
                if dtype == "float32"
                else sum(same) >= len(same) - 1 and diff <= 0.1
            )
            runs.append(
                {
                    "shape": shape,
                    "dtype": dtype,
                    "same_tokens": f"{sum(same)}/{len(same)}",
                    "max_abs_dlogprob": diff,
                    "ok": ok,
                }
            )
    return {"ok": all(r["ok"] for r in runs), "runs": runs}


class _Seq:
    """What `Runner.decode_batch` reads of a sequence: a decode row at position `n`, on the base
    weights (no LoRA adapter slot)."""

    lora_slot = -1

    def __init__(self, seq_id: int, n: int):
        self.seq_id, self.num_computed = seq_id, n

    def token_slice(self, start: int, n: int) -> list[int]:
        return [(self.seq_id * 7 + start) % 500 + 1] * n  # inside any vocabulary here


def _random_params(abstract, seed: int = 0):
    """Device params of `abstract`'s shapes and dtypes: N(0, 0.02) matrices, norms at 1."""

    @jax.jit
    def make(key):
        leaves, tree = jax.tree.flatten(abstract)
        keys = jax.random.split(key, len(leaves))
        out = [
            jnp.ones(s.shape, s.dtype)
            if len(s.shape) == 1
            else (0.02 * jax.random.normal(k, s.shape)).astype(s.dtype)
            for s, k in zip(leaves, keys, strict=True)
        ]
        return jax.tree.unflatten(tree, out)

    return make(jax.random.key(seed))


def check_decode(smoke: bool, budget: Budget) -> dict:
    """Decode tok/s at each batch size over `ctx`-token contexts, and the HBM fraction."""
    from hotswap.checkpoint.create import load_preset
    from hotswap.engine.engine import Engine
    from hotswap.engine.pages import PagePool
    from hotswap.engine.sampling import SamplingParams
    from hotswap.engine_config import EngineConfig
    from hotswap.model.config import ModelConfig
    from hotswap.model.params import abstract_params
    from hotswap.programs.sampler import SamplingArrays
    from hotswap.programs.step import run_step

    if smoke:
        hf = {**load_preset("tiny"), "architectures": ["LlamaForCausalLM"]}
        batches, ctx, steps = (1, 4), 32, 3
    else:
        hf, batches, ctx, steps = load_preset("llama-3.2-1b"), (1, 32, 128), 1024, 20
    mcfg = ModelConfig.from_hf(hf, dtype="bfloat16")
    impl = "auto"  # Backend.choose: the compiled Pallas kernel on TPU
    ps = 16
    ecfg = EngineConfig(
        page_size=ps,
        max_model_len=ctx + ps,
        max_num_seqs=max(batches),
        max_num_batched_tokens=256,
        num_pages=max(batches) * math.ceil((ctx + ps) / ps) + 1,
        attention=impl,
        compilation_cache=False,
    )
    params = _random_params(abstract_params(mcfg))
    engine = Engine(mcfg, params, ecfg, warmup=False, progress=False)
    run, backend, impl = engine.runner, engine.backend, engine.ecfg.attention
    params, pages = engine.state.params, engine.state.kv.pages
    pps = ecfg.pages_per_seq
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) - params["embed"].nbytes
    kv_token_bytes = mcfg.num_layers * 2 * mcfg.num_kv_heads * mcfg.head_dim * jnp.dtype(mcfg.dtype).itemsize
    device = jax.devices()[0]
    chip = chip_name(device)
    peak = PEAK_BYTES_PER_S.get(chip)
    rows = []
    for b in batches:
        if budget.left() < 30:
            rows.append({"batch": b, "skipped": "time budget"})
            continue
        seqs = [_Seq(i, ctx) for i in range(b)]
        tables = {i: tuple(range(1 + i * pps, 1 + (i + 1) * pps)) for i in range(b)}
        batch = run.decode_batch(seqs, PagePool.owning(ecfg.num_pages, tables))
        sa = SamplingArrays.from_rows(
            [(SamplingParams(temperature=0.0), 0, 0)] * b, batch.sample_idx.shape[0], mcfg.vocab_size
        )
        t0 = time.perf_counter()
        pages, out, _ = run_step(params, pages, batch, sa, cfg=mcfg, backend=backend)
        jax.device_get(out)
        first = time.perf_counter() - t0
        for _ in range(2):
            pages, out, _ = run_step(params, pages, batch, sa, cfg=mcfg, backend=backend)
            jax.device_get(out)
        t0 = time.perf_counter()
        for _ in range(steps):  # one host copy per step, as the engine does
            pages, out, _ = run_step(params, pages, batch, sa, cfg=mcfg, backend=backend)
            jax.device_get(out)
        step_s = (time.perf_counter() - t0) / steps
        kv_pages = b * math.ceil((ctx + 1) / ps)
        read = (
            weight_bytes
            + b * mcfg.hidden_size * jnp.dtype(mcfg.dtype).itemsize
            + kv_pages * ps * kv_token_bytes
        )
        rows.append(
            {
                "batch": b,
                "step_ms": round(step_s * 1e3, 3),
                "tok_s": round(b / step_s, 1),
                "bytes_read_per_step": int(read),
                "bytes_per_s": read / step_s,
                "hbm_fraction": round(read / step_s / peak, 3) if peak else None,
                "first_step_s": round(first, 2),
            }
        )
    return {
        "ok": True,
        "model": "llama-3.2-1b" if not smoke else "tiny",
        "dtype": mcfg.dtype,
        "impl": impl,
        "context": ctx,
        "device_kind": device.device_kind,
        "chip": chip,
        "peak_bytes_per_s": peak,
        "weight_bytes": int(weight_bytes),
        "rows": rows,
    }


def run_kernel_tests(budget: Budget) -> dict:
    """The kernel test files on the device platform, in a subprocess bounded by the budget."""
    platform = {"tpu": "tpu", "gpu": "cuda"}.get(jax.default_backend(), "cpu")
    env = {**os.environ, "JAX_PLATFORMS": platform, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/kernels/test_kernels.py",
        "tests/kernels/test_reference_attention.py",
    ]
    try:
        p = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(30, budget.left() / 3)
        )
    except subprocess.TimeoutExpired as e:
        return {"ok": False, "error": "timeout", "tail": (e.stdout or b"")[-2000:].decode(errors="replace")}
    return {
        "ok": p.returncode == 0,
        "rc": p.returncode,
        "platform": platform,
        "tail": (p.stdout + p.stderr)[-2000:],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any backend (CPU: seconds)")
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--budget-s", type=float, default=360.0, help="skip parts that would start past this")
    ap.add_argument("--parts", default="kernel_tests,kernel,engine,decode")
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)
    parts = [p for p in args.parts.split(",") if p and not (args.smoke and p == "kernel_tests")]
    summary = {
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "jax": jax.__version__,
        "smoke": args.smoke,
        "parts": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        calls = {
            "kernel_tests": lambda: run_kernel_tests(budget),
            "kernel": lambda: check_kernel(args.smoke),
            "engine": lambda: check_engine(args.smoke, Path(tmp)),
            "decode": lambda: check_decode(args.smoke, budget),
        }
        for name in parts:
            t0 = time.monotonic()
            if budget.left() < 20:
                summary["parts"][name] = {"ok": False, "skipped": "time budget"}
                continue
            try:
                summary["parts"][name] = calls[name]()
            except Exception as e:  # a part's failure is a result: the others still run
                summary["parts"][name] = {
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:],
                }
            summary["parts"][name]["seconds"] = round(time.monotonic() - t0, 1)
            print(
                f"device_check: {name}: {json.dumps(summary['parts'][name], default=str)[:1500]}", flush=True
            )
    summary["ok"] = all(p.get("ok") for p in summary["parts"].values())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
