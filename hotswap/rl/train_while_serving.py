"""`hotswap demo`: GRPO trains a tiny model from scratch while the engine serves it, swapping weights every step.

Each step: the engine samples `--n` completions for each of `--prompts-per-step`
prompts (they share an instruction prefix, so the prefix cache hits within a
step), a program scores them (`hotswap.rl.task`: count up one digit at a time),
optax takes one GRPO step on the very params pytree the engine serves, and
`update_weights(params, policy=--policy)` swaps them in as the next version.

What it checks, every step, from evidence rather than by trusting the engine:
- train-inference mismatch: the trainer recomputes every sampled token's
  log-prob with the weights that produced it; the max |diff| must be float noise;
- no stale KV: every token carries the version serving its rollout, the first
  request after an update reports no cached tokens (the update emptied the
  cache), and every KV page a sequence reused was written under that version.

With `--deterministic` the engine runs its batch-invariant kernels and the mismatch column is
the engine's own `score` of every sampled token (its programs, the rollout's weights) against the
log-prob the rollout returned: bitwise equal, so it reads 0.0. "Bitwise" holds against the
engine's own kernels; the trainer's jnp forward (what the loss differentiates) still sums in
other orders, and its difference is reported beside it (`trainer_mismatch`).

Prints a table and a progress bar, writes `demo.png`, `metrics.jsonl` and
`summary.json` to --out, and ends with one JSON summary line on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

PAGE_SIZE = 8  # small pages: the 24-token shared prefix fills three of them
MISMATCH_TOL = 1e-3


def main(args: argparse.Namespace) -> int:
    summary = run(args)
    print(json.dumps(summary), flush=True)
    ok = summary["stale_prefix_hits"] == 0 and summary["max_logprob_mismatch"] < MISMATCH_TOL
    return 0 if ok else 1


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict:
    """The whole demo; returns the summary dict (also written to OUT/summary.json)."""
    import jax
    import numpy as np
    import optax
    from tqdm.auto import tqdm

    from hotswap.checkpoint.create import create_checkpoint
    from hotswap.checkpoint.tokenizer import Tokenizer
    from hotswap.engine.sampling import SamplingParams
    from hotswap.rl import grpo
    from hotswap.rl.task import CountTask

    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if args.model else out / "model"
    if not args.model:
        # Fresh random weights every run (seeded): the demo trains from scratch.
        create_checkpoint(model_dir, preset="tiny", arch="llama", seed=args.seed)
    tok = Tokenizer.from_dir(model_dir)
    task = CountTask.from_tokenizer(tok)
    groups, n, max_tokens = args.prompts_per_step, args.n, args.max_tokens
    length = 16 * math.ceil((len(task.prefix_ids) + 1 + max_tokens) / 16)  # the trainer's fixed batch length
    engine_args = dict(
        page_size=PAGE_SIZE,
        max_model_len=max(length, 64),
        max_num_seqs=groups * n,  # every sample of a step decodes in one batch
        max_num_batched_tokens=max(128, groups * n),
        seed=args.seed,
    )
    if args.deterministic:
        if args.via_http:
            raise SystemExit("--deterministic scores with the in-process engine: drop --via-http")
        engine_args["deterministic"] = True
    _say(
        f"hotswap demo: model {model_dir}, {'REST server' if args.via_http else 'in-process engine'}, "
        f"policy={args.policy}, {args.steps} steps x {groups} prompts x {n} samples x {max_tokens} tokens"
    )

    with contextlib.ExitStack() as stack:
        cfg, params, rollout, push, version, score = _serving(
            args, stack, model_dir, tok, engine_args, n, max_tokens
        )

        # Global-norm clipping as TRL's GRPO trainer does (max_grad_norm=1.0): without it one
        # large step late in the run can undo what the policy learned.
        optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.lr))
        # Committed like the params, or the second step (fed the first step's outputs) would recompile.
        opt_state = jax.tree.map(lambda x: jax.device_put(x, x.sharding), optimizer.init(params))
        train_step = grpo.make_train_step(cfg, optimizer)
        _say("compiling the trainer ...")
        zero = grpo.Batch(
            np.zeros((groups * n, length), np.int32),
            np.ones(groups * n, np.int32),
            *(np.zeros((groups * n, length - 1), np.float32),) * 2,
            np.zeros(groups * n, np.float32),
        )
        jax.block_until_ready(train_step(params, opt_state, zero))  # result discarded: compile only

        rng = np.random.default_rng(args.seed)
        rows: list[dict] = []
        every = args.log_every or max(1, args.steps // 20)
        header = (
            f"{'step':>5} {'reward':>7} {'version':>9} {'prefix hit':>10} {'1st hit':>7} {'rollout s':>9} "
            f"{'train s':>7} {'update s':>8} {'max|dlogp|':>10}  sample"
        )
        print(header, flush=True)
        bar = tqdm(range(1, args.steps + 1), desc="GRPO", file=sys.stderr, disable=args.no_progress)
        resolved = 0
        for step in bar:
            prompts = task.prompts(rng, groups)
            sps = [
                SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=int(s))
                for s in rng.integers(0, 2**31, groups)
            ]
            ro = rollout(prompts, sps)
            if args.via_http:
                resolved += grpo.resolve_ambiguous(ro.samples, params, cfg, length)
            rewards = np.array([task.reward(s.prompt_ids, s.token_ids) for s in ro.samples]).reshape(
                groups, n
            )
            batch = grpo.pack(ro.samples, grpo.group_advantages(rewards), length)

            # Before the update: the engine still serves the weights that generated the rollout.
            scored = _score_mismatch(score, ro.samples) if args.deterministic else None
            t0 = time.perf_counter()
            # The trainer's log-probs come from `params` before this step's update: the weights
            # (version ro.version) that generated the rollout.
            params, opt_state, loss, lp = train_step(params, opt_state, batch)
            trainer_mismatch = grpo.max_mismatch(lp, batch)
            mismatch = trainer_mismatch if scored is None else scored
            t1 = time.perf_counter()
            version = push(params)
            t2 = time.perf_counter()

            # Both measure reused pages of another version (page metadata / the first request's
            # cached count after the cache was emptied); max, not sum, so one event counts once.
            stale = max(ro.stale_pages, ro.first_cached_tokens // PAGE_SIZE)
            row = dict(
                step=step,
                reward=float(rewards.mean()),
                generated_by=ro.version,
                weights_version=version,
                prefix_hit_rate=ro.hit_rate,
                first_cached_tokens=ro.first_cached_tokens,
                stale_prefix_hits=stale,
                stale_tokens=ro.stale_tokens,
                rollout_s=ro.seconds,
                train_s=t1 - t0,
                update_s=t2 - t1,
                max_logprob_mismatch=mismatch,
                trainer_mismatch=trainer_mismatch,
                loss=float(loss),
                sample=tok.decode(
                    [ro.samples[0].prompt_ids[-1], *ro.samples[0].token_ids], skip_special_tokens=False
                ),
            )
            rows.append(row)
            bar.set_postfix(reward=f"{row['reward']:.3f}", version=version, mismatch=f"{mismatch:.1e}")
            if step % every == 0 or step in (1, args.steps):
                tqdm.write(_format_row(row), file=sys.stdout)

    return _summarize(rows, args, out, version, resolved, t_start)


def _serving(
    args, stack: contextlib.ExitStack, model_dir: Path, tok, engine_args: dict, n: int, max_tokens: int
):
    """The engine the demo trains against, in this process or as a `hotswap serve` subprocess:
    (model config, the trainer's initial params, rollout(prompts, sps), push(params) -> version,
    the serving version)."""
    import jax

    from hotswap.checkpoint import hf
    from hotswap.checkpoint.payload import encode_safetensors

    if args.via_http:
        from hotswap.rl.remote import ServerProcess, rollout_http, token_map

        _say("starting `hotswap serve` (compiling its steps) ...")
        server = stack.enter_context(ServerProcess(model_dir, Path(args.out) / "server.log", engine_args))
        cfg, host_params = hf.load_hf_dir(model_dir)
        params = jax.device_put(host_params, jax.devices()[0])  # committed, like the step's outputs
        tmap = token_map(tok, cfg.vocab_size)

        def rollout(prompts, sps):
            return rollout_http(server, tmap, prompts, n, max_tokens)

        def push(new_params) -> int:
            data = encode_safetensors(hf.hf_from_params(cfg, jax.device_get(new_params)))
            return server.update_weights(data, args.policy)

        return cfg, params, rollout, push, server.weights_version(), None

    from hotswap.engine.llm import LLM
    from hotswap.rl.rollout import rollout_local

    llm = LLM(model_dir, **engine_args)

    def rollout(prompts, sps):
        return rollout_local(llm, prompts, sps)

    def push(new_params) -> int:
        return llm.update_weights(new_params, policy=args.policy)

    return (
        llm.config,
        llm.params,  # the trainer starts from the served arrays
        rollout,
        push,
        llm.weights_version,
        llm.score,
    )


def _score_mismatch(score, samples) -> float:
    """max |engine score - rollout log-prob| over every sampled token (deterministic mode: 0.0)."""
    import numpy as np

    scored = score([(s.prompt_ids, s.token_ids) for s in samples])
    diffs = [
        np.abs(np.asarray(lp, np.float32) - np.asarray(s.logprobs, np.float32))
        for lp, s in zip(scored, samples, strict=True)
    ]
    return float(max((d.max() for d in diffs if d.size), default=0.0))


def _summarize(rows: list[dict], args, out: Path, version: int, resolved: int, t_start: float) -> dict:
    """The run's summary (also written to OUT/summary.json), its metrics.jsonl and plot."""
    import numpy as np

    w = max(1, min(10, args.steps // 10))  # average a few steps: one step's mean reward is noisy
    summary = {
        "reward_first": round(float(np.mean([r["reward"] for r in rows[:w]])), 4),
        "reward_last": round(float(np.mean([r["reward"] for r in rows[-w:]])), 4),
        "steps": args.steps,
        "weights_version": version,
        "max_logprob_mismatch": max(r["max_logprob_mismatch"] for r in rows),
        "trainer_mismatch": max(r["trainer_mismatch"] for r in rows),
        "deterministic": bool(args.deterministic),
        "stale_prefix_hits": sum(r["stale_prefix_hits"] for r in rows),
        "stale_tokens": sum(r["stale_tokens"] for r in rows),
        "prefix_cache_hit_rate": round(float(np.mean([r["prefix_hit_rate"] for r in rows])), 4),
        "policy": args.policy,
        "via_http": bool(args.via_http),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    if args.via_http:
        summary["http_ambiguous_tokens_resolved"] = resolved
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    summary["plot"] = str(_plot(rows, out / "demo.png", args))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _format_row(r: dict) -> str:
    return (
        f"{r['step']:>5} {r['reward']:>7.3f} {r['generated_by']:>4}->{r['weights_version']:<4} "
        f"{r['prefix_hit_rate']:>10.1%} {r['first_cached_tokens']:>7} {r['rollout_s']:>9.2f} "
        f"{r['train_s']:>7.2f} {r['update_s']:>8.3f} {r['max_logprob_mismatch']:>10.1e}  {r['sample'][:40]!r}"
    )


def _plot(rows: list[dict], path: Path, args: argparse.Namespace) -> Path:
    # Figure (not pyplot): no global backend switch, so this also works inside a notebook.
    from matplotlib.figure import Figure

    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(8, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(steps, [r["reward"] for r in rows], label="mean reward", color="C0")
    top.plot(
        steps, [r["prefix_hit_rate"] for r in rows], label="prefix-cache hit rate", color="C2", alpha=0.6
    )
    top.set_ylim(0, 1.02)
    top.set_ylabel("reward / hit rate")
    top.legend(loc="center right")
    top.set_title(
        f"GRPO on the count-up task, policy={args.policy}{' over REST' if args.via_http else ''}: "
        f"weights version 1 -> {rows[-1]['weights_version']}"
    )
    mismatch = [max(r["max_logprob_mismatch"], 1e-9) for r in rows]  # exact 0 has no log
    bottom.semilogy(steps, mismatch, label="max |engine - trainer| log-prob", color="C1")
    bottom.axhline(MISMATCH_TOL, color="C3", ls="--", label=f"tolerance {MISMATCH_TOL:g}")
    bottom.set_xlabel("step (= weights version - 1)")
    bottom.set_ylabel("train-inference mismatch")
    bottom.set_ylim(5e-10, 1e-1)  # room above the tolerance line for the legend
    bottom.legend(loc="upper right")
    fig.savefig(path, dpi=110)
    return path
