"""Deterministic mode (`LLM(deterministic=True)`): a request's token ids and log-probs are the same
bits alone, in a batch of 15 others, after a prefix hit and with a smaller prefill chunk, for
greedy and seeded sampling, and `score` returns those log-probs (and the prompt's, asked with
`prompt_logprobs`) bit for bit. Where the mode cannot run (other dtypes, attention paths, a
multi-device mesh) it is a ConfigError."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import WORKER_PYTHONPATH

from hotswap import LLM, SamplingParams
from hotswap.errors import ConfigError
from hotswap.kernels import cpu_attention, cpu_build, cpu_matmul
from hotswap.kernels.backend import Backend

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="the C++ kernels did not build here")

VOCAB = 512  # the tiny preset's
SAMPLING = {
    "greedy": SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
}


def _tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, n)]


@pytest.fixture(scope="module")
def engines(tiny_dir):
    """One engine per arrangement, all deterministic: the default chunk (prefix cache off, so a
    request alone and in a batch both prefill), a 64-token prefill chunk, and the prefix cache on."""
    kw = dict(deterministic=True, max_num_seqs=16, warmup=False)
    return {
        "plain": LLM(tiny_dir, enable_prefix_caching=False, **kw),
        "chunk64": LLM(tiny_dir, enable_prefix_caching=False, max_num_batched_tokens=64, **kw),
        "prefix": LLM(tiny_dir, **kw),
    }


def _one(llm: LLM, prompts: list[list[int]], sp: SamplingParams, cached: int = 0):
    """The last prompt's completion: (token ids, f32 log-probs); `cached`: the prompt tokens it
    must have found in the prefix cache."""
    last = llm.generate(prompts, [sp] * len(prompts), use_tqdm=False)[-1]
    assert last.num_cached_tokens == cached
    out = last.outputs[0]
    return out.token_ids, np.asarray(out.logprobs, np.float32)


def _assert_bitwise(got, want, what: str):
    assert got[0] == want[0], f"{what}: token ids differ"
    assert got[1].tobytes() == want[1].tobytes(), (
        f"{what}: log-probs differ by {np.max(np.abs(got[1] - want[1]))}"
    )


@pytest.mark.parametrize("mode", sorted(SAMPLING))
def test_a_request_is_the_same_bits_whatever_else_runs(engines, mode):
    sp = SAMPLING[mode]
    target = _tokens(100 + sorted(SAMPLING).index(mode), 80)  # its own per mode: no hit from the other
    others = [
        _tokens(200 + i, n) for i, n in enumerate([5, 9, 17, 23, 31, 40, 47, 52, 64, 70, 77, 90, 101, 3, 120])
    ]
    alone = _one(engines["plain"], [target], sp)
    assert len(alone[0]) == sp.max_tokens
    _assert_bitwise(_one(engines["plain"], [*others, target], sp), alone, "in a batch of 15 others")
    _assert_bitwise(_one(engines["chunk64"], [*others[:6], target], sp), alone, "max_num_batched_tokens=64")
    # Another request shares the first 48 tokens (3 pages), then the target hits them.
    prefix = engines["prefix"]
    _one(prefix, [target[:48] + _tokens(300, 20)], sp)
    _assert_bitwise(_one(prefix, [target], sp, cached=48), alone, "after a 48-token prefix hit")
    score = engines["plain"].score(target, alone[0])
    assert np.asarray(score, np.float32).tobytes() == alone[1].tobytes(), "score differs from generation"


def test_prompt_logprobs_are_the_bits_score_returns(engines):
    """SamplingParams.prompt_logprobs, computed by the step programs in prefill chunks beside
    other rows, is `score`'s log-probs bit for bit."""
    target = _tokens(400, 90)
    sps = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, prompt_logprobs=1)]
    plp = engines["chunk64"].generate([_tokens(401, 30), target], sps, use_tqdm=False)[1].prompt_logprobs
    got = np.asarray([plp[t][target[t]].logprob for t in range(1, len(target))], np.float32)
    assert got.tobytes() == np.asarray(engines["plain"].score(target[:1], target[1:]), np.float32).tobytes()


def test_fixed_matmul_rows_do_not_depend_on_the_row_count():
    rng = np.random.default_rng(0)
    for k, n in ((64, 100), (33, 7), (128, 48)):
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((70, k)), jnp.float32)
        mm = jax.jit(lambda a, w=w: cpu_matmul.fixed_matmuls(a, [w])[0])
        full = np.asarray(mm(x))
        np.testing.assert_allclose(full, np.asarray(x) @ np.asarray(w), rtol=1e-4, atol=1e-4)
        for m in (1, 2, 3, 9, 16, 33):
            assert np.asarray(mm(x[:m])).tobytes() == full[:m].tobytes(), (k, n, m)


