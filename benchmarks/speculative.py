"""`hotswap bench --speculative`: n-gram speculative decoding against plain decoding, in one run.

On SmolLM2-135M-Instruct (the registry-shipped GGUF), chat-templated prompts, greedy, batch 1:

- input-grounded work (edit, extract, summarise a given text, refactor given code: the first
  six of `speculative_prompts.GROUNDED`), and free generation (stories, open questions: `FREE`),
  each prompt decoded by the plain engine and by one engine per n-gram setting
  (`num_speculative_tokens` k, `prompt_lookup_min`..`max`), in turns: for every prompt of every
  repeat each engine runs once, in an order rotated from prompt to prompt, so that this
  machine's drift (20-40% over minutes) lands on all of them alike. Reported: decode tok/s (the
  tokens after the first over the time after the first; the prompt's prefill is the same work
  for both), the speculative engine's ratio to plain (per prompt and repeat, then the median;
  and of the summed tokens over the summed seconds, median over repeats), acceptance (accepted /
  drafted), mean accepted length per verification step, tokens and milliseconds per decode
  step. Every speculative output is checked to be the plain engine's tokens (asserted after the
  figures are printed).
- the rollout's tail: a GRPO-style rollout, the 8 grounded prompts x n=8 samples (temperature 1,
  seeded, up to `--rollout-tokens` each, stopping at EOS so that lengths differ), every sample
  in flight at once: the time until 90% and until all samples have finished, and the tail
  between them, on a plain and an n-gram engine, alternated. SmolLM2 rather than the
  random-weight bench-100m preset: random weights never stop early (no tail) and their text
  repeats nothing a prompt lookup could find. Reported too: how many samples drew exactly the
  plain engine's tokens (not asserted: a verification runs in a prefill-shaped step, whose
  matmuls may sum in another order than a decode step's, and at T=1 a draw that lands that close
  to a boundary of the cumulative distribution picks the neighbouring token).

    python -m benchmarks.speculative [--spec-repeats 2] [--spec-configs 2:1-3,4:2-4] [--parts batch1]

Prints a table and one JSON line (the CPU first).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import time

from benchmarks.speculative_prompts import FREE, GROUNDED

# k:min-max of each n-gram engine
CONFIGS = "2:1-3,4:1-3,6:1-3,2:2-4,4:2-4,6:2-4"
ROLLOUT_CONFIG = "4:1-3"
# A rollout of 64 samples decodes compute-bound until its tail: drafts from 7 running sequences down.
ROLLOUT_DISABLE = 8
PARTS = "batch1,rollout"
ENGINE = {"max_model_len": 1536, "max_num_seqs": 1}
BATCH1_GROUNDED = 6  # the first six grounded prompts at batch 1 (the rollout takes eight)
GROUNDED_TOKENS, FREE_TOKENS = 192, 128
ROLLOUT_PROMPTS, ROLLOUT_N, ROLLOUT_TOKENS, SEED = 8, 8, 128, 0
TAIL = 0.9  # the tail: after this fraction of the rollout's samples has finished


@dataclasses.dataclass
class Decode:
    """One request decoded at batch 1."""

    tokens: list[int]
    prefill_s: float  # until the first token
    decode_s: float  # after it, until the last
    steps: int  # engine steps after the first token
    verifications: int  # of them, the steps that verified a draft
    drafted: int
    accepted: int


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    """'4:1-3,6:2-4' -> [(4, 1, 3), (6, 2, 4)]: (k, prompt_lookup_min, prompt_lookup_max)."""
    out = []
    for item in text.split(","):
        k, _, span = item.partition(":")
        lo, _, hi = span.partition("-")
        out.append((int(k), int(lo), int(hi or lo)))
    return out


def ngram(k: int, lo: int, hi: int, off: int | None = None) -> dict:
    """The n-gram config; `off`: its disable_by_batch_size (None: drafts at every batch size)."""
    config = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": lo,
        "prompt_lookup_max": hi,
    }
    return config if off is None else {**config, "disable_by_batch_size": off}


def label(config: tuple[int, int, int]) -> str:
    return "k{}_n{}-{}".format(*config)


def decode(llm, ids: list[int], sp) -> Decode:
    """Step the engine alone through one request, timing the first token and the rest."""
    engine = llm.engine
    rid = engine.add_request(None, ids, sp)
    seq = engine.admission.requests[rid].seqs[0]
    t0 = time.perf_counter()
    t1, steps = None, 0
    while not seq.is_finished:
        engine.step()
        if t1 is None:
            if seq.output_ids:
                t1 = time.perf_counter()
            continue
        steps += 1
    t2 = time.perf_counter()
    return Decode(
        list(seq.output_ids), t1 - t0, t2 - t1, steps, seq.spec_drafts, seq.spec_proposed, seq.spec_accepted
    )


def tok_s(runs: list[Decode]) -> float:
    """Decode tok/s of runs taken together: the tokens after each first over their seconds."""
    return sum(len(r.tokens) - 1 for r in runs) / sum(r.decode_s for r in runs)


def compare(names: list[str], prompts: dict[str, list[int]], sp, llms: dict, repeats: int) -> dict:
    """Every prompt through every engine, `repeats` times, in rotated turns; per engine its runs
    [repeat][prompt]."""
    runs = {name: [[None] * len(prompts) for _ in range(repeats)] for name in names}
    for r in range(repeats):
        for i, ids in enumerate(prompts.values()):
            shift = (r * len(prompts) + i) % len(names)
            for name in names[shift:] + names[:shift]:
                runs[name][r][i] = decode(llms[name], ids, sp)
    return runs


def summarise(runs: dict, base: str = "plain") -> dict:
    """Per engine: decode tok/s (median over repeats of the prompts together), the ratio to plain
    (the median of per-prompt-and-repeat ratios, and the median over repeats of the summed
    ratio), acceptance, accepted length per verification, tokens per decode step, and whether
    every output equals plain's."""
    out = {}
    plain = runs[base]
    for name, rs in runs.items():
        flat = [d for rep in rs for d in rep]
        row = {"tok_s": statistics.median(tok_s(rep) for rep in rs)}
        row["ratio_median"] = statistics.median(
            (len(d.tokens) - 1) / d.decode_s / ((len(p.tokens) - 1) / p.decode_s)
            for rep, prep in zip(rs, plain, strict=True)
            for d, p in zip(rep, prep, strict=True)
        )
        row["ratio_summed"] = statistics.median(
            tok_s(rep) / tok_s(prep) for rep, prep in zip(rs, plain, strict=True)
        )
        drafted, accepted = sum(d.drafted for d in flat), sum(d.accepted for d in flat)
        verifications, steps = sum(d.verifications for d in flat), sum(d.steps for d in flat)
        row["acceptance"] = accepted / drafted if drafted else 0.0
        row["accepted_per_verification"] = accepted / verifications if verifications else 0.0
        row["verifying_steps"] = verifications / steps
        row["tokens_per_step"] = sum(len(d.tokens) - 1 for d in flat) / steps
        # what a step costs: a verification runs k+1 positions and samples k+1 rows
        row["ms_per_step"] = 1e3 * sum(d.decode_s for d in flat) / steps
        row["mean_new_tokens"] = statistics.mean(len(d.tokens) for d in flat)
        row["equal_to_plain"] = all(
            d.tokens == p.tokens
            for rep, prep in zip(rs, plain, strict=True)
            for d, p in zip(rep, prep, strict=True)
        )
        out[name] = row
    return out


