"""`hotswap bench`: hotswap vs HF transformers on one checkpoint, in one process, as ratios.

Everything is measured in the same run (this kind of machine is shared and noisy):
the physical limits are probed (matmul FLOP/s first; GEMV bandwidth first and again
between the timed repeats of each batch size), and each engine runs the same prompts
with the same thread count. Decode is greedy, and beside it seeded sampling (temperature 1,
top-k 50, top-p 0.95) on the same prompts, as step-time ratios to greedy. Prints a table and
one JSON line, and writes a PNG of throughput vs batch size.

`hotswap bench ARGS` (from an editable install) and `python -m benchmarks.bench ARGS` (from
the repository root, with any install of hotswap) run the same thing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from benchmarks import bench_peers, gguf_serving, quant_mismatch, rollout, speculative
from benchmarks.limits import GemvProbe, probe_matmul_flops
from benchmarks.sampled_decode import MODES
from benchmarks.workloads import (
    hf_decode,
    hf_static_batches,
    hotswap_decode,
    prefix_ttft,
    random_prompts,
    serving_workload,
    startup,
    weight_updates,
)
from hotswap.args import EngineArgs
from hotswap.errors import HotswapError

HELP = "start-up / decode / serving / prefix / update benchmarks vs HF transformers"
# The engine the workloads run on (the README's figures): 1,024-token prompts plus output fit,
# prefill chunks of 512 tokens; `max_num_seqs` is the largest decode batch. Engine flags override.
WORKLOAD_ENGINE = {"max_model_len": 1088, "max_num_batched_tokens": 512}
# Sampled decode timed beside greedy at each batch size (`benchmarks/sampled_decode.py` has them all).
SAMPLED = ("temperature_1", "top_k_50", "top_p_0.95")
MISMATCH = True  # `--quantization` with no value (add_arguments)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="HF model dir (default: create the bench-100m preset)")
    p.add_argument("--batches", default="1,16,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--rollout-tokens",
        type=int,
        default=rollout.NEW_TOKENS,
        help="sampled tokens per sequence of the rollout",
    )
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
    p.add_argument(
        "--only",
        choices=("startup", "rollout", "gguf"),
        help="run only this part (startup: cold and warm LLM start; rollout: a GRPO rollout and an RL "
        "step, bf16, hotswap and vLLM A-B-A, benchmarks/rollout.py; gguf: SmolLM2's Q4_1 file served as "
        "its blocks vs llama.cpp on it, peak RSS and decode A-B-A, and Gemma 3 270M's Q4_K_M, "
        "benchmarks/gguf_serving.py)",
    )
    p.add_argument(
        "--speculative",
        action="store_true",
        help="run only the speculative decoding benchmark (n-gram vs plain decoding on SmolLM2: "
        "grounded and free prompts at batch 1, a rollout's tail; benchmarks/speculative.py)",
    )
    # The engine options, as `hotswap serve` has them; one given here replaces the workload's own
    # setting (`WORKLOAD_ENGINE`), e.g. `--dtype bfloat16` or `--attention reference`.
    EngineArgs.add_cli_args(p, "llm", defaults=False)
    # `--quantization` is that engine option (`--quantization int8`: the workloads served in int8);
    # given with no value it runs the RL mismatch benchmark instead. The constant is not a string,
    # so argparse does not check it against the option's choices.
    (q,) = (a for a in p._actions if a.dest == "quantization")
    q.nargs, q.const = "?", MISMATCH
    q.help += (
        "; with no value: run only the RL mismatch benchmark (an 8 x n=8 T=1 SmolLM2 rollout sampled by "
        "bf16, int8 (per column; groups of 64) and Q4-block engines, scored under the bf16 policy; "
        "benchmarks/quant_mismatch.py)"
    )


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.bench") -> int:
    """`python -m benchmarks.bench`, and `hotswap bench` (hotswap/cli/bench.py runs it as `prog`)."""
    parser = argparse.ArgumentParser(prog=prog, description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except HotswapError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


def engine_options(args: argparse.Namespace, batches: list[int]) -> dict:
    """`LLM(model, **options)` for the workloads: theirs, with the engine flags given on top."""
    return {**WORKLOAD_ENGINE, "max_num_seqs": max(batches), **EngineArgs.given(args, "llm")}


def _write(out: Path, result: dict) -> None:
    """bench.json and stdout, with the CPU every figure was measured on (model and ISA flags)."""
    from hotswap.kernels.cpu_target import host

    result = {"cpu": host().describe(), **result}
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


def run(args) -> int:
    from hotswap import LLM
    from hotswap.checkpoint.create import create_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir) if args.model_dir else out / "bench-100m"
    if args.speculative:  # SmolLM2's GGUF, not the bench model: it needs text that means something
        result = speculative.run(engine=EngineArgs.given(args, "llm"))
        _write(out, {"speculative": result})
        speculative.check(result)  # after the figures: a changed token fails the run, visibly
        return 0
    if getattr(args, "quantization", None) is MISMATCH:  # SmolLM2's GGUF too: its Q4 blocks are the point
        engine = {k: v for k, v in EngineArgs.given(args, "llm").items() if k != "quantization"}
        _write(
            out, {"quantization_mismatch": quant_mismatch.run(list(quant_mismatch.SCHEMES), engine=engine)}
        )
        return 0
    if args.only == "gguf":  # the GGUF files themselves, not the bench model: their blocks are the point
        _write(out, {"gguf_serving": gguf_serving.run(repeats=args.repeats, peers_dir=Path(args.peers_dir))})
        return 0
    if not (model_dir / "config.json").exists():
        create_checkpoint(model_dir, preset="bench-100m", arch="llama", seed=0)
    batches = [int(b) for b in args.batches.split(",")]
    engine = engine_options(args, batches)
    if args.only == "startup":
        result = {"startup": _startup(model_dir, engine)}
        _write(out, result)
        return 0
    peers = bench_peers.select_peers(args.peers, Path(args.peers_dir))  # before the long runs: fail early
    if args.only == "rollout":
        new_tokens = args.rollout_tokens
        result = {
            "rollout": rollout.run(model_dir, engine, peers, Path(args.peers_dir), out / "peers", new_tokens)
        }
        _write(out, result)
        return 0
    starts = _startup(model_dir, engine)  # first: its processes compete with nothing of ours
    gemv = GemvProbe()
    limits = {**gemv(), "matmul_flops": probe_matmul_flops()}
    llm = LLM(model_dir, **engine)
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
        prompts = random_prompts(b, args.prompt_len, cfg.vocab_size)
        # This machine's bandwidth drifts by 30% over minutes: the limit for each batch size is
        # probed between its own timed repeats (median), not once at the start.
        probes = []
        ours = hotswap_decode(llm, prompts, args.new_tokens, args.repeats, lambda p=probes: p.append(gemv()))
        bw = statistics.median(p["gemv_bytes_per_s"] for p in probes)
        row = {"batch": b, "hotswap_tok_s": ours, "gemv_bytes_per_s": bw}
        # Seeded sampling on the same prompts: `<mode>_step_vs_greedy` is its step time over greedy's.
        for mode in SAMPLED:
            sampling = {**MODES[mode], "seed": 1}
            row[f"{mode}_tok_s"] = hotswap_decode(
                llm, prompts, args.new_tokens, args.repeats, sampling=sampling
            )
            row[f"{mode}_step_vs_greedy"] = ours / row[f"{mode}_tok_s"]
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
                        random_prompts(r["batch"], args.prompt_len, cfg.vocab_size),
                        args.new_tokens,
                        args.repeats,
                    )
                    for r in rows
                ],
                "serving": serving_workload(llm, args.serving_requests, cfg.vocab_size),
            }

        _run_peers(peers, args, model_dir, out, rows, serving, plan, hf_model, cfg, ours_now)
    prefix = prefix_ttft(llm, cfg.vocab_size)
    prefix["speedup"] = prefix["uncached_s"] / prefix["cached_s"]
    gemv = GemvProbe()  # again: the first one's 512 MiB were freed before the serving run
    updates = weight_updates(llm, model_dir, probe=lambda: gemv()["gemv_bytes_per_s"])
    gemv.close()
    print(
        f"updates | same_sharding_ms={updates['same_sharding_ms']:.3g} | "
        f"bandwidth_ms={updates['bandwidth_ms']:.3g} (params read once at the probed bandwidth) | "
        f"same_sharding_vs_bandwidth={updates['same_sharding_vs_bandwidth']:.3g} | "
        f"directory_s={updates['directory_s']:.3g} | raw_read_copy_s={updates['raw_read_copy_s']:.3g} | "
        f"directory_vs_raw={updates['directory_vs_raw']:.3g}",
        flush=True,
    )
    result = {
        "startup": starts,
        "limits": limits,
        "decode": rows,
        "serving": serving,
        "prefix": prefix,
        "updates": updates,
    }
    _plot(rows, out / "throughput.png")
    _write(out, result)
    return 0


def _startup(model_dir: Path, engine: dict) -> dict:
    """Start-up of `LLM(model, **engine)` in fresh processes, cold and warm, for the bench model
    and for the default chat model (SmolLM2, when its wheel is installed); one row each."""
    from hotswap.cli.models import DEFAULT_MODEL_NAME, SMOLLM2_INSTALL, smollm2_gguf

    models = {model_dir.name: model_dir}
    smol = smollm2_gguf()
    if smol is not None:
        models[DEFAULT_MODEL_NAME] = smol
    else:
        print(f"startup | {DEFAULT_MODEL_NAME}: not installed ({SMOLLM2_INSTALL})", flush=True)
    runs = {}
    for name, path in models.items():
        got = runs[name] = startup(path, engine)
        print(
            f"startup {name} | cold_s={got['cold']['llm_s']:.3g} | warm_s={got['warm']['llm_s']:.3g} | "
            f"speedup={got['speedup']:.3g} | warm-up cold: {got['cold']['warmup']} | warm: {got['warm']['warmup']}",
            flush=True,
        )
    return runs


def _run_peers(peers, args, model_dir, out, rows, serving, plan, hf_model, cfg, ours_now=None) -> None:
    """Each peer on the same prompts in its own venv, in the dtype hotswap served (`cfg`, its
    model config); adds its columns to the rows and serving.

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
        decode=[random_prompts(r["batch"], args.prompt_len, cfg.vocab_size) for r in rows],
        serving_prompts=bench_peers.serving_prompts(plan[0], cfg.vocab_size),
        serving_outputs=plan[1],
        dtype=cfg.dtype,
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
            theirs = serving[name] = result["serving"]
            for key in ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s"):
                ours = serving[key]
                if before is not None:
                    serving[f"{key}_around_{name}"] = [before["serving"][key], after["serving"][key]]
                    ours = statistics.mean(serving[f"{key}_around_{name}"])
                # throughput: ours / theirs (> 1 is faster); TTFT: ours / theirs (< 1 is sooner)
                label = "ratio_vs" if key == "throughput_tok_s" else f"{key[:-2]}_ratio_vs"
                serving[f"{label}_{name}"] = ours / theirs[key]
            print(
                f"{name} serving | tok_s={theirs['throughput_tok_s']:.3g} | ttft p50/p99="
                f"{theirs['ttft_p50_s']:.3g}/{theirs['ttft_p99_s']:.3g} s | hotswap/{name}: throughput "
                f"{serving[f'ratio_vs_{name}']:.3g}x, ttft p50 {serving[f'ttft_p50_ratio_vs_{name}']:.3g}x, "
                f"p99 {serving[f'ttft_p99_ratio_vs_{name}']:.3g}x",
                flush=True,
            )


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


if __name__ == "__main__":
    sys.exit(main())