def test_fixed_norm_and_keep_threshold_rows_do_not_depend_on_the_row_count():
    """The RMS norms' mean of squares (XLA's reduction changes a row's bits with the row count;
    the mode's does not) and the sampler filters' keep thresholds (a C++ select per row)."""
    backend = Backend(attention="cpu", platform="cpu", deterministic=True)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((40, 64)).astype(np.float32) * 3
    full = np.asarray(jax.jit(backend.mean_square)(x))
    for m in (1, 2, 3, 5, 8, 16):
        assert np.asarray(jax.jit(backend.mean_square)(x[:m])).tobytes() == full[:m].tobytes(), m
    logits = rng.standard_normal((40, 512)).astype(np.float32) * 3
    logits[3, ::3] = -np.inf  # masked entries: probability 0
    k, p, mp = rng.integers(0, 60, 40), rng.uniform(0.5, 1.0, 40), rng.uniform(0.0, 0.2, 40)
    args = [a.astype(t) for a, t in ((k, np.int32), (p, np.float32), (mp, np.float32))]
    thresholds = jax.jit(backend.keep_thresholds)
    full = np.asarray(thresholds(logits, *args))
    for m in (1, 2, 3, 5, 8, 16):
        got = np.asarray(thresholds(logits[:m], *(a[:m] for a in args)))
        assert got.tobytes() == full[:m].tobytes(), m


@pytest.mark.parametrize("hd", [16, 64])
def test_fixed_attention_does_not_depend_on_the_chunk_layout(hd):
    """A query's output is the same bits whether its keys come from a permuted page table, from
    its chunk (starting anywhere) or both, and whether it is a decode row or inside a prefill."""
    rng = np.random.default_rng(1)
    n, hq, hkv, ps = 70, 4, 2, 16
    q, k, v = (rng.standard_normal((n, h, hd)).astype(np.float32) for h in (hq, hkv, hkv))
    table = np.array([[4, 1, 3, 6, 7]], np.int32)  # positions p sit in page table[p // ps]
    pages = np.full((8, ps, 2 * hkv, hd), np.nan, np.float32)  # unused slots never read
    for p in range(n):
        pages[table[0, p // ps], p % ps, 0::2], pages[table[0, p // ps], p % ps, 1::2] = k[p], v[p]

    def attend(rows: int, cols: int, start: np.ndarray, q_pos: np.ndarray):
        sl = q_pos.reshape(-1)
        out = cpu_attention.paged_attention(
            jnp.asarray(q[sl].reshape(rows, cols, hq, hd)),
            jnp.asarray(pages),
            jnp.asarray(k[sl].reshape(rows, cols, hkv, hd)),
            jnp.asarray(v[sl].reshape(rows, cols, hkv, hd)),
            jnp.asarray(np.repeat(table, rows, 0)),
            jnp.asarray(q_pos.reshape(rows, cols), jnp.int32),
            jnp.asarray(start, jnp.int32),
            jnp.full((rows,), n, jnp.int32),
            scale=0.125,
            fixed=True,
        )
        return np.asarray(out).reshape(-1, hq, hd)

    whole = attend(1, n, np.array([0]), np.arange(n))
    for start in (20, 32, 48, 61, 69):
        assert (
            attend(1, n - start, np.array([start]), np.arange(start, n)).tobytes() == whole[start:].tobytes()
        )
    decode = np.arange(n - 8, n)
    assert attend(8, 1, decode, decode).tobytes() == whole[n - 8 :].tobytes()


def test_deterministic_mode_refuses_what_it_cannot_keep(tiny_dir):
    dev = jax.devices()[0]
    with pytest.raises(ConfigError, match="C\\+\\+ CPU kernels"):
        Backend.choose("reference", head_dim=16, devices=[dev], deterministic=True)
    with pytest.raises(ConfigError, match="float32"):
        Backend.choose("auto", head_dim=16, dtype="bfloat16", devices=[dev], deterministic=True)
    with pytest.raises(ConfigError, match="C\\+\\+ CPU kernels"):  # a cache on 2 devices: the jnp path
        Backend.choose("auto", head_dim=16, devices=[dev, dev], deterministic=True)
    assert not Backend.choose("auto", head_dim=16, devices=[dev]).deterministic  # the default is unchanged


TP_SCRIPT = """
import sys
from hotswap import LLM
from hotswap.checkpoint.create import create_checkpoint
from hotswap.errors import ConfigError
model = create_checkpoint(sys.argv[1], overrides={"num_key_value_heads": 4})  # 4 kv heads: TP 4 divides
for tp in (2, 4):
    try:
        LLM(model, tensor_parallel_size=tp, deterministic=True, warmup=False)
    except ConfigError as e:
        print(f"tp{tp} refused: {e}")
    else:
        print(f"tp{tp} ran")
"""


def test_tensor_parallel_is_refused_on_the_fake_mesh(tmp_path):
    """TP 2/4 on the 8-device fake CPU mesh: the C++ kernels run on one device, and the jnp path
    under GSPMD has no fixed-order matmul or reduction, so the mode refuses rather than promise."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": WORKER_PYTHONPATH,
    }
    proc = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, str(tmp_path / "kv4")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()[-2:]
    assert [ln.split(" refused")[0] for ln in lines] == ["tp2", "tp4"], proc.stdout
    assert all("deterministic mode needs the C++ CPU kernels" in ln for ln in lines)
