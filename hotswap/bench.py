"""`hotswap bench`: hotswap vs HF transformers on one checkpoint, in one process, as ratios.

Everything is measured in the same run (this kind of machine is shared and noisy):
the physical limits are probed (matmul FLOP/s first; GEMV bandwidth first and again
between the timed repeats of each batch size), and each engine runs the same prompts
with the same thread count. Prints a table and one
JSON line, and writes a PNG of throughput vs batch size.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from hotswap import bench_peers


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="decode / serving / prefix / update benchmarks vs HF transformers")
    p.add_argument("model_dir", nargs="?", help="HF model dir (default: create the bench-100m preset)")
    p.add_argument("--batches", default="1,16,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serving-requests", type=int, default=64)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument(
        "--peers",
        default=None,
        help="peer engines, e.g. llama_cpp,vllm or none (default: the installed ones)",
    )
    p.add_argument("--peers-dir", default="benchmarks/peers", help="peer drivers and their .venv-* dirs")
    p.add_argument("--out", default="runs/bench")
    p.set_defaults(func=run)


def _timeit(fn, repeats: int) -> float:
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
    return 2 * 512 * 2048 * 2048 / _timeit(lambda: mm(a, b).block_until_ready(), 5)


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, min(vocab, 700), length).tolist() for _ in range(n)]


def hotswap_decode(llm, prompts: list[list[int]], new_tokens: int, repeats: int, before_each=None) -> float:
    """Decode tok/s: time from every sequence having its first token until all finish.
    `before_each()` runs before each timed repeat (the bandwidth probe, taken next to it)."""
    from hotswap import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    def once() -> float:
        eng.reset_prefix_cache()
        rids = [eng.add_request(None, p, sp) for p in prompts]
        while any(not eng.requests[r].seqs[0].output_ids for r in rids if r in eng.requests):
            eng.step()
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        return time.perf_counter() - t

    once()
    times = []
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        times.append(once())
    return len(prompts) * (new_tokens - 1) / statistics.median(times)


def hf_decode(model, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    """HF transformers decode tok/s: its own KV-cached forward, one token per step, greedy.

    Timing the model's cached forward directly (what `generate` runs per token, minus
    its logits processors) measures decode alone and slightly favours HF.
    """
    import torch

    ids = torch.tensor(prompts)

    def once() -> float:
        with torch.no_grad():
            out = model(ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            t = time.perf_counter()
            for _ in range(new_tokens - 1):
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t

    once()
    dt = statistics.median(once() for _ in range(repeats))
    return len(prompts) * (new_tokens - 1) / dt


def serving_workload(llm, n: int, vocab: int, seed: int = 1) -> dict:
    """n requests (prompts 32-512, outputs 16-128) submitted at once: throughput, TTFT, TPOT."""
    from hotswap import SamplingParams

    rng = np.random.default_rng(seed)
    eng = llm.engine
    eng.reset_prefix_cache()
    lens = rng.integers(32, 513, n)
    outs = rng.integers(16, 129, n)
    t0 = time.perf_counter()
    rids = [
        eng.add_request(
            None,
            rng.integers(10, min(vocab, 700), int(p)).tolist(),
            SamplingParams(temperature=0.0, max_tokens=int(o), ignore_eos=True),
        )
        for p, o in zip(lens, outs, strict=True)
    ]
    seqs = {r: eng.requests[r].seqs[0] for r in rids}
    first, done = {}, {}
    while eng.has_unfinished():
        eng.step()
        now = time.perf_counter()
        for r, s in seqs.items():
            if r not in first and s.output_ids:
                first[r] = now - t0
            if r not in done and s.is_finished:
                done[r] = now - t0
    total = time.perf_counter() - t0
    ttft = np.array([first[r] for r in rids])
    tpot = np.array([(done[r] - first[r]) / max(int(o) - 1, 1) for r, o in zip(rids, outs, strict=True)])
    return {
        "requests": n,
        "output_tokens": int(outs.sum()),
        "throughput_tok_s": float(outs.sum() / total),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tpot_p50_s": float(np.percentile(tpot, 50)),
        "tpot_p99_s": float(np.percentile(tpot, 99)),
        "_plan": (lens.tolist(), outs.tolist()),
    }


def hf_static_batches(model, plan, vocab: int, seed: int = 1, batch: int = 16) -> dict:
    """The same requests through HF generate in static batches of `batch` (left-padded)."""
    import torch

    lens, outs = plan
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, min(vocab, 700), int(p)).tolist() for p in lens]
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(map(len, group))
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(group):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        n = max(outs[i : i + batch])
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
    total = time.perf_counter() - t0
    return {"throughput_tok_s": float(sum(outs) / total)}


def prefix_ttft(llm, vocab: int) -> dict:
    """TTFT of a 1,024-token prompt whose first 960 tokens are cached vs not."""
    from hotswap import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(2)
    shared = rng.integers(10, min(vocab, 700), 960).tolist()

    def ttft(prompt):
        t = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        return time.perf_counter() - t

    cold, warm = [], []
    for _ in range(3):
        llm.reset_prefix_cache()
        cold.append(ttft(shared + rng.integers(10, 700, 64).tolist()))
        warm.append(ttft(shared + rng.integers(10, 700, 64).tolist()))  # hits the 960 cached tokens
    return {"uncached_s": statistics.median(cold), "cached_s": statistics.median(warm)}


def weight_updates(llm, model_dir: Path) -> dict:
    """In-process same-sharding update vs an HF directory update vs raw read + device copy."""
    import jax

    from hotswap.checkpoint import hf

    params = llm.params
    same = _timeit(lambda: llm.update_weights(params), 5)
    same_unchecked = _timeit(lambda: llm.update_weights(params, check_finite=False), 5)
    zero_copy = all(a is b for a, b in zip(jax.tree.leaves(llm.params), jax.tree.leaves(params), strict=True))
    t = time.perf_counter()
    llm.update_weights(str(model_dir))
    first = time.perf_counter() - t
    # A training loop updates many times: the steady state comes after the first few updates,
    # which place the new weights on fresh (page-faulting) memory while the old ones serve.
    for _ in range(2):
        llm.update_weights(str(model_dir))
    directory = _timeit(lambda: llm.update_weights(str(model_dir)), 3)

    def raw():  # the floor: read every byte of the same files and put them on the device
        tensors = hf.read_hf_tensors(model_dir)
        jax.block_until_ready([jax.device_put(np.array(t, copy=True)) for t in tensors.values()])

    raw_s = _timeit(raw, 3)
    return {
        "same_sharding_ms": same * 1e3,
        "same_sharding_no_finite_check_ms": same_unchecked * 1e3,
        "zero_copy": zero_copy,
        "directory_first_s": first,
        "directory_s": directory,
        "raw_read_copy_s": raw_s,
        "directory_vs_raw": directory / raw_s,
    }


def run(args) -> int:
    from hotswap import LLM
    from hotswap.checkpoint.create import create_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir) if args.model_dir else out / "bench-100m"
    if not (model_dir / "config.json").exists():
        create_checkpoint(model_dir, preset="bench-100m", arch="llama", seed=0)
    batches = [int(b) for b in args.batches.split(",")]
    peers = bench_peers.select_peers(args.peers, Path(args.peers_dir))  # before the long runs: fail early
    gemv = GemvProbe()
    limits = {**gemv(), "matmul_flops": probe_matmul_flops()}
    llm = LLM(
        model_dir, max_model_len=1088, max_num_seqs=max(batches), max_num_batched_tokens=512, page_size=16
    )
    cfg = llm.config
    weight_bytes = (
        sum(x.nbytes for x in __import__("jax").tree.leaves(llm.params)) - llm.params["embed"].nbytes
    )
    flops_per_token = 2 * weight_bytes / 4
    rows = []
    hf_model = None
    if not args.no_hf:
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count() or 1)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for b in batches:
        prompts = _prompts(b, args.prompt_len, cfg.vocab_size)
        # This machine's bandwidth drifts by 30% over minutes: the limit for each batch size is
        # probed between its own timed repeats (median), not once at the start.
        probes = []
        ours = hotswap_decode(llm, prompts, args.new_tokens, args.repeats, lambda p=probes: p.append(gemv()))
        bw = statistics.median(p["gemv_bytes_per_s"] for p in probes)
        row = {"batch": b, "hotswap_tok_s": ours, "gemv_bytes_per_s": bw}
        row["mem_limit_tok_s"] = bw / weight_bytes * b
        row["compute_limit_tok_s"] = limits["matmul_flops"] / flops_per_token
        row["fraction_of_limit"] = ours / min(row["mem_limit_tok_s"], row["compute_limit_tok_s"])
        if hf_model is not None:
            row["hf_tok_s"] = hf_decode(hf_model, prompts, args.new_tokens, args.repeats)
            row["ratio_vs_hf"] = ours / row["hf_tok_s"]
        rows.append(row)
        print(
            " | ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
            flush=True,
        )
    gemv.close()
    serving = serving_workload(llm, args.serving_requests, cfg.vocab_size)
    plan = serving.pop("_plan")
    if hf_model is not None:
        serving["hf_static"] = hf_static_batches(hf_model, plan, cfg.vocab_size)
        serving["ratio_vs_hf"] = serving["throughput_tok_s"] / serving["hf_static"]["throughput_tok_s"]
    if peers:

        def ours_now() -> dict:
            """hotswap again, right next to a peer's run (see _run_peers)."""
            return {
                "decode": [
                    hotswap_decode(
                        llm,
                        _prompts(r["batch"], args.prompt_len, cfg.vocab_size),
                        args.new_tokens,
                        args.repeats,
                    )
                    for r in rows
                ],
                "serving": serving_workload(llm, args.serving_requests, cfg.vocab_size)["throughput_tok_s"],
            }

        _run_peers(peers, args, model_dir, out, rows, serving, plan, hf_model, cfg.vocab_size, ours_now)
    prefix = prefix_ttft(llm, cfg.vocab_size)
    prefix["speedup"] = prefix["uncached_s"] / prefix["cached_s"]
    updates = weight_updates(llm, model_dir)
    result = {"limits": limits, "decode": rows, "serving": serving, "prefix": prefix, "updates": updates}
    _plot(rows, out / "throughput.png")
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


