"""Every CPU path of the C++ paged attention (`cpu_attention.runnable()`: AVX512_BF16's vdpbf16ps
fold of bf16 pages read in place, the f32 AVX-512 / AVX2 folds of widened pages, plain loops) on
bf16 pages against `reference.paged_attention`, and a path the CPU lacks or the kernel does not
offer refused by name.

The pages hold every row's keys including the step's own (the reference's view); the kernel gets
the cache before the step plus the step's K/V (`cpu_attention` doc). Slots no query may read hold
NaN, so a read past a row's keys (an odd last key pair, a page past the row's end) shows up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.kernels import cpu_attention, cpu_isa, reference

PS, SCALE = 16, 0.125
PATHS = cpu_attention.runnable()


def _world(rng, lengths, chunk, *, hkv, hd, prompt):
    """Rows of `lengths` keys (the step's `chunk` tokens included), those of the first four with
    the prompt cached sharing the pages of a `prompt`-token prompt (a prompt sampled n times);
    pages anywhere in the pool."""
    pages_per_row = [-(-n // PS) for n in lengths]
    num_pages = 1 + sum(pages_per_row) + prompt // PS + 2
    ids = iter(rng.permutation(np.arange(1, num_pages)).tolist())
    shared = [next(ids) for _ in range(prompt // PS)]
    pages = np.full((num_pages, PS, 2 * hkv, hd), np.nan, np.float32)
    prompt_kv = rng.standard_normal((prompt, 2 * hkv, hd))
    tables = np.zeros((len(lengths), max(pages_per_row)), np.int32)
    for row, n in enumerate(lengths):
        kv = rng.standard_normal((n, 2 * hkv, hd))
        sample = row < 4 and n - chunk >= prompt
        if sample:
            kv[:prompt] = prompt_kv
        for k in range(pages_per_row[row]):
            page = shared[k] if sample and k < len(shared) else next(ids)
            tables[row, k] = page
            pages[page, : min(PS, n - k * PS)] = kv[k * PS : (k + 1) * PS]
    pages = np.asarray(jnp.asarray(pages, jnp.bfloat16).astype(jnp.float32))  # what bf16 holds
    return pages, tables


def _step(rng, lengths, chunk, *, hkv, g, hd, prompt=3 * PS):
    """The kernel's inputs for a step whose rows end at `lengths` with `chunk` new tokens each
    ([B, chunk]), and the reference's (bf16-rounded q; K/V of the step in the pages)."""
    pages, tables = _world(rng, lengths, chunk, hkv=hkv, hd=hd, prompt=prompt)
    b = len(lengths)
    lens = np.asarray(lengths, np.int32)
    starts = lens - chunk
    positions = (starts[:, None] + np.arange(chunk)[None]).astype(np.int32)
    q = np.asarray(
        jnp.asarray(rng.standard_normal((b, chunk, hkv * g, hd)), jnp.bfloat16).astype(jnp.float32)
    )
    slot = lambda row, p: pages[tables[row, p // PS], p % PS]  # noqa: E731  [2*hkv, hd]
    kv_new = np.stack([np.stack([slot(r, p) for p in positions[r]]) for r in range(b)])  # [B, C, 2*hkv, hd]
    cache = pages.copy()
    for r in range(b):
        for p in positions[r]:
            cache[tables[r, p // PS], p % PS] = np.nan  # the kernel must take them from k_new / v_new
    return (q, cache, kv_new[:, :, 0::2], kv_new[:, :, 1::2], tables, positions, starts, lens), pages


def _check(path, *, hd, g, hkv=2, chunk=1, lengths, window=None, softcap=None, fixed=False):
    rng = np.random.default_rng(hd * 100 + g * 10 + chunk)
    (q, cache, k_new, v_new, tables, positions, starts, lens), pages = _step(
        rng, lengths, chunk, hkv=hkv, g=g, hd=hd
    )
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    out = cpu_attention.paged_attention(
        bf(q), bf(cache), bf(k_new), bf(v_new), tables, positions, starts, lens,
        scale=SCALE, window=window, softcap=softcap, fixed=fixed, isa=path,
    )  # fmt: skip
    got = np.asarray(out.astype(jnp.float32))
    want = np.asarray(
        reference.paged_attention(
            jnp.asarray(q),
            jnp.asarray(pages),
            tables,
            positions,
            lens,
            scale=SCALE,
            window=window,
            softcap=softcap,
        )
    )
    assert np.isfinite(got).all(), f"{path}: NaN from a slot no query may read"
    # Both f32 folds and the bf16 one land within ~4e-3 (the bf16 output's own rounding is most of
    # it) and 2e-3 in norm; a dropped or doubled key, a wrong V pair or a mis-ordered output
    # value is off by 1e-2 and more.
    err = np.abs(got - want)
    assert err.max() < 1e-2, f"{path}: max error {err.max():.4f}"
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 4e-3, f"{path}: relative error {rel:.5f}"


# Decode rows: four samples of one prompt (their pages shared: `GroupHeads`) and three rows alone,
# with odd numbers of keys in their last blocks (the bf16 fold pairs keys along V).
DECODE = [3 * PS + 1, 3 * PS + 6, 4 * PS + 3, 6 * PS, 5, PS + 9, 2 * PS + 14]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hd,g", [(64, 3), (64, 5), (128, 2), (32, 3)])  # 4 + 1 heads; no bf16 fold at 32
def test_decode_on_bf16_pages(path, hd, g):
    _check(path, hd=hd, g=g, lengths=DECODE)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window,softcap", [(None, None), (21, 20.0)])
def test_prefill_chunks_window_and_softcap(path, window, softcap):
    """Chunks of 13 queries after cached prefixes (a run of queries folds each block together)."""
    _check(path, hd=64, g=3, chunk=13, lengths=[3 * PS + 13, 2 * PS + 20, 13], window=window, softcap=softcap)


@pytest.mark.parametrize("path", PATHS)
def test_fixed_order(path):
    _check(path, hd=128, g=2, chunk=5, lengths=[3 * PS + 5, PS + 8], fixed=True)


def test_auto_is_the_best_path():
    """ "auto" runs the first of `runnable()`: the same bits."""
    rng = np.random.default_rng(0)
    args, _ = _step(rng, DECODE, 1, hkv=2, g=3, hd=64)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in args[:4]]
    run = lambda isa: np.asarray(cpu_attention.paged_attention(*bf, *args[4:], scale=SCALE, isa=isa))  # noqa: E731
    np.testing.assert_array_equal(run("auto"), run(PATHS[0]))


def test_a_path_this_cpu_lacks_or_the_kernel_lacks_is_a_clear_error():
    lacking = [p for p in cpu_attention.PATHS if p not in PATHS] + ["avx512_vnni"]  # vnni: not offered
    rng = np.random.default_rng(1)
    args, _ = _step(rng, [PS + 3, 5], 1, hkv=1, g=1, hd=64)
    for path in lacking:
        with pytest.raises(Exception, match=f"isa {cpu_isa.PATHS[path]} is not a path of this kernel"):
            jax.block_until_ready(cpu_attention.paged_attention(*args, scale=SCALE, isa=path))
    with pytest.raises(ValueError, match="unknown CPU path 'sse'"):
        cpu_attention.paged_attention(*args, scale=SCALE, isa="sse")
