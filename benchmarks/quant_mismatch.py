"""`hotswap bench --quantization`: the RL mismatch a trainer must correct for when the rollout is
sampled by a quantized engine and the policy it trains is the full-precision model.

On SmolLM2-135M-Instruct (the registry-shipped GGUF, Q4_1), a GRPO-style rollout: 8 chat prompts
x n=8 samples at temperature 1 (seeded, `NEW_TOKENS` each, stopping at EOS), sampled once per
scheme by its engine:

- `none`: the policy's own engine (the baseline: what the sampler-side figures are without
  quantization);
- `int8`: `LLM(path, quantization="int8", dtype="bfloat16")`, the file's weights dequantized and
  re-quantized to int8 with one scale per output column;
- `int8_g64`: the same with one scale per 64 inputs (`quantization_group_size=64`); from 16 rows a
  step the int8 kernel quantizes x too, per row and group (VNNI), so the groups bound x's error;
- `q4`: `LLM(path, quantization="gguf", dtype="bfloat16")`, the file's Q4_1 blocks as they are;

and the same prompt + sampled tokens scored under the policy, the file dequantized to bf16
(`LLM(path, dtype="bfloat16")`). Both engines score each sequence with the cache-free forward
`LLM.score` runs, over the whole vocabulary; per sampled token t, with r the rollout engine and p
the policy:

- `logp_diff = log p(t) - log r(t)`: mean, mean |.|, max |.|;
- the importance ratio p(t) / r(t) = exp(logp_diff): the fraction above each truncated-importance-
  sampling cap (`CAPS`), and below 1 / cap (the tokens a cap on the inverse would clip);
- `KL(r || p)` at each sampled position from the full distributions: mean and max per token;
  beside it the sampled-token estimators k1 = mean(log r - log p) and k3 = mean(ratio - 1 - log
  ratio), which a trainer that keeps only the sampled log-probs would use;
- `sampler_*`: the same per-token figures with the sampler's own log-probs as log r (`logprobs=0`,
  `logprobs_mode="processed_logprobs"`: at T=1 with no top-k/top-p, the raw distribution's), what
  a trainer holds. They differ from the scored ones by `sampler_vs_rollout_abs_*`: a decode step
  (KV cache, one row per sequence) and the cache-free forward round their bf16 activations at
  other points, so the same engine's two log-probs of a token are not equal in bf16.

Checked too: `LLM.score` of the first sequences on both engines against the forward the figures
come from (`score_vs_forward_abs_max`).

    python -m benchmarks.quant_mismatch [--schemes none,int8,q4] [--new-tokens 96]

Prints a table and one JSON line (the CPU first).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

PROMPTS = (
    "A train leaves at 3:40 pm and arrives at 6:15 pm. How long is the journey? Explain step by step.",
    "Tom has 3 boxes of 12 pencils and gives away 17 pencils. How many does he have left?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Is 221 a prime number? Show your reasoning.",
    "Explain in a few sentences why ice floats on water.",
    "A rectangle is 7 cm wide and 3 times as long. What is its area?",
    "List three differences between a list and a tuple in Python.",
    "If a shirt costs $24 after a 20% discount, what was the original price?",
)
N, NEW_TOKENS, SEED = 8, 96, 0
CAPS = (2.0, 5.0)  # truncated importance sampling caps on p / r
# The rollout engines, each `LLM(path, **SCHEMES[name], **ENGINE)`; the policy: `**ENGINE`.
# "none": the policy's own engine samples, the baseline of the sampler-side figures.
SCHEMES = {
    "none": {},
    "int8": {"quantization": "int8"},
    "int8_g64": {"quantization": "int8", "quantization_group_size": 64},
    "q4": {"quantization": "gguf"},
}
ENGINE = {"dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 64, "warmup": False}  # not timed
KL_BATCH = 8  # sequences per full-vocabulary forward: [8, L, V] f32 logits per engine


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt: list[int]
    tokens: list[int]
    logprobs: np.ndarray  # the sampler's, f32 [len(tokens)]


def chat_prompts(llm, texts=PROMPTS) -> list[list[int]]:
    """Each text as one user turn, rendered by the model's chat template."""
    from hotswap.engine.chat import chat_prompt

    return [chat_prompt(llm.tokenizer, [{"role": "user", "content": t}])[1] for t in texts]