def _run_peers(peers, args, model_dir, out, rows, serving, plan, hf_model, vocab: int, ours_now=None) -> None:
    """Each peer on the same prompts in its own venv; adds its columns to the rows and serving.

    Runs after hotswap and HF so that nothing else competes for the cores. When HF is loaded,
    every decode sequence's greedy tokens are checked against HF's (`<peer>_hf_agree`): a peer
    that computes another model would make its speed meaningless.

    With `ours_now` (a function measuring hotswap's decode rows and serving again), each peer
    runs between two fresh hotswap measurements (A-B-A), and the ratios to that peer use
    their mean (`hotswap_tok_s_around_<peer>`): this machine's speed drifts by 20-40% over
    minutes, and a peer that ran ten minutes after hotswap's first measurement would
    otherwise be compared across that drift.
    """
    request = bench_peers.PeerRequest(
        model_dir=str(model_dir.resolve()),
        work_dir=str((out / "peers").resolve()),
        threads=os.cpu_count() or 1,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        max_num_seqs=max(r["batch"] for r in rows),
        decode=[_prompts(r["batch"], args.prompt_len, vocab) for r in rows],
        serving_prompts=bench_peers.serving_prompts(plan[0], vocab),
        serving_outputs=plan[1],
    )
    reference = None  # HF's greedy tokens for the largest batch's prompts (the others are its prefixes)
    if hf_model is not None:
        reference = bench_peers.hf_reference(hf_model, max(request.decode, key=len), args.new_tokens)
    for name in peers:
        before = ours_now() if ours_now else None
        try:
            result = bench_peers.run_peer(name, request, Path(args.peers_dir))
        except bench_peers.PeerError as e:
            print(f"peer {name} failed, left out: {e}", flush=True)
            continue
        after = ours_now() if ours_now else None
        for i, (row, got) in enumerate(zip(rows, result["decode"], strict=True)):
            ours = row["hotswap_tok_s"]
            if before is not None:
                row[f"hotswap_tok_s_around_{name}"] = [before["decode"][i], after["decode"][i]]
                ours = statistics.mean(row[f"hotswap_tok_s_around_{name}"])
            row[f"{name}_tok_s"] = got["tok_s"]
            row[f"ratio_vs_{name}"] = ours / got["tok_s"]
            line = f"{name} {result['version']} | batch={row['batch']} | {name}_tok_s={got['tok_s']:.3g}"
            if reference is not None:
                row[f"{name}_hf_agree"] = bench_peers.hf_agreement(got["tokens"], reference)
                line += f" | {name}_hf_agree={row[f'{name}_hf_agree']:.3g} (sequences greedy-equal to HF)"
            print(line, flush=True)
        if "serving" in result:
            ours = serving["throughput_tok_s"]
            if before is not None:
                serving[f"throughput_tok_s_around_{name}"] = [before["serving"], after["serving"]]
                ours = statistics.mean(serving[f"throughput_tok_s_around_{name}"])
            serving[name] = result["serving"]
            serving[f"ratio_vs_{name}"] = ours / result["serving"]["throughput_tok_s"]


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["batch"] for r in rows]
    ax.plot(xs, [r["hotswap_tok_s"] for r in rows], "o-", label="hotswap")
    if rows and "hf_tok_s" in rows[0]:
        ax.plot(xs, [r["hf_tok_s"] for r in rows], "s-", label="HF transformers")
    for name, marker in zip(bench_peers.PEERS, "^v", strict=True):
        if rows and f"{name}_tok_s" in rows[0]:
            ax.plot(xs, [r[f"{name}_tok_s"] for r in rows], marker + "-", label=name)
    ax.plot(xs, [min(r["mem_limit_tok_s"], r["compute_limit_tok_s"]) for r in rows], "k--", label="limit")
    ax.set(xlabel="batch", ylabel="decode tok/s", xscale="log", yscale="log", title="decode throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