def rollout(llm, prompts: list[list[int]], sp) -> dict:
    """Every sample of every prompt in flight at once; the time each sample finishes."""
    engine = llm.engine
    llm.reset_prefix_cache()  # no pages from an earlier run: the group's sharing is what is timed
    rids = [engine.add_request(None, ids, sp) for ids in prompts]
    seqs = [s for rid in rids for s in engine.admission.requests[rid].seqs]
    done: dict[int, float] = {}
    t0 = time.perf_counter()
    while len(done) < len(seqs):
        engine.step()
        now = time.perf_counter() - t0
        for i, s in enumerate(seqs):
            if i not in done and s.is_finished:
                done[i] = now
    ends = sorted(done.values())
    tail_from = ends[math.ceil(TAIL * len(ends)) - 1]
    return {
        "all_s": ends[-1],
        "t90_s": tail_from,
        "tail_s": ends[-1] - tail_from,
        "tokens": sum(len(s.output_ids) for s in seqs),
        "lengths": sorted(len(s.output_ids) for s in seqs),
        "outputs": [list(s.output_ids) for s in seqs],
        "drafted": sum(s.spec_proposed for s in seqs),
        "accepted": sum(s.spec_accepted for s in seqs),
    }


def run(
    engine: dict | None = None,
    configs: str = CONFIGS,
    repeats: int = 2,
    parts: str = PARTS,
    rollout_config: str = ROLLOUT_CONFIG,
    rollout_tokens: int = ROLLOUT_TOKENS,
    rollout_repeats: int = 1,
    rollout_disable_by_batch_size: int | None = ROLLOUT_DISABLE,
) -> dict:
    """The benchmark's `parts` ("batch1": grounded and free prompts; "rollout"); `engine`: extra
    `LLM` options for every engine (e.g. a dtype)."""
    from hotswap import LLM, SamplingParams
    from hotswap.cli.models import SMOLLM2_INSTALL, smollm2_gguf
    from hotswap.engine.chat import chat_prompt

    model = smollm2_gguf()
    if model is None:
        raise SystemExit(f"benchmarks.speculative needs the SmolLM2 GGUF: {SMOLLM2_INSTALL}")
    # every engine's options but the speculation, which is what the benchmark varies
    engine = {k: v for k, v in {**ENGINE, **(engine or {})}.items() if k != "speculative_config"}
    plain = LLM(model, **engine)
    tok = plain.tokenizer

    def chat(texts: dict[str, str]) -> dict[str, list[int]]:
        return {k: chat_prompt(tok, [{"role": "user", "content": v}])[1] for k, v in texts.items()}

    grounded, free = chat(GROUNDED), chat(FREE)
    result = {"model": str(model.name), "engine": engine}
    if "batch1" in parts.split(","):
        llms = {"plain": plain}
        for c in parse_configs(configs):
            llms[label(c)] = LLM(model, **engine, speculative_config=ngram(*c))
        names = list(llms)
        # warm: each engine's first decode and verification steps' host paths
        for name in names:
            decode(llms[name], grounded[next(iter(grounded))], SamplingParams(temperature=0, max_tokens=8))
        batch1 = dict(list(grounded.items())[:BATCH1_GROUNDED])
        result["prompt_tokens"] = {k: len(v) for k, v in {**batch1, **free}.items()}
        result["repeats"] = repeats
        for part, prompts, n in (("grounded", batch1, GROUNDED_TOKENS), ("free", free, FREE_TOKENS)):
            runs = compare(names, prompts, SamplingParams(temperature=0, max_tokens=n), llms, repeats)
            result[part] = summarise(runs)
            _table(part, result[part])
        del llms
    del plain
    gc.collect()
    if "rollout" in parts.split(","):
        config = parse_configs(rollout_config)[0]
        result["rollout"] = _rollout(
            model,
            engine,
            list(grounded.values())[:ROLLOUT_PROMPTS],
            config,
            rollout_tokens,
            rollout_repeats,
            rollout_disable_by_batch_size,
        )
    return result


