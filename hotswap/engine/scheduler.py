"""Continuous batching on the host: admission, chunked prefill, paging, preemption.

Plain Python and numpy, never inside jit. Each `schedule()` picks, within the
token budget (`max_num_batched_tokens`), one decode token for every running
sequence plus prefill chunks for sequences still reading their prompt, and
admits waiting sequences while pages and `max_num_seqs` allow. When pages run
out, the youngest running sequence is preempted by recompute: its pages are
released and it goes back to the front of the queue with its tokens so far,
so no request is ever dropped.
"""

from __future__ import annotations

import collections
import dataclasses

from hotswap.config import EngineConfig
from hotswap.engine.pages import PagePool, page_key
from hotswap.engine.sequence import Sequence, Status
from hotswap.engine.state import PrefixIndex


@dataclasses.dataclass
class Plan:
    """One step's work: decode rows (one token each) and prefill chunks (seq, num_tokens)."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


class Scheduler:
    def __init__(self, ecfg: EngineConfig):
        self.cfg = ecfg
        self.ps = ecfg.page_size
        self.pool = PagePool(ecfg.num_pages)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.hold_admission = False  # set while an update drains
        self.num_preemptions = 0

    # ---- queue -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def owners(self) -> dict[int, int]:
        count: dict[int, int] = collections.Counter()
        for s in self.running:
            for p in s.block_table:
                count[p] += 1
        return dict(count)

    # ---- paging --------------------------------------------------------------

    def _grow(self, seq: Sequence, upto: int, prefix: PrefixIndex) -> tuple[bool, PrefixIndex]:
        """Ensure seq has pages for tokens [0, upto). False (nothing half-done kept) if out of pages."""
        need = -(-upto // self.ps) - len(seq.block_table)
        if need <= 0:
            return True, prefix
        if self.pool.num_free(prefix) < need:
            return False, prefix
        for _ in range(need):
            page, prefix = self.pool.allocate(prefix)
            seq.block_table.append(page)
        return True, prefix

    def release(self, seq: Sequence, prefix: PrefixIndex) -> None:
        self.pool.release(seq.block_table, prefix)
        seq.block_table = []
        seq.page_keys = []

    def preempt(self, seq: Sequence, prefix: PrefixIndex) -> None:
        """Recompute later: drop KV, keep tokens, back to the front of the queue."""
        self.release(seq, prefix)
        seq.num_computed = 0
        seq.mixed_kv = False  # its KV will be rebuilt under the current weights
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _match_prefix(self, seq: Sequence, prefix: PrefixIndex, version: int) -> PrefixIndex:
        """Share cached full pages of seq's tokens (current version only); keep >= 1 token to compute."""
        ids = seq.all_ids
        max_pages = (len(ids) - 1) // self.ps
        parent = seq.fork_parent
        if parent is not None and not parent.is_finished and parent.num_computed >= len(seq.prompt_ids):
            # n > 1: share the parent's full prompt pages directly (works without prefix caching).
            shared = parent.block_table[: min(max_pages, len(seq.prompt_ids) // self.ps)]
            for page in shared:
                self.pool.share(page)
            seq.block_table = list(shared)
            seq.page_keys = []
            seq.num_computed = len(shared) * self.ps
        if not self.cfg.enable_prefix_caching:
            return prefix
        key = seq.page_keys[-1] if seq.page_keys else 0
        hits = []
        for i in range(len(seq.page_keys), max_pages):
            key = page_key(key, ids[i * self.ps : (i + 1) * self.ps], version)
            page = prefix.find(key, version)
            if page == 0 or i < len(seq.block_table):
                break
            hits.append((page, key))
        for page, key in hits:
            self.pool.share(page)
            seq.block_table.append(page)
            seq.page_keys.append(key)
        if hits:
            prefix = prefix.touch([p for p, _ in hits], self._tick())
        seq.num_computed = len(seq.block_table) * self.ps
        return prefix

    def _prompt_keys(self, seq: Sequence, version: int) -> list[int]:
        """Chain keys of seq's full prompt pages under `version` (computed once per version)."""
        if seq.prompt_keys is None or seq.prompt_keys[0] != version:
            keys, key = [], 0
            for i in range(len(seq.prompt_ids) // self.ps):
                key = page_key(key, seq.prompt_ids[i * self.ps : (i + 1) * self.ps], version)
                keys.append(key)
            seq.prompt_keys = (version, keys)
        return seq.prompt_keys[1]

    def _pending_keys(self, version: int) -> set[int]:
        """Prompt pages that running sequences are still computing."""
        pending: set[int] = set()
        for s in self.running:
            if s.in_prefill and not s.mixed_kv:
                pending.update(self._prompt_keys(s, version)[s.num_computed // self.ps :])
        return pending

    def _waits_for_prefix(self, seq: Sequence, prefix: PrefixIndex, version: int, pending: set[int]) -> bool:
        """True if seq's first uncached prompt page is being computed by another sequence right
        now: admitting it next step turns that page into a prefix hit instead of a recompute."""
        keys = self._prompt_keys(seq, version)[: (seq.total_len - 1) // self.ps]
        missing = next((k for k in keys if prefix.find(k, version) == 0), None)
        return missing is not None and missing in pending

    def _tick(self) -> int:
        self.pool.tick += 1
        return self.pool.tick

    def register_full_pages(self, seq: Sequence, prefix: PrefixIndex, version: int) -> PrefixIndex:
        """Index every page of seq that is now full (prompt or generated tokens)."""
        if not self.cfg.enable_prefix_caching or seq.mixed_kv:
            return prefix
        full = min(seq.num_computed // self.ps, len(seq.block_table))
        while len(seq.page_keys) < full:  # rarely true: once per page_size tokens
            i = len(seq.page_keys)
            parent = seq.page_keys[-1] if seq.page_keys else 0
            key = page_key(parent, seq.token_slice(i * self.ps, self.ps), version)
            page = seq.block_table[i]
            if prefix.key[page] == 0 and prefix.find(key, version) == 0:
                prefix = prefix.insert(page, key, version, self._tick())
            seq.page_keys.append(key)
        return prefix

    # ---- the schedule ----------------------------------------------------------

    def schedule(self, prefix: PrefixIndex, version: int) -> tuple[Plan, PrefixIndex]:
        budget = self.cfg.max_num_batched_tokens
        plan = Plan(decode=[], prefill=[])

        # 1. Running sequences, oldest first; preempt the youngest when pages run out.
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not Status.RUNNING or budget <= 0:
                continue
            n = 1 if not seq.in_prefill else min(seq.total_len - seq.num_computed, budget)
            while True:
                ok, prefix = self._grow(seq, seq.num_computed + n, prefix)
                if ok:
                    break
                victim = max(self.running, key=lambda s: s.arrival)
                self.preempt(victim, prefix)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            budget -= n
            if seq.in_prefill:
                plan.prefill.append((seq, n))
            else:
                plan.decode.append(seq)
        # A preempted victim may already have been planned: drop it from the plan.
        plan.decode = [s for s in plan.decode if s.status is Status.RUNNING]
        plan.prefill = [(s, n) for s, n in plan.prefill if s.status is Status.RUNNING]

        # 2. Admit waiting sequences, in order, while the budget, max_num_seqs and pages allow.
        caching = self.cfg.enable_prefix_caching
        pending = self._pending_keys(version) if caching and self.waiting else set()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            if self.hold_admission and not seq.admitted_once:
                continue  # an update is draining: only already-started (preempted) work may run
            if seq.fork_parent is not None and self._parent_pending(seq):
                continue  # n > 1: wait for the parent's prompt so its pages can be shared
            if pending and self._waits_for_prefix(seq, prefix, version, pending):
                continue  # a shared prefix is being computed this step: hit it next step
            prefix = self._match_prefix(seq, prefix, version)
            if not seq.admitted_once:
                seq.num_cached_tokens = seq.num_computed
                seq.admitted_once = True
            n = min(seq.total_len - seq.num_computed, budget)
            ok, prefix = self._grow(seq, seq.num_computed + n, prefix)
            if not ok:  # out of pages: stop here, so admission stays first-come first-served
                self.release(seq, prefix)
                seq.num_computed = 0
                break
            self.waiting.remove(seq)
            if caching and not seq.mixed_kv:
                pending.update(self._prompt_keys(seq, version)[seq.num_computed // self.ps :])
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget -= n
            if seq.total_len - seq.num_computed > 1 or n > 1:
                plan.prefill.append((seq, n))
            else:
                plan.decode.append(seq)
        return plan, prefix

    def _parent_pending(self, seq: Sequence) -> bool:
        p = seq.fork_parent
        return p is not None and not p.is_finished and p.num_computed < len(p.prompt_ids)

    def finish(self, seq: Sequence, reason: str, prefix: PrefixIndex) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.release(seq, prefix)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
