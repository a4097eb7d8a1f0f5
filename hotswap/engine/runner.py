"""The only host->device bridge: scheduled rows in, fixed-shape step inputs out, the step run.

`Runner` packs the scheduler's rows into the bucket shapes of `programs/step.py`, runs the
compiled step on the state's pages and warms every bucket up at start.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import numpy as np

from hotswap.engine import prompt_record, structured
from hotswap.engine.pages import PagePool
from hotswap.engine.scheduler import Plan
from hotswap.engine.sequence import Sequence
from hotswap.engine.state import EngineState
from hotswap.engine_config import EngineConfig
from hotswap.kernels.backend import Backend
from hotswap.model.batch import Batch
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.programs import compile_cache, step_cache
from hotswap.programs.sampler import SamplingArrays, mask_words
from hotswap.programs.step import PREFILL_ROW, Buckets, compile_step, pick, placeholder_inputs, run_step

WARMUP_THREADS = 4  # warm-up compiles at most this many steps at once (memory: one program each)


class Runner:
    def __init__(self, mcfg: ModelConfig, ecfg: EngineConfig, backend: Backend):
        self.mcfg, self.ecfg, self.backend = mcfg, ecfg, backend
        self._flat = backend.flat_pages  # flat page lists (see flat_pages)
        self._cache_only = backend.reads_before_step  # the step's own K/V come separately
        self.buckets = Buckets.for_config(ecfg, backend)
        self.ps = ecfg.page_size
        # (B, C, P) -> the step warm-up compiled or loaded from the step cache (step_cache.py)
        self.steps: dict[tuple[int, int, int], jax.stages.Compiled] = {}

    def _pages_needed(self, start: int, end: int) -> int:
        """Table columns attention reads: the read-then-write impls read keys before the chunk
        (the chunk's own come from the step), the Pallas kernel reads everything up to the end."""
        upto = start if self._cache_only else end
        return -(-upto // self.ps)

    def _slots(self, table, pos):
        """Flat KV slot (page * page_size + offset) of positions `pos` in a sequence's table."""
        return np.asarray(table)[pos // self.ps] * self.ps + pos % self.ps

    @staticmethod
    def _list_pages(bt: Batch, pool: PagePool, reads: list[tuple[int, int]]) -> None:
        """Fill the flat page lists: for each (seq_id, k), the first k pages of its table (and of
        its window table), tagged with the sequence's index in `reads` (its row in a decode
        batch, its segment in a prefill)."""
        at = 0
        for r, (seq_id, k) in enumerate(reads):
            bt.page_ids[at : at + k] = pool.table(seq_id)[:k]
            if pool.window is not None:
                bt.window_page_ids[at : at + k] = pool.window_table(seq_id)[:k]
            bt.page_rows[at : at + k] = r
            bt.page_cols[at : at + k] = np.arange(k)
            at += k

    @staticmethod
    def _mirrored(bt: Batch) -> Batch:
        """Without a window pool the sliding layers read the full layers' pages: their tables,
        slots and page list are the same arrays (copied once here, not built row by row)."""
        np.copyto(bt.window_block_tables, bt.block_tables)
        np.copyto(bt.window_slots, bt.slots)
        np.copyto(bt.window_page_ids, bt.page_ids)
        return bt

    def pack(self, rows: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
        """Split prefill chunks (for a ragged backend, every row of the step) into calls that
        fit the largest bucket: packed-prefill rows, or a ragged step's tokens, and for the
        reference attention, cached pages listed."""
        calls, cur, used, listed = [], [], 0, 0
        ragged = self.buckets.ragged
        cap = self.buckets.batch[-1] if ragged else self.buckets.blocks[-1]
        page_cap = self.buckets.prefill_pages[-1]
        for seq, n in rows:
            need = n if ragged else -(-n // PREFILL_ROW)
            pages = self._pages_needed(seq.num_computed, seq.num_computed + n)
            if cur and (used + need > cap or (self._flat and listed + pages > page_cap)):
                calls.append(cur)
                cur, used, listed = [], 0, 0
            cur.append((seq, n))
            used += need
            listed += pages
        return calls + [cur] if cur else calls

    def decode_batch(self, seqs: list[Sequence], pool: PagePool) -> Batch:
        """[B, 1]: one new token per sequence."""
        n = len(seqs)
        seq_tables = [pool.table(s.seq_id) for s in seqs]
        twins = pool.window is not None
        window_tables = [pool.window_table(s.seq_id) for s in seqs] if twins else seq_tables
        b = pick(self.buckets.batch, n)
        start = np.array([s.num_computed for s in seqs], np.int32)
        need = [self._pages_needed(int(x), int(x) + 1) for x in start]
        if self._flat:
            # P is the *average* pages per row: the flat list holds b * P pages.
            p = pick(self.buckets.pages, -(-sum(need) // b))
            bt = Batch.zeros(b, 1, 0, b, n=b * p)
            self._list_pages(bt, pool, [(s.seq_id, k) for s, k in zip(seqs, need, strict=True)])
        else:
            p = pick(self.buckets.pages, max(need))
            bt = Batch.zeros(b, 1, p, b)
            for i, k in enumerate(need):
                bt.block_tables[i, :k] = seq_tables[i][:k]
                if twins:
                    bt.window_block_tables[i, :k] = window_tables[i][:k]
        for i, s in enumerate(seqs):
            bt.tokens[i, 0] = s.token_slice(int(start[i]), 1)[0]
            bt.slots[i, 0] = self._slots(seq_tables[i], start[i])
            if twins:
                bt.window_slots[i, 0] = self._slots(window_tables[i], start[i])
        bt.positions[:n, 0] = start
        bt.kv_lens[:n] = start + 1
        bt.chunk_starts[:n] = start
        bt.segments[:n] = np.arange(n)
        bt.sample_idx[:] = np.arange(b)
        bt.adapters[:n] = [s.lora_slot for s in seqs]
        return bt if pool.window is not None else self._mirrored(bt)

    def ragged_batch(self, rows: list[tuple[Sequence, int]], pool: PagePool) -> Batch:
        """[T, 1]: every row's tokens end to end, one token per batch row, decode rows being
        chunks of one token (a ragged backend's step: `Backend.ragged_steps`)."""
        return self._chunks(rows, pool, 1, self.buckets.batch)

    def prefill_batch(self, rows: list[tuple[Sequence, int]], pool: PagePool) -> Batch:
        """[Nb, PREFILL_ROW]: each chunk laid out from a fresh row, padded to whole rows."""
        return self._chunks(rows, pool, PREFILL_ROW, self.buckets.blocks)

    def _chunks(self, rows: list[tuple[Sequence, int]], pool: PagePool, q: int, row_buckets) -> Batch:
        """[Nb, q]: each chunk laid out from a fresh row of q tokens, padded to whole rows;
        Nb from `row_buckets`."""
        need = [-(-n // q) for _, n in rows]
        nb = pick(row_buckets, sum(need))
        samples = self.buckets.samples(nb, q)
        cached = [self._pages_needed(s.num_computed, s.num_computed + n) for s, n in rows]
        if self._flat:  # every sequence's cached pages once, end to end
            p = pick(self.buckets.prefill_pages, sum(cached))
            bt = Batch.zeros(nb, q, 0, samples, n=p)
            self._list_pages(bt, pool, [(seq.seq_id, k) for (seq, _), k in zip(rows, cached, strict=True)])
        else:
            p = pick(self.buckets.prefill_pages, max(cached))
            bt = Batch.zeros(nb, q, p, samples)
        tokens, positions, slots = bt.tokens.reshape(-1), bt.positions.reshape(-1), bt.slots.reshape(-1)
        window_slots = bt.window_slots.reshape(-1)
        row = slot = 0
        for r, ((seq, n), k) in enumerate(zip(rows, need, strict=True)):
            start, base = seq.num_computed, row * q
            table = pool.table(seq.seq_id)
            window_table = pool.window_table(seq.seq_id) if pool.window is not None else None
            pos = np.arange(start, start + n)
            tokens[base : base + n] = seq.token_slice(start, n)
            positions[base : base + k * q] = np.arange(start, start + k * q)  # padding continues the run
            slots[base : base + n] = self._slots(table, pos)
            if window_table is not None:
                window_slots[base : base + n] = self._slots(window_table, pos)
            cols = min(len(table), bt.block_tables.shape[1])
            bt.block_tables[row : row + k, :cols] = table[:cols]
            if window_table is not None:
                bt.window_block_tables[row : row + k, :cols] = window_table[:cols]
            bt.kv_lens[row : row + k] = start + n
            bt.chunk_starts[row : row + k] = start
            bt.segments[row : row + k] = r
            bt.adapters[row : row + k] = seq.lora_slot
            # its last position, or every position a verification feeds (Sequence.samples)
            m = seq.samples(n)
            bt.sample_idx[slot : slot + m] = np.arange(base + n - m, base + n)
            slot += m
            if prompt_record.asks(seq):
                bt.prompt_targets.reshape(-1)[base : base + n] = prompt_record.targets(seq, start, n)
                bt.prompt_top.reshape(-1)[base : base + n] = seq.params.prompt_logprobs > 0
            row += k
        return bt if pool.window is not None else self._mirrored(bt)

    def _masks(self, rows: list[tuple[Sequence, int]], s: int) -> np.ndarray | None:
        """The packed token masks of the constrained rows that sample a token in this call (a
        prompt chunk short of its end samples nothing), at each row's sampled row; None when
        no row is constrained (a constrained row never verifies a draft: one sampled row)."""
        if not any(q.matcher is not None for q, _ in rows):
            return None
        mask = np.zeros((s, mask_words(self.mcfg.vocab_size)), np.int32)
        at = np.cumsum([0] + [q.samples(n) for q, n in rows[:-1]])
        sampling = [
            (q.matcher, int(j))
            for (q, n), j in zip(rows, at, strict=True)
            if q.matcher is not None and q.num_computed + n >= q.total_len
        ]
        structured.fill_masks(sampling, mask)
        return mask

    def _call(
        self, params: Params, pages, rows: list[tuple[Sequence, int]], pool: PagePool, kind: str, kept: bool
    ):
        """One jitted call for `rows`: a decode batch, prefill chunks packed together, or (ragged)
        both in one [T, 1] block."""
        batch = self._batch(kind, rows, pool)
        s = batch.sample_idx.shape[0]
        # a verification's rows sample the output positions after the last token, in turn
        sa = SamplingArrays.from_rows(
            [(q.params, q.seed, len(q.output_ids) + j) for q, n in rows for j in range(q.samples(n))],
            s,
            self.mcfg.vocab_size,
            self._masks(rows, s),
            self.ecfg.logprobs_mode,
        )
        step = self.steps.get((*batch.tokens.shape, batch.block_tables.shape[1]))
        pages, out, prompt = run_step(
            params, pages, batch, sa, cfg=self.mcfg, backend=self.backend, compiled=step
        )
        self._record_prompt(rows, batch, prompt)
        n_rows, n_samples = len(rows), sum(q.samples(n) for q, n in rows)
        # One host copy per call; the kept sets' [S, V/32] bitmasks only when a row of the step asked.
        sampled = out[0] if kept else dataclasses.replace(out[0], kept_mask=np.zeros((s, 0), np.int32))
        host = jax.device_get((sampled, *out[1:]))
        sampled = jax.tree.map(lambda a: a[:n_samples], host[0])
        if len(host) == 1:
            return pages, (sampled, [None] * n_rows)
        # a MoE model's routing [B*C, moe layers, k]: each row's tokens, where the batch laid them
        q = batch.tokens.shape[1]
        starts = np.cumsum([0] + [-(-n // q) * q for _, n in rows[:-1]])  # each row from a fresh row of q
        return pages, (sampled, [host[1][b : b + n] for b, (_, n) in zip(starts, rows, strict=True)])

    def calls(
        self, decode: list[tuple[Sequence, int]], prefill: list[tuple[Sequence, int]]
    ) -> list[tuple[str, list[tuple[Sequence, int]]]]:
        """The calls a step's rows take, (kind, rows): on a ragged backend one [T, 1] block of
        every row (split where the buckets need); else one decode batch of the one-token rows
        `decode` and packed prefills of the chunks `prefill`."""
        if self.buckets.ragged:
            return [("ragged", rows) for rows in self.pack(decode + prefill)]
        calls = [("decode", decode)] if decode else []
        return calls + [("prefill", rows) for rows in self.pack(prefill)]

    def _batch(self, kind: str, rows: list[tuple[Sequence, int]], pool: PagePool) -> Batch:
        if kind == "ragged":
            return self.ragged_batch(rows, pool)
        if kind == "decode":
            return self.decode_batch([s for s, _ in rows], pool)
        return self.prefill_batch(rows, pool)

    def greedy(self, params: Params, pages, kind: str, rows: list[tuple[Sequence, int]], pool: PagePool):
        """One call of `rows` (a kind from `calls`) drawing each row's argmax at its chunk's
        end, what a draft model's step is: (new pages, the tokens [len(rows)])."""
        batch = self._batch(kind, rows, pool)
        sa = SamplingArrays.from_rows([], batch.sample_idx.shape[0], self.mcfg.vocab_size)  # all greedy
        step = self.steps.get((*batch.tokens.shape, batch.block_tables.shape[1]))
        pages, out, _ = run_step(params, pages, batch, sa, cfg=self.mcfg, backend=self.backend, compiled=step)
        return pages, np.asarray(jax.device_get(out[0].tokens))[: len(rows)]

    @staticmethod
    def _record_prompt(rows: list[tuple[Sequence, int]], batch: Batch, prompt) -> None:
        """Hand each row that asked for prompt log-probs its chunk's (copied to the host only when
        some row asked): its positions start where `_chunks` laid the row, at a fresh row of C."""
        if not (batch.prompt_targets >= 0).any():
            return
        lp, rank, top_ids, top_lps = jax.device_get(prompt)
        q, base = batch.tokens.shape[1], 0
        for seq, n in rows:
            if prompt_record.asks(seq):
                at = slice(base, base + n)
                seq.record_prompt(seq.num_computed, lp[at], rank[at], top_ids[at], top_lps[at])
            base += -(-n // q) * q

    def run(self, state: EngineState, plan: Plan):
        """Run a plan on the state's params and pages: one call for the decode batch, one for
        every prefill chunk packed together; on a ragged backend, one call for both (decode
        rows ride in the prefill's matmuls instead of streaming the weights again). Returns
        the new page buffers (the old ones are donated) and the sampled rows in `plan.rows`
        order (`StepOutput`: a host `Sampled`, and each row's routed experts (a MoE model) or
        None; the kept bitmasks [rows, 0] unless a row of the plan asked for its kept set)."""
        pages = state.kv.pages
        calls = self.calls([(s, 1) for s in plan.decode], plan.prefill)
        kept = any(s.params.return_kept_set for s, _ in plan.rows)
        outs = []
        for kind, rows in calls:
            pages, out = self._call(state.step_params, pages, rows, state.pool, kind, kept)
            outs.append(out)
        sampled, routed = zip(*outs, strict=True)
        routed = [r for rows in routed for r in rows]  # per row: [n, moe layers, k] or None
        return pages, (jax.tree.map(lambda *a: np.concatenate(a), *sampled), routed)

    def warmup(
        self,
        params: Params,
        pages,
        progress: bool = True,
        cache: bool = False,
        *,
        decode_upto: int | None = None,
    ) -> None:
        """Compile every bucket now, so serving never compiles.

        With `cache` (a persistent compilation cache is on), a bucket's step is first looked
        up in the step cache (`step_cache.py`: no tracing, no lowering), then in JAX's
        persistent cache (`compile_cache.py`); a step found in either is loaded, not
        compiled, and one compiled here is stored in both. The bar shows the counts, and
        `warmup_counts` keeps them (`in_memory`: this process had compiled it already).

        The first bucket is prepared alone (tracing it registers the C++ kernels, once); the
        rest on up to `WARMUP_THREADS` threads: XLA compiles each program mostly on one core,
        so compiling several at once keeps every core busy."""
        from tqdm.auto import tqdm

        shapes = self.buckets.shapes()
        if decode_upto is not None:  # a draft model's: its decode steps of at most this many rows
            shapes = [x for x in shapes if x[1] == 1 and x[0] <= pick(self.buckets.batch, decode_upto)]
        bar = tqdm(total=len(shapes), desc="hotswap: compiling steps", disable=not progress, leave=False)
        counts = {"compiled": 0, "from_cache": 0, "in_memory": 0}
        threads = max(1, min(WARMUP_THREADS, os.cpu_count() or 1, len(shapes) - 1))
        with compile_cache.CompileCounter() as counter, ThreadPoolExecutor(threads) as pool:
            prepare = partial(self._prepare, params, pages, counter=counter, cache=cache)
            first = [prepare(shape) for shape in shapes[:1]]  # before any other thread starts
            ready = itertools.chain(first, pool.map(prepare, shapes[1:]))
            for shape, step, kind in ready:
                if step is not None:
                    self.steps[shape] = step  # fused steps only: their tables are [B, P]
                counts[kind] += 1
                doing = "loading cached steps" if kind == "from_cache" else "compiling steps"
                bar.set_description(f"hotswap: {doing}", refresh=False)
                bar.set_postfix_str(compile_cache.describe(counts), refresh=False)
                bar.update()
        bar.close()
        # The bar redraws at most every 0.1 s and is erased on close, so the final
        # counts are printed once, whole: what a reader (and a test) can rely on.
        if progress:
            print(f"hotswap: {len(shapes)} steps ready ({compile_cache.describe(counts)})", file=sys.stderr)
        self.warmup_counts = counts

    def _prepare(self, params: Params, pages, shape: tuple[int, int, int], *, counter, cache: bool):
        """One bucket's step, loaded or compiled: (shape, the step to keep or None, how it came).
        `counter` is warm-up's `CompileCounter`; its counts for this thread tell how it came."""
        b, c, p = shape
        backend = self.backend
        args = (
            params,
            pages,
            *placeholder_inputs(
                b, c, p, backend, self.buckets.samples(b, c), vocab_size=self.mcfg.vocab_size
            ),
        )
        keep = step_cache.eligible(args, backend)
        step = step_cache.load(args, cfg=self.mcfg, backend=backend) if cache and keep else None
        if step is not None:
            return shape, step, "from_cache"
        before = counter.mine()
        step = compile_step(*args, cfg=self.mcfg, backend=backend)
        programs, loaded = (now - then for now, then in zip(counter.mine(), before, strict=True))
        kind = "compiled" if programs > loaded else "from_cache" if loaded else "in_memory"
        if cache and keep and kind == "compiled" and step is not None:
            step_cache.store(step, args, cfg=self.mcfg, backend=backend)
        return shape, (step if keep else None), kind