def _rollout(
    model,
    engine: dict,
    prompts: list[list[int]],
    config: tuple[int, int, int],
    new_tokens: int,
    repeats: int,
    off: int | None,
) -> dict:
    """The same seeded rollout on a plain and a speculating engine, alternated (A-B, B-A, ...)."""
    from hotswap import LLM, SamplingParams

    # every sample in flight at once; KV pages for the prompts (shared by their group) and every
    # sample's tokens, not the CPU default's half-length sequences (GBs at 64 sequences)
    ps = engine.get("page_size", 16)
    pages = sum(-(-len(p) // ps) + ROLLOUT_N * (-(-new_tokens // ps) + 2) for p in prompts) + 1
    engine = {**engine, "max_num_seqs": len(prompts) * ROLLOUT_N, "num_pages": pages}
    llms = {
        "plain": LLM(model, **engine),
        label(config): LLM(model, **engine, speculative_config=ngram(*config, off)),
    }
    sp = SamplingParams(n=ROLLOUT_N, temperature=1.0, seed=SEED, max_tokens=new_tokens)
    for llm in llms.values():  # warm: sampled steps at a few batch sizes
        rollout(llm, prompts[:1], dataclasses.replace(sp, max_tokens=8))
    runs = {name: [] for name in llms}
    for r in range(repeats):
        for name in list(llms)[:: 1 if r % 2 == 0 else -1]:
            runs[name].append(rollout(llms[name], prompts, sp))
    out = {
        "workload": {
            "prompts": len(prompts),
            "n": ROLLOUT_N,
            "max_tokens": new_tokens,
            "temperature": 1.0,
            "seed": SEED,
            "repeats": repeats,
            "disable_by_batch_size": off,
        }
    }
    reference = runs["plain"][0]["outputs"]
    for name, rs in runs.items():
        row = {key: statistics.median(r[key] for r in rs) for key in ("all_s", "t90_s", "tail_s")}
        row["tokens"] = rs[0]["tokens"]
        lengths = rs[0]["lengths"]
        row["lengths_min_median_max"] = [lengths[0], statistics.median(lengths), lengths[-1]]
        row["at_max_tokens"] = sum(n == new_tokens for n in lengths)
        drafted = sum(r["drafted"] for r in rs)
        row["acceptance"] = sum(r["accepted"] for r in rs) / drafted if drafted else 0.0
        # samples whose tokens are plain decoding's (seeded: a sample is one stream of draws)
        row["samples_equal_to_plain"] = min(
            sum(a == b for a, b in zip(r["outputs"], reference, strict=True)) for r in rs
        )
        row["runs_s"] = [[round(r["all_s"], 3), round(r["tail_s"], 3)] for r in rs]
        out[name] = row
    spec = out[label(config)]
    for key in ("all_s", "t90_s", "tail_s"):
        spec[f"{key[:-2]}_speedup"] = out["plain"][key] / spec[key] if spec[key] else None
    print(
        f"\nrollout {len(prompts)}x{ROLLOUT_N}, T=1, <= {new_tokens} tokens | plain: all {out['plain']['all_s']:.2f} s, "
        f"90% {out['plain']['t90_s']:.2f} s, last 10% {out['plain']['tail_s']:.2f} s | {label(config)}: all "
        f"{spec['all_s']:.2f} s, 90% {spec['t90_s']:.2f} s, last 10% {spec['tail_s']:.2f} s, acceptance "
        f"{spec['acceptance']:.2f}, samples equal to plain {spec['samples_equal_to_plain']}/{len(reference)}",
        flush=True,
    )
    return out


def _table(part: str, rows: dict) -> None:
    print(f"\n{part}: batch 1, greedy", flush=True)
    print(
        f"{'engine':<10} {'tok/s':>7} {'x plain':>8} {'x summed':>9} {'accept':>7} {'acc/verif':>9} {'tok/step':>8} {'ms/step':>7} {'same':>5}"
    )
    for name, r in rows.items():
        print(
            f"{name:<10} {r['tok_s']:>7.1f} {r['ratio_median']:>8.2f} {r['ratio_summed']:>9.2f} {r['acceptance']:>7.2f} "
            f"{r['accepted_per_verification']:>9.2f} {r['tokens_per_step']:>8.2f} {r['ms_per_step']:>7.1f} {str(r['equal_to_plain']):>5}",
            flush=True,
        )


def check(result: dict) -> None:
    """Greedy speculation must not change a token (batch 1, every engine of the grid)."""
    for part in ("grounded", "free"):
        bad = [name for name, r in result.get(part, {}).items() if not r["equal_to_plain"]]
        assert not bad, f"{part}: {bad} decoded other tokens than plain decoding"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    from hotswap.kernels.cpu_target import host

    result = run(
        configs=a.spec_configs,
        repeats=a.spec_repeats,
        parts=a.parts,
        rollout_config=a.rollout_config,
        rollout_tokens=a.rollout_tokens,
        rollout_repeats=a.rollout_repeats,
        rollout_disable_by_batch_size=a.rollout_disable_by_batch_size or None,
    )
    print(json.dumps({"cpu": host().describe(), **_rounded(result)}))
    check(result)


def _rounded(x):
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-configs", default=CONFIGS, help="n-gram engines at batch 1, as k:min-max,...")
    p.add_argument("--spec-repeats", type=int, default=2, help="turns through every prompt and engine")
    p.add_argument("--parts", default=PARTS, help="batch1 (grounded and free prompts), rollout, or both")
    p.add_argument("--rollout-config", default=ROLLOUT_CONFIG, help="the rollout's n-gram engine, k:min-max")
    p.add_argument("--rollout-tokens", type=int, default=ROLLOUT_TOKENS)
    p.add_argument("--rollout-repeats", type=int, default=1, help="plain and speculative runs, alternated")
    p.add_argument(
        "--rollout-disable-by-batch-size",
        type=int,
        default=ROLLOUT_DISABLE,
        help="the rollout engine's disable_by_batch_size (0: drafts at every batch size)",
    )


if __name__ == "__main__":
    main()
