"""A separate draft checkpoint (speculative_config `{"method": "draft_model", "model": <path>}`):
a smaller model with the target's vocabulary drafts greedily, the target verifies.

The draft has its own params and its own KV buffers (shaped for its layers and heads), but no
allocator of its own: its buffers are indexed by the target's page ids, through the target's
block tables, so a sequence's pages hold both models' KV and the scheduler's pages serve both.
The draft only ever reads and writes positions the sequence holds pages for, and what it writes
never decides a token (the target verifies every draft), so a page shared by a prefix hit or a
fork whose draft KV is stale or absent costs acceptance, never correctness.

It computes KV only for what it drafts, so it lags behind the target: it keeps, per sequence,
how many positions it wrote (`_written`), and each step's first pass catches up on the rest of
the sequence's tokens as one chunk ending at the last token, whose argmax is the first draft
token; single-token passes then draft the rest (as `SelfDraft` does). After the verification
only the accepted prefix of what it wrote is valid: the next step reads that as the smaller of
what it wrote and what the target kept (`Sequence.num_computed`), on the pages it wrote them in.

It has a version of its own (`version`, from 1): `update` swaps its params and bumps it, a
policy update leaves its params and only forgets its KV (the target's cache is emptied too).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from hotswap.checkpoint import gguf_io, hf
from hotswap.engine import lifecycle
from hotswap.engine.pages import PagePool
from hotswap.engine.runner import Runner
from hotswap.engine.scheduler import Plan
from hotswap.engine.self_draft import PENDING
from hotswap.engine.sequence import Sequence
from hotswap.engine.state import EngineState, new_kv_cache
from hotswap.engine_config import EngineConfig
from hotswap.errors import ConfigError, EngineAsleep
from hotswap.model import sharding
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params, abstract_params
from hotswap.programs import kv_sizing
from hotswap.weights import pipeline, place, readers


def read_config(path: str | os.PathLike, dtype: str) -> ModelConfig:
    """A checkpoint's ModelConfig, as `LLM` reads it: a GGUF file's metadata or an HF config."""
    if gguf_io.is_gguf(path):
        return gguf_io.model_config(gguf_io.GGUFFile(path), dtype=dtype)
    return ModelConfig.from_hf(hf.read_hf_config(path), dtype=dtype)


def check_vocab(target: ModelConfig, draft: ModelConfig, where: str) -> None:
    """The draft's tokens are the target's ids: another vocabulary is refused."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"draft model {where} has vocab_size {draft.vocab_size}, the target has "
            f"{target.vocab_size}: a draft must share the target's vocabulary"
        )