def rollout(llm, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[Sample]:
    """n samples per prompt at T=1 with the sampler's log-probs of the tokens it drew."""
    from hotswap import SamplingParams

    sp = SamplingParams(
        n=n,
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        logprobs=0,
        logprobs_mode="processed_logprobs",
    )
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [
        Sample(list(p), list(c.token_ids), np.asarray(c.logprobs, np.float32))
        for p, o in zip(prompts, outs, strict=True)
        for c in o.outputs
    ]


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def _log_softmax(params, tokens, lengths, *, cfg, backend):
    """log softmax of the cache-free forward `LLM.score` runs: [B, L-1, V] f32, position i the
    distribution of token i + 1."""
    from hotswap.model.forward import forward_dense

    logits = forward_dense(params, tokens, lengths, cfg=cfg, backend=backend)[:, :-1]
    return jax.nn.log_softmax(logits, axis=-1)


@jax.jit
def _compare(lr, lp, tokens):
    """Per position [B, L-1]: KL(r || p), and log r and log p of the next token.

    Not as sum r (log r - log p): each log-softmax carries its normalizer's f32 rounding (~1e-6
    nats, a shift of every entry), which that sum adds to the KL whole, and int8's KL can be of
    that size. With d = log r - log p and m = E_r[d], KL = log E_r[exp(-(d - m))] (as sum p = 1),
    the same value in exact arithmetic, in which a shift of d cancels."""
    r = jnp.exp(lr)
    d = lr - lp
    e = d - jnp.sum(r * d, axis=-1, keepdims=True)
    kl = jnp.log1p(jnp.sum(r * jnp.expm1(-e), axis=-1))
    nxt = tokens[:, 1:, None]
    return kl, jnp.take_along_axis(lr, nxt, axis=-1)[..., 0], jnp.take_along_axis(lp, nxt, axis=-1)[..., 0]


def compare(rollout_llm, policy_llm, samples: list[Sample]) -> dict[str, np.ndarray]:
    """Per sampled token (concatenated in sample order): `kl`, KL(r || p) of the two engines' full
    distributions at its position, and `r`, `p`, each engine's log-prob of it. One cache-free
    forward per engine per `KL_BATCH` sequences, the forward `LLM.score` runs (checked against it
    in `mismatch`): [KL_BATCH, L, V] f32 logits per engine, where scoring all 64 at once would
    hold 64."""
    out: dict[str, list] = {"kl": [], "r": [], "p": []}
    for i in range(0, len(samples), KL_BATCH):
        chunk = samples[i : i + KL_BATCH]
        seqs = [s.prompt + s.tokens for s in chunk]
        length = 64 * math.ceil(max(map(len, seqs)) / 64)  # as `LLM.score` pads: few compilations
        toks = np.zeros((KL_BATCH, length), np.int32)
        lens = np.zeros(KL_BATCH, np.int32)
        for j, s in enumerate(seqs):
            toks[j, : len(s)], lens[j] = s, len(s)
        toks, lens = jnp.asarray(toks), jnp.asarray(lens)
        lr, lp = (
            _log_softmax(e.params, toks, lens, cfg=e.config, backend=e.engine.backend)
            for e in (rollout_llm, policy_llm)
        )
        got = [np.asarray(a) for a in _compare(lr, lp, toks)]
        del lr, lp
        for j, s in enumerate(chunk):
            span = slice(len(s.prompt) - 1, len(s.prompt) + len(s.tokens) - 1)
            for key, a in zip(out, got, strict=True):
                out[key].append(a[j, span])
    return {k: np.concatenate(v).astype(np.float64) for k, v in out.items()}


def mismatch(
    rollout_llm,
    policy_llm,
    prompts: list[list[int]],
    n: int = N,
    max_tokens: int = NEW_TOKENS,
    seed: int = SEED,
) -> dict:
    """The mismatch of a rollout sampled by `rollout_llm` against `policy_llm` (module doc)."""
    samples = rollout(rollout_llm, prompts, n, max_tokens, seed)
    got = compare(rollout_llm, policy_llm, samples)
    kl, lr, lp = got["kl"], got["r"], got["p"]
    sampler = np.concatenate([s.logprobs for s in samples]).astype(np.float64)
    # `LLM.score` of the first chunk, both engines: the public scoring path gives these log-probs
    first = samples[:KL_BATCH]
    k = sum(len(s.tokens) for s in first)
    scored = {
        key: np.concatenate(e.score([(s.prompt, s.tokens) for s in first]))
        for key, e in (("r", rollout_llm), ("p", policy_llm))
    }
    out = {
        "samples": len(samples),
        "tokens": int(kl.size),
        **_figures(lp - lr),
        "kl_full_mean": float(kl.mean()),
        "kl_full_max": float(kl.max()),
        # what a trainer holds: the sampler's log-probs as log r
        **_figures(lp - sampler, "sampler_"),
        "sampler_vs_rollout_abs_mean": float(np.abs(sampler - lr).mean()),
        "sampler_vs_rollout_abs_max": float(np.abs(sampler - lr).max()),
        "score_vs_forward_abs_max": float(
            max(np.abs(scored["r"] - lr[:k]).max(), np.abs(scored["p"] - lp[:k]).max())
        ),
    }
    return out


def _figures(diff: np.ndarray, prefix: str = "") -> dict:
    """Per-token figures of diff = log p - log r, the log importance ratio p / r."""
    ratio = np.exp(diff)
    out = {
        "logp_diff_mean": float(diff.mean()),
        "logp_diff_abs_mean": float(np.abs(diff).mean()),
        "logp_diff_abs_max": float(np.abs(diff).max()),
        "kl_k1": float(-diff.mean()),
        "kl_k3": float(np.mean(ratio - 1.0 - diff)),
    }
    for cap in CAPS:
        out[f"ratio_above_{cap:g}"] = float(np.mean(ratio > cap))
        out[f"ratio_below_1/{cap:g}"] = float(np.mean(ratio < 1.0 / cap))
    return {prefix + key: v for key, v in out.items()}


def run(schemes: list[str], new_tokens: int = NEW_TOKENS, engine: dict | None = None) -> dict:
    """The table: one row per scheme against the bf16 policy, on the same prompts and seed."""
    from hotswap import LLM
    from hotswap.cli.models import SMOLLM2_INSTALL, smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        raise SystemExit(f"benchmarks.quant_mismatch needs the SmolLM2 GGUF: {SMOLLM2_INSTALL}")
    engine = {**ENGINE, **(engine or {})}
    policy = LLM(path, **engine)
    prompts = chat_prompts(policy)
    rows = {}
    for name in schemes:
        sampler = LLM(path, **{**engine, **SCHEMES[name]}) if SCHEMES[name] else policy
        rows[name] = mismatch(sampler, policy, prompts, N, new_tokens, SEED)
        print(_line(name, rows[name]), flush=True)
        del sampler
        gc.collect()
    return {
        "model": path.name,
        "policy": f"dequantized, {engine['dtype']}",
        "prompts": len(prompts),
        "n": N,
        "max_tokens": new_tokens,
        "temperature": 1.0,
        "seed": SEED,
        "kl": "full distributions (kl_full_*); k1/k3: sampled-token estimators",
        "schemes": rows,
    }


def _line(name: str, row: dict) -> str:
    return f"{name}: " + " | ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated: " + ", ".join(SCHEMES))
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    a = p.parse_args()
    from hotswap.kernels.cpu_target import host

    result = {"cpu": host().describe(), **run(a.schemes.split(","), a.new_tokens)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
