"""The C++ CPU attention kernel on decode rows that share their first pages (a prompt sampled n
times: `PagePool.share`). The kernel reads a shared page once for all such rows and folds it into
each row's own softmax state (`attention_work.h`: Groups; `paged_attention.cc`: GroupHeads).

Each case runs the same step twice: with the rows' tables naming the same prompt pages, and with
every row holding its own copies of them. The two outputs must be the same bits (a row folds the
same blocks in the same order either way), and both must match a float64 numpy oracle. Slots no
row may read hold NaN, so a read past a row's keys shows up as a NaN in its output.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hotswap.kernels import cpu_attention, cpu_build

PS, SCALE = 16, 0.2


def _step(rng, prompt: int, owns: list[int], strangers: list[int], *, hkv: int, g: int, hd: int, pad: int):
    """A decode step: rows 0..len(owns)-1 are samples of one `prompt`-token prompt, row i with
    owns[i] tokens of its own after it; then rows of other sequences (`strangers`: their lengths;
    they share only the prompt's first page, as a system prompt would); then `pad` padding rows.
    Rows are interleaved (samples and strangers alternate) so a group is not a block of the batch.
    Returns (shared inputs, copied inputs, oracle rows) where inputs are (q, pages, k_new, v_new,
    tables, positions, starts, lens)."""
    lengths = [prompt + o for o in owns] + [PS + s for s in strangers]
    n_rows = len(lengths) + pad
    order = list(range(len(lengths)))
    order = order[::2] + order[1::2]  # interleave
    shared_pages = prompt // PS  # whole prompt pages are shared; a partial one each row copies
    pages_per_row = [-(-length // PS) for length in lengths]
    num_pages = 1 + sum(pages_per_row) + shared_pages + 4
    ids = iter(rng.permutation(np.arange(1, num_pages)).tolist())
    prompt_ids = [next(ids) for _ in range(shared_pages)]
    system_id = prompt_ids[0] if prompt_ids else next(ids)
    pages = np.full((num_pages, PS, 2 * hkv, hd), np.nan, np.float32)
    p_max = max(pages_per_row) + 1
    tables_shared = np.zeros((n_rows, p_max), np.int32)
    keys = []  # per row: [length, 2*hkv, hd] the cached K/V it sees
    prompt_kv = rng.standard_normal((max(prompt, PS), 2 * hkv, hd)).astype(np.float32)
    for row, idx in enumerate(order):
        length, is_sample = lengths[idx], idx < len(owns)
        kv = rng.standard_normal((length, 2 * hkv, hd)).astype(np.float32)
        head = prompt if is_sample else PS  # tokens taken from the prompt's (or system page's) K/V
        kv[:head] = prompt_kv[:head]
        keys.append(kv)
        for k in range(pages_per_row[idx]):
            lo, hi = k * PS, min(length, (k + 1) * PS)
            if is_sample and k < shared_pages:
                page = prompt_ids[k]
            elif not is_sample and k == 0:
                page = system_id
            else:
                page = next(ids)
            tables_shared[row, k] = page
            pages[page, : hi - lo] = kv[lo:hi]
    # The copied world: every entry naming a page other rows name too gets a page of its own.
    used = [(row, k) for row in range(len(order)) for k in range(pages_per_row[order[row]])]
    counts = np.bincount([tables_shared[row, k] for row, k in used], minlength=num_pages)
    extra = [(row, k) for row, k in used if counts[tables_shared[row, k]] > 1]
    pages_copied = np.concatenate([pages, np.full((len(extra), PS, 2 * hkv, hd), np.nan, np.float32)])
    tables_copied = tables_shared.copy()
    for n, (row, k) in enumerate(extra):
        pages_copied[num_pages + n] = pages[tables_shared[row, k]]
        tables_copied[row, k] = num_pages + n
    starts = np.zeros(n_rows, np.int32)
    starts[: len(order)] = [lengths[i] for i in order]
    lens = np.where(np.arange(n_rows) < len(order), starts + 1, 0).astype(np.int32)
    q = rng.standard_normal((n_rows, 1, hkv * g, hd)).astype(np.float32)
    k_new = rng.standard_normal((n_rows, 1, hkv, hd)).astype(np.float32)
    v_new = rng.standard_normal((n_rows, 1, hkv, hd)).astype(np.float32)
    positions = starts[:, None].copy()
    shared = (q, pages, k_new, v_new, tables_shared, positions, starts, lens)
    copied = (q, pages_copied, k_new, v_new, tables_copied, positions, starts, lens)
    return shared, copied, keys


def _oracle(keys, q, k_new, v_new, row, *, hkv, g, window, softcap):
    """float64 attention of row's query over its cached keys plus its own."""
    kv = keys[row].astype(np.float64)
    k = np.concatenate([kv[:, 0::2], k_new[row, 0][None].astype(np.float64)])  # [L+1, hkv, hd]
    v = np.concatenate([kv[:, 1::2], v_new[row, 0][None].astype(np.float64)])
    pos = len(kv)
    first = 0 if window is None else max(0, pos - window + 1)
    out = np.zeros((hkv * g, q.shape[-1]))
    for h in range(hkv * g):
        s = k[first:, h // g] @ q[row, 0, h].astype(np.float64) * SCALE
        if softcap:
            s = softcap * np.tanh(s / softcap)
        p = np.exp(s - s.max())
        out[h] = p @ v[first:, h // g] / p.sum()
    return out


def _run(inputs, dtype, window, softcap):
    q, pages, k_new, v_new, tables, positions, starts, lens = inputs
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    out = cpu_attention.paged_attention(
        cast(q), cast(pages), cast(k_new), cast(v_new), tables, positions, starts, lens,
        scale=SCALE, window=window, softcap=softcap,
    )  # fmt: skip
    return np.asarray(out.astype(jnp.float32))


def _check(
    prompt, owns, strangers=(), *, dtype=np.float32, hkv=2, g=3, hd=64, pad=2, window=None, softcap=None
):
    rng = np.random.default_rng(len(owns) * 1000 + prompt)
    shared, copied, keys = _step(rng, prompt, list(owns), list(strangers), hkv=hkv, g=g, hd=hd, pad=pad)
    out_shared = _run(shared, dtype, window, softcap)
    out_copied = _run(copied, dtype, window, softcap)
    np.testing.assert_array_equal(out_shared, out_copied)  # the same blocks in the same order
    rows = len(owns) + len(strangers)
    assert not out_shared[rows:].any(), "padding rows come back as zeros"
    assert np.isfinite(out_shared).all(), "a slot no row may read (NaN) was read"
    q, _, k_new, v_new, *_ = shared
    if dtype != np.float32:  # the oracle sees what the kernel sees: bf16-rounded inputs
        r = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731
        keys, q, k_new, v_new = [r(k) for k in keys], r(q), r(k_new), r(v_new)
    tol = 2e-5 if dtype == np.float32 else 3e-2
    for row in range(rows):
        want = _oracle(keys, q, k_new, v_new, row, hkv=hkv, g=g, window=window, softcap=softcap)
        np.testing.assert_allclose(out_shared[row, 0], want, atol=tol, rtol=0)


# Group sizes 1..8 after a 3-page prompt, each sample with its own tokens (within a page, a
# page and more, none yet).
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_samples_of_one_prompt(n):
    _check(3 * PS, [0, 5, PS, 2 * PS + 3, 1, 7, 9, 33][:n])


# A prompt ending inside a page (its last page copied per sample), one of a single page, and none
# shared (prompt shorter than a page): the samples' tables then share nothing or one page.
@pytest.mark.parametrize("prompt", [2 * PS + 5, PS, 7])
def test_partial_and_short_prompts(prompt):
    _check(prompt, [3, 0, 20, 11])


# Other sequences share only the prompt's first page (a system prompt): they must not cut the
# samples' shared prefix short, and all rows stay exact.
def test_strangers_sharing_a_first_page():
    _check(4 * PS, [2, 9, 17, 4, 30], strangers=[3 * PS + 1, 10, 2 * PS])


# A sliding window that starts inside the shared prompt for some rows and after it for others,
# with a softcap.
@pytest.mark.parametrize("window,softcap", [(20, None), (40, 30.0)])
def test_window_and_softcap(window, softcap):
    _check(3 * PS, [0, 4, 2 * PS, 9, 50], window=window, softcap=softcap)


# The AVX2 fold's head_dim (64, 128) and head-group sizes (1, 4: three heads and one, 7), the
# portable loops (head_dim 32), bf16 pages and activations.
@pytest.mark.parametrize(
    "dtype,hd,g,hkv",
    [
        (np.float32, 128, 4, 2),
        (np.float32, 64, 1, 4),
        (np.float32, 64, 7, 1),
        (np.float32, 32, 3, 2),
        (jnp.bfloat16, 64, 3, 2),
        (jnp.bfloat16, 128, 2, 1),
    ],
)
def test_head_shapes_and_dtypes(dtype, hd, g, hkv):
    _check(2 * PS, [1, 6, PS + 2, 0], dtype=dtype, hd=hd, g=g, hkv=hkv)


def _groups(tables, starts, lens, max_rows):
    """The kernel's grouping of a decode step's rows (`HotswapAttentionGroups`): per row, its
    group's index and the pages that group shares."""
    import ctypes

    lib = cpu_build.library("paged_attention")
    b, p = tables.shape
    i32 = lambda a: np.ascontiguousarray(a, np.int32)  # noqa: E731
    tables, positions, starts, lens = i32(tables), i32(starts[:, None]), i32(starts), i32(lens)
    group_of, pages_of = np.zeros(b, np.int64), np.zeros(b, np.int64)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    lib.HotswapAttentionGroups(
        *(ctypes.c_int64(x) for x in (b, 1, p, PS)),
        ptr(tables), ptr(positions), ptr(starts), ptr(lens), ctypes.c_int64(max_rows), ptr(group_of), ptr(pages_of),
    )  # fmt: skip
    return group_of, pages_of


def test_the_samples_of_a_prompt_form_one_group_reading_its_pages():
    """8 samples of a 4-page prompt, interleaved with 3 rows that share only its first page, and
    padding: the samples are one group sharing the 4 pages, whatever the strangers' page ids."""
    for seed in range(6):
        shared, _, _ = _step(np.random.default_rng(seed), 4 * PS, [2, 9, 17, 4, 30, 0, 1, PS], [40, 10, 33],
                             hkv=1, g=1, hd=8, pad=3)  # fmt: skip
        _, _, _, _, tables, _, starts, lens = shared
        group_of, pages_of = _groups(tables, starts, lens, max_rows=16)
        samples = (
            np.arange(11)[::2].tolist() + np.arange(11)[1::2].tolist()
        )  # rows in _step's interleaved order
        rows = np.argsort(samples)[:8]  # the rows holding samples 0..7
        assert len(set(group_of[rows])) == 1 and (pages_of[rows] == 4).all(), (seed, group_of, pages_of)
        others = [r for r in range(len(group_of)) if r not in rows]
        assert not set(group_of[others]) & set(group_of[rows])
        assert (pages_of[8 + 3 :] == 0).all(), "padding rows stay alone"
    # At most max_rows a group: 8 samples in groups of 3, 3, 2, each sharing the prompt.
    group_of, pages_of = _groups(tables, starts, lens, max_rows=3)
    assert sorted(np.bincount(group_of[rows]).tolist())[-3:] == [2, 3, 3] and (pages_of[rows] == 4).all()