class DraftModel:
    def __init__(self, mcfg: ModelConfig, ecfg: EngineConfig):
        where = ecfg.speculative_config.model
        self.cfg = read_config(where, mcfg.dtype)
        check_vocab(mcfg, self.cfg, where)
        window = kv_sizing.window_pages(mcfg, ecfg)
        if window is not None and kv_sizing.window_layers(self.cfg):
            raise ConfigError(
                f"draft model {where} has sliding-window layers and the target's cache gives those "
                "layers a pool of their own (set disable_hybrid_kv_cache_manager, or pick a draft "
                "without sliding windows)"
            )
        # Every layer of the draft's cache has a row per page id of the target's pool (the
        # draft's sliding layers, if any, read the full tables: no window pool of its own).
        self.ecfg = dataclasses.replace(ecfg, disable_hybrid_kv_cache_manager=True)
        # One device: the draft's own buffers, whatever the target's mesh (a small model).
        self.backend, _ = sharding.engine_backend(self.cfg, ecfg.attention, deterministic=ecfg.deterministic)
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self.abstract = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), abstract_params(self.cfg)
        )
        self.params: Params | None = pipeline.stage(where, self.cfg, self.abstract).params
        self.runner = Runner(self.cfg, self.ecfg, self.backend)
        self.pages: tuple | None = self._new_pages()
        self.version = 1
        self.asleep = False  # params on the host, no KV (the target's sleep)
        # seq_id -> (positions [0, end) the draft wrote KV for, the table's pages holding them)
        self._written: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._target_version: int | None = None  # the policy version the written KV was for
        self.ps = ecfg.page_size

    def _new_pages(self) -> tuple:
        return new_kv_cache(self.cfg, self.ecfg, backend=self.backend).pages

    def warmup(self, state: EngineState, rows: int, progress: bool, cache: bool) -> None:
        """Compile every bucket of the draft's steps (catch-up chunks are prefill shapes)."""
        self.runner.warmup(self.params, self.pages, progress, cache)

    # ---- a step's drafts ------------------------------------------------------

    def fill(self, state: EngineState, plan: Plan) -> tuple:
        """Draft the tokens the plan's verifications will check (their drafts hold PENDING).
        A sequence whose catch-up does not fit this step's budget drafts nothing: its row is
        made a plain decode row (the plan is edited in place). Returns the target's pages,
        untouched."""
        rows = [s for s, _ in plan.rows if s.draft and s.draft[0] == PENDING]
        if not rows:
            return state.kv.pages
        self._forget_stale(state)
        want = {s.seq_id: len(s.draft) for s in rows}
        for s in rows:
            s.draft = []
        budget = self.ecfg.max_num_batched_tokens
        chunks, drafting = [], []
        for s in rows:
            start = self._valid(s, state.pool)
            n = min(s.num_computed + 1 - start, budget)
            if n <= 0:
                break
            budget -= n
            chunks.append((s, start, n))
            if start + n == s.num_computed + 1:  # caught up to the last token: it drafts
                drafting.append(s)
        first = self._greedy_chunks(chunks, state.pool)
        for s in drafting:
            s.draft.append(first[s.seq_id])
        k = max((want[s.seq_id] for s in drafting), default=0)
        for j in range(1, k):
            live = [s for s in drafting if j < want[s.seq_id]]
            nth = self._greedy_chunks(
                [(s, s.num_computed + j, 1) for s in live], state.pool
            )  # d_j at last + j
            for s in live:
                s.draft.append(nth[s.seq_id])
        for s, start, n in chunks:  # what each sequence's draft KV now covers
            end = start + n + (len(s.draft) - 1 if s.draft else 0)
            self._written[s.seq_id] = (end, tuple(state.pool.table(s.seq_id)[: -(-end // self.ps)]))
            if s.draft:
                s.draft_versions = _with(s.draft_versions, self.version)
        _undraft(plan, [s for s in rows if not s.draft])
        return state.kv.pages

    def _valid(self, seq: Sequence, pool: PagePool) -> int:
        """Positions of seq whose draft KV is valid: what the draft wrote that the target kept,
        on the pages it wrote them in (a preempted sequence readmitted on other pages starts
        over from its first page that differs)."""
        end, pages = self._written.get(seq.seq_id, (0, ()))
        valid = min(end, seq.num_computed)
        table = pool.table(seq.seq_id)
        for i in range(-(-valid // self.ps)):
            if i >= len(table) or table[i] != pages[i]:
                return i * self.ps
        return valid

    def _forget_stale(self, state: EngineState) -> None:
        """A policy update empties the target's cache: the draft's KV goes with it. Sequences
        that hold no pages (finished, preempted) are forgotten."""
        if state.weights_version != self._target_version:
            self._written.clear()
            self._target_version = state.weights_version
        for sid in [sid for sid in self._written if not state.pool.table(sid)]:
            del self._written[sid]

    def _greedy_chunks(self, chunks: list[tuple[Sequence, int, int]], pool: PagePool) -> dict[int, int]:
        """Run each (seq, start, n): positions [start, start + n) of seq in the draft, the argmax
        at each chunk's end -> {seq_id: token}. Calls as the runner makes them: one ragged call
        (split where the buckets need), else a decode call and packed prefill calls."""
        out = {}
        with _starting(chunks):
            rows = [(s, n) for s, _, n in chunks]
            ones, longer = [r for r in rows if r[1] == 1], [r for r in rows if r[1] > 1]
            for kind, call in self.runner.calls(ones, longer):
                self.pages, tokens = self.runner.greedy(self.params, self.pages, kind, call, pool)
                for (s, _), t in zip(call, tokens, strict=True):
                    out[s.seq_id] = int(t)
        return out

    # ---- lifecycle --------------------------------------------------------------

    def staged(self, source, weights_root: str | os.PathLike | None):
        """Read and check a new draft (outside the engine's lock): its params, placed."""
        path = readers.resolve_path(source, weights_root)
        if path is not None and (path.is_dir() or gguf_io.is_gguf(path)):
            check_vocab(self.cfg, read_config(path, self.cfg.dtype), str(source))
        return pipeline.stage(source, self.cfg, self.abstract, weights_root=weights_root)

    def swap(self, staged: place.StagedParams) -> int:
        """The checked draft replaces the serving one (under the engine's lock): version + 1,
        every sequence's draft KV forgotten (it was the old draft's)."""
        if self.asleep:
            raise EngineAsleep("the draft model is asleep: call wakeup(['weights']) before updating it")
        self.params = staged.params
        self._written.clear()
        self.version += 1
        return self.version

    def sleep(self) -> None:
        """The target's sleep (any level): params to host memory, the KV buffers dropped."""
        if not self.asleep:
            self.params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), self.params)
            self.pages, self.asleep = None, True
        self._written.clear()

    def wakeup(self, tags) -> None:
        """The target's wakeup: "weights" brings the params back, "kv_cache" fresh buffers."""
        tags = lifecycle.wake_tags(tags)
        if "weights" in tags and self.asleep:
            self.params = place.place_params(self.params, self.abstract)
            self.asleep = False
        if "kv_cache" in tags and self.pages is None:
            self.pages = self._new_pages()

    def recover(self) -> None:
        """After a failed step (its buffers may be donated): fresh, empty KV buffers."""
        if self.pages is not None:
            self.pages = self._new_pages()
        self._written.clear()


def _with(versions: list[int], v: int) -> list[int]:
    return versions if versions and versions[-1] == v else [*versions, v]


def _undraft(plan: Plan, seqs: list[Sequence]) -> None:
    """Sequences planned to verify a draft that got none decode one token instead: their row
    leaves the prefill chunks for the decode rows (pages allocated for the draft stay; the
    next step grows into them)."""
    if not seqs:
        return
    ids = {s.seq_id for s in seqs}
    plan.prefill = [(s, n) for s, n in plan.prefill if s.seq_id not in ids]
    plan.decode = plan.decode + seqs


class _starting:
    """Each chunk's sequence reads as if its KV ended at the chunk's start (`Runner` feeds a
    row from `num_computed`; past the last token `Sequence.token_slice` reads the draft so
    far), restored on exit."""

    def __init__(self, chunks: list[tuple[Sequence, int, int]]):
        self.chunks = chunks
        self.saved = [s.num_computed for s, _, _ in chunks]

    def __enter__(self):
        for s, start, _ in self.chunks:
            s.num_computed = start

    def __exit__(self, *exc):
        for (s, _, _), n in zip(self.chunks, self.saved, strict=True):
            s.num_computed = n
