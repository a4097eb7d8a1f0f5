"""The jitted step and the only host->device bridge.

One jitted function serves both step kinds: a [B, C] block of tokens where a
decode batch is [B, 1] and a prefill chunk is [1, C]. B, C and the number of
block-table columns P are padded to the buckets listed here, all compiled at
start-up, so steady-state serving never recompiles. KV page buffers are donated
so XLA updates them in place; params are an argument, so a swap to params of
the same shapes, dtypes and shardings reuses every executable.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from hotswap.config import EngineConfig, ModelConfig
from hotswap.engine import model
from hotswap.engine.params import Params
from hotswap.engine.sampling import SamplingArrays, sample
from hotswap.engine.sequence import Sequence


def _pow2_upto(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    return out + [hi]


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Every shape the step is compiled for."""

    batch: tuple[int, ...]  # decode rows B
    chunk: tuple[int, ...]  # prefill chunk C
    pages: tuple[int, ...]  # block-table columns P

    @staticmethod
    def for_config(ecfg: EngineConfig) -> Buckets:
        pps = ecfg.pages_per_seq
        return Buckets(
            batch=tuple(_pow2_upto(1, ecfg.max_num_seqs)),
            chunk=tuple(_pow2_upto(min(16, ecfg.max_num_batched_tokens), ecfg.max_num_batched_tokens)),
            pages=tuple(_pow2_upto(min(8, pps), pps)),
        )

    def shapes(self) -> list[tuple[int, int, int]]:
        """(B, C, P) for every compiled step."""
        # Prefill chunks always see the full table: a chunk's own compute dominates,
        # and it keeps start-up compiles to one per chunk size.
        return [(b, 1, p) for b in self.batch for p in self.pages] + [
            (1, c, self.pages[-1]) for c in self.chunk
        ]


def pick(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _step(params, pages, tokens, positions, block_tables, kv_lens, sample_idx, sa, *, cfg, impl):
    h, new_kv, pages = model.forward_paged(
        params, pages, tokens, positions, block_tables, kv_lens, cfg=cfg, impl=impl
    )
    h_last = jnp.take_along_axis(h, sample_idx[:, None, None], axis=1)[:, 0]  # [B, D]
    with jax.named_scope("sample"):
        out = sample(model.logits_from_hidden(params, h_last), sa)
    return (new_kv if impl == "reference" else pages), out


# reference: read-only forward, then a separate in-place write of the step's K/V.
forward_jit = partial(jax.jit, static_argnames=("cfg", "impl"))(_step)
write_jit = jax.jit(model.write_pages, donate_argnums=(0,))
# kernels: write and read inside one program, pages donated.
fused_jit = partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnums=(1,))(_step)


def run_step(params, pages, tokens, positions, block_tables, kv_lens, sample_idx, sa, *, cfg, impl):
    """One step on device: returns (new pages, (tokens, logprobs, top_ids, top_lps))."""
    if impl == "reference":
        new_kv, out = forward_jit(
            params, pages, tokens, positions, block_tables, kv_lens, sample_idx, sa, cfg=cfg, impl=impl
        )
        return write_jit(pages, new_kv, block_tables, positions, kv_lens), out
    return fused_jit(
        params, pages, tokens, positions, block_tables, kv_lens, sample_idx, sa, cfg=cfg, impl=impl
    )


def placeholder_inputs(b: int, c: int, p: int) -> tuple:
    """Zero-filled step inputs of bucket shape (B, C, P): what warm-up compiles against.

    Returns (tokens, positions, block_tables, kv_lens, sample_idx, sampling arrays); kv_lens
    of 0 make every row padding, so a placeholder step writes nothing real.
    """
    z = np.zeros
    arrays = (z((b, c), np.int32), z((b, c), np.int32), z((b, p), np.int32), z(b, np.int32), z(b, np.int32))
    return (*arrays, SamplingArrays.from_rows([], b))


class Runner:
    def __init__(self, mcfg: ModelConfig, ecfg: EngineConfig):
        self.mcfg, self.ecfg = mcfg, ecfg
        self.buckets = Buckets.for_config(ecfg)
        self.ps = ecfg.page_size

    def prepare_inputs(self, rows: list[tuple[Sequence, int]], b: int, c: int, p: int):
        """Host numpy -> fixed-shape int32 arrays: the one place engine state meets the device."""
        tokens = np.zeros((b, c), np.int32)
        positions = np.zeros((b, c), np.int32)
        tables = np.zeros((b, p), np.int32)
        kv_lens = np.zeros(b, np.int32)
        sample_idx = np.zeros(b, np.int32)
        for i, (seq, n) in enumerate(rows):
            start = seq.num_computed
            ids = seq.token_slice(start, n)
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_table, np.int32)
            tokens[i, :n] = ids
            positions[i, :n] = pos  # padding continues the run; kv_lens marks it as unreal
            positions[i, n:] = np.arange(start + n, start + c)
            tables[i, : len(table)] = table
            kv_lens[i] = start + n
            sample_idx[i] = n - 1
        return tokens, positions, tables, kv_lens, sample_idx

    def run(self, params: Params, pages, rows: list[tuple[Sequence, int]], decode: bool):
        """One jitted call for `rows` (a decode batch, or a single prefill chunk)."""
        n_rows = len(rows)
        b = pick(self.buckets.batch, n_rows) if decode else 1
        c = 1 if decode else pick(self.buckets.chunk, rows[0][1])
        p = (
            pick(self.buckets.pages, max(len(s.block_table) for s, _ in rows))
            if decode
            else self.buckets.pages[-1]
        )
        arrays = self.prepare_inputs(rows, b, c, p)
        sa = SamplingArrays.from_rows([(s.params, s.seed, len(s.output_ids)) for s, _ in rows], b)
        pages, out = run_step(params, pages, *arrays, sa, cfg=self.mcfg, impl=self.ecfg.attention)
        tok, lp, ti, tl = jax.device_get(out)  # one host copy per call
        return pages, (tok[:n_rows], lp[:n_rows], ti[:n_rows], tl[:n_rows])

    def warmup(self, params: Params, pages, progress: bool = True):
        """Compile every bucket now, so serving never compiles (returns the pages back)."""
        from tqdm.auto import tqdm

        shapes = self.buckets.shapes()
        it = tqdm(shapes, desc="hotswap: compiling steps", disable=not progress, leave=False)
        for b, c, p in it:
            pages, _ = run_step(
                params, pages, *placeholder_inputs(b, c, p), cfg=self.mcfg, impl=self.ecfg.attention
            )
        jax.block_until_ready(pages)
        return pages
