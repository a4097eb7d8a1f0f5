"""Continuous batching on the host: `schedule(state) -> plan`, `postprocess(state, plan, out)`.

Plain Python and numpy, never inside jit. Each `schedule()` picks, within the
token budget (`max_num_batched_tokens`), one decode token for every running
sequence plus prefill chunks for sequences still reading their prompt, and
admits waiting sequences while pages and `max_num_seqs` allow. When pages run
out, the youngest running sequence is preempted by recompute: its pages are
released and it goes back to the front of the queue with its tokens so far,
so no request is ever dropped.

Which pages a sequence holds lives in the state (`state.pool`), not here: both
passes take an `EngineState` and return the next one, so page-version stamping,
prefix registration and page release happen in exactly one place. The
scheduler keeps the request queues (host bookkeeping of tokens and status).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from hotswap.engine import prompt_record
from hotswap.engine.outputs import finish_reason
from hotswap.engine.pages import PagePool
from hotswap.engine.prefix import PrefixIndex, page_key
from hotswap.engine.sequence import Sequence, Status
from hotswap.engine.state import EngineState, KVCache
from hotswap.engine_config import EngineConfig
from hotswap.programs.sampler import Sampled
from hotswap.speculative import verified_per_step

# the sampled rows (a `Sampled` of host arrays), and per row its tokens' routed experts (None:
# dense model)
StepOutput = tuple[Sampled, list]


@dataclasses.dataclass
class Plan:
    """One step's work: decode rows (one token each) and prefill chunks (seq, num_tokens)."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def rows(self) -> list[tuple[Sequence, int]]:
        """Every row in the order the runner's outputs come back: decode first, then prefill."""
        return [(s, 1) for s in self.decode] + self.prefill


@dataclasses.dataclass
class _Work:
    """One pass's working copy of the page state: an edited pool and the latest prefix index."""

    pool: PagePool
    prefix: PrefixIndex
    version: int

    @staticmethod
    def of(state: EngineState) -> _Work:
        return _Work(state.pool.edit(), state.prefix, state.weights_version)

    def into(self, state: EngineState) -> EngineState:
        return dataclasses.replace(state, pool=self.pool, prefix=self.prefix)


# A draft for a sequence: (sequence, at most this many tokens) -> the tokens (engine/speculation.py)
Propose = Callable[[Sequence, int], list[int]]


class Scheduler:
    def __init__(
        self, ecfg: EngineConfig, fill: Callable[[int], int] | None = None, propose: Propose | None = None
    ):
        """`fill(n)`: how many of a step's n ready tokens to run, so that the step lands on a
        compiled size (`step.Buckets.fill`); None runs them all. `propose`: speculative
        decoding's drafts (None: no speculation)."""
        self.cfg = ecfg
        self.fill = fill or (lambda n: n)
        self.propose = propose
        self.drafts_per_step = verified_per_step(ecfg.speculative_config, ecfg.max_num_seqs)
        # speculative decoding over the engine's life: drafts verified, their tokens, accepted ones
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.ps = ecfg.page_size
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.holds = 0  # drains holding new requests back (Admission.holding)
        self.num_preemptions = 0
        self.num_generated = 0

    @property
    def hold_admission(self) -> bool:
        """An update or a pause is draining: only sequences that already started may run."""
        return self.holds > 0

    # ---- queue -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def started(self) -> list[Sequence]:
        """Sequences that have run: running ones and preempted ones waiting to resume."""
        return list(self.running) + [s for s in self.waiting if s.admitted_once]

    def check(self, state: EngineState) -> None:
        """Invariant: the pool's refcounts match its tables, and only running sequences hold pages."""
        state.pool.check(state.prefix)
        running = {s.seq_id for s in self.running}
        holders = {s for s, t in state.pool.tables.items() if t}
        assert holders <= running, f"sequences {sorted(holders - running)} hold pages but are not running"

    # ---- paging (on a pass's working copy) ------------------------------------

    def _grow(self, w: _Work, seq: Sequence, upto: int) -> bool:
        """Ensure seq has pages for tokens [0, upto). False (nothing half-done kept) if out of pages."""
        need = -(-upto // self.ps) - len(w.pool.table(seq.seq_id))
        ok, w.prefix = w.pool.allocate(seq.seq_id, need, w.prefix)
        return ok

    def _preempt(self, w: _Work, seq: Sequence) -> None:
        """Recompute later: drop KV, keep tokens, back to the front of the queue."""
        w.pool.release(seq.seq_id)
        seq.num_computed = 0
        seq.draft = []
        seq.mixed_kv = False  # its KV will be rebuilt under the current weights
        seq.kv_version = None
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _match_prefix(self, w: _Work, seq: Sequence) -> None:
        """Share cached full pages of seq's tokens (current version only); keep >= 1 token to compute.
        A share is cut back to where the sliding-window layers' twins are all there (`window_holds`)."""
        ids, sid = seq.all_ids, seq.seq_id
        max_pages = (len(ids) - 1) // self.ps
        parent = seq.fork_parent
        pages, keys = [], []
        if parent is not None and not parent.is_finished and parent.num_computed >= len(seq.prompt_ids):
            # n > 1: share the parent's full prompt pages directly (works without prefix caching).
            pages = list(w.pool.table(parent.seq_id)[: min(max_pages, len(seq.prompt_ids) // self.ps)])
        elif self.cfg.enable_prefix_caching and not prompt_record.asks(seq):
            # (a request asking for prompt log-probs recomputes its prompt: a cached page holds
            # no log-probs)
            key = 0
            for i in range(max_pages):
                key = page_key(key, ids[i * self.ps : (i + 1) * self.ps], w.version, seq.adapter)
                page = w.prefix.find(key, w.version, seq.adapter)
                if page == 0:
                    break
                pages.append(page)
                keys.append(key)
        n = len(pages)
        while n and not w.pool.window_holds(pages, n):
            n -= 1
        w.pool.share(sid, pages[:n])
        if keys[:n]:
            w.pool.add_keys(sid, keys[:n])
            w.prefix = w.prefix.touch(pages[:n], w.pool.next_tick())
        if n:
            if parent is not None and parent.routed is not None and not keys:
                seq.record_routing(0, parent.routed[: n * self.ps])
            elif (
                w.prefix.routing is not None and keys
            ):  # a MoE model: the routing the pages were written with
                for i, page in enumerate(pages[:n]):
                    seq.record_routing(i * self.ps, w.prefix.routing[page])
        seq.num_computed = n * self.ps

    def _prompt_keys(self, seq: Sequence, version: int) -> list[int]:
        """Chain keys of seq's full prompt pages under `version` (computed once per version)."""
        if seq.prompt_keys is None or seq.prompt_keys[0] != version:
            keys, key = [], 0
            for i in range(len(seq.prompt_ids) // self.ps):
                key = page_key(key, seq.prompt_ids[i * self.ps : (i + 1) * self.ps], version, seq.adapter)
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

    def _waits_for_prefix(self, w: _Work, seq: Sequence, pending: set[int]) -> bool:
        """True if seq's first uncached prompt page is being computed by another sequence right
        now: admitting it next step turns that page into a prefix hit instead of a recompute."""
        keys = self._prompt_keys(seq, w.version)[: (seq.total_len - 1) // self.ps]
        missing = next((k for k in keys if w.prefix.find(k, w.version, seq.adapter) == 0), None)
        return missing is not None and missing in pending

    def _register_full_pages(self, w: _Work, seq: Sequence) -> None:
        """Index every page of seq that is now full (prompt or generated tokens)."""
        if not self.cfg.enable_prefix_caching or seq.mixed_kv:
            return
        table, known = w.pool.table(seq.seq_id), w.pool.seq_keys(seq.seq_id)
        full = min(seq.num_computed // self.ps, len(table))
        if len(known) >= full:  # the usual case: a page fills once per page_size tokens
            return
        parent, new = (known[-1] if known else 0), []
        for i in range(len(known), full):
            key = page_key(parent, seq.token_slice(i * self.ps, self.ps), w.version, seq.adapter)
            page = table[i]
            if w.prefix.key[page] == 0 and w.prefix.find(key, w.version, seq.adapter) == 0:
                w.prefix = w.prefix.insert(page, key, w.version, w.pool.next_tick(), seq.adapter)
                if seq.routed is not None:
                    w.prefix = w.prefix.with_routing(page, seq.routed[i * self.ps : (i + 1) * self.ps])
            new.append(key)
            parent = key
        w.pool.add_keys(seq.seq_id, new)

    # ---- the schedule ----------------------------------------------------------

    def schedule(self, state: EngineState) -> tuple[Plan, EngineState]:
        w = _Work.of(state)
        budget = self.cfg.max_num_batched_tokens
        spec = self.cfg.speculative_config
        drafts = self.drafts_per_step if spec is not None and spec.drafts_with(len(self.running)) else 0
        plan = Plan(decode=[], prefill=[])

        # 1. Running sequences, oldest first; preempt the youngest when pages run out. A decoding
        # sequence with a draft verifies it: its last token and the draft, as one chunk.
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not Status.RUNNING or budget <= 0:
                continue
            if seq.in_prefill:
                n = min(seq.total_len - seq.num_computed, budget)
            else:
                seq.draft = self._draft(seq, min(budget - 1, drafts))
                drafts -= len(seq.draft)
                n = 1 + len(seq.draft)
            while not self._grow(w, seq, seq.num_computed + n):
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(w, victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            budget -= n
            if n > 1 or seq.in_prefill:
                plan.prefill.append((seq, n))
            else:
                plan.decode.append(seq)
        # A preempted victim may already have been planned: drop it from the plan.
        plan.decode = [s for s in plan.decode if s.status is Status.RUNNING]
        plan.prefill = [(s, n) for s, n in plan.prefill if s.status is Status.RUNNING]

        # 2. Admit waiting sequences, in order, while the budget, max_num_seqs and pages allow.
        caching = self.cfg.enable_prefix_caching
        pending = self._pending_keys(w.version) if caching and self.waiting else set()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            if self.hold_admission and not seq.admitted_once:
                continue  # an update is draining: only already-started (preempted) work may run
            if seq.fork_parent is not None and self._parent_pending(seq):
                continue  # n > 1: wait for the parent's prompt so its pages can be shared
            if pending and not prompt_record.asks(seq) and self._waits_for_prefix(w, seq, pending):
                continue  # a shared prefix is being computed this step: hit it next step
            self._match_prefix(w, seq)
            if not seq.admitted_once:
                seq.num_cached_tokens = seq.num_computed
                seq.admitted_once = True
            n = min(seq.total_len - seq.num_computed, budget)
            if not self._grow(w, seq, seq.num_computed + n):
                # Out of pages: stop here, so admission stays first-come first-served.
                w.pool.release(seq.seq_id)
                seq.num_computed = 0
                break
            self.waiting.remove(seq)
            if caching and not seq.mixed_kv:
                pending.update(self._prompt_keys(seq, w.version)[seq.num_computed // self.ps :])
            seq.status = Status.RUNNING
            seq.kv_version = w.version
            self.running.append(seq)
            budget -= n
            if seq.total_len - seq.num_computed > 1 or n > 1:
                plan.prefill.append((seq, n))
            else:
                plan.decode.append(seq)
        self._fit(plan)
        return plan, w.into(state)

    def _fit(self, plan: Plan) -> None:
        """Trim the youngest prefill chunk so the step's tokens land on a compiled size: the cut
        tokens run next step instead of this step paying for padding. Its pages stay allocated
        (the next step needs them), and a chunk short of its prompt's end samples nothing.

        Not when the cut would make a step of its own: the chunk is the step's only row and
        ends its prompt, so no next step would run without the cut tokens. That step would pay
        a whole pass over the weights for a few tokens, about what the padding costs (a 37-token
        chat, SmolLM2 Q4_1 blocks on 2 Zen 4 cores: 65 ms as one 48-token step, 48 + 14 ms as
        32 + 6), and would load a program for its small bucket (~40 MiB held for the step)."""
        total = len(plan.decode) + sum(n for _, n in plan.prefill)
        cut = total - self.fill(total)
        if cut > 0 and len(plan.rows) == 1 and plan.prefill:
            seq, n = plan.prefill[0]
            if seq.num_computed + n == seq.total_len:
                return
        if cut > 0 and plan.prefill and plan.prefill[-1][1] > cut:
            seq, n = plan.prefill[-1]
            plan.prefill[-1] = (seq, n - cut)
            seq.draft = seq.draft[: max(0, len(seq.draft) - cut)]  # a verification verifies less

    def _draft(self, seq: Sequence, room: int) -> list[int]:
        """The draft seq verifies this step: at most `room` tokens, none past max_model_len or
        past what max_tokens leaves (the token after an accepted draft comes free). A sequence
        under structured outputs never speculates (its mask would be needed at every drafted
        position)."""
        if self.propose is None or seq.matcher is not None:
            return []
        room = min(room, self.cfg.max_model_len - seq.total_len)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_ids) - 1)
        return self.propose(seq, room) if room > 0 else []

    def _parent_pending(self, seq: Sequence) -> bool:
        p = seq.fork_parent
        return p is not None and not p.is_finished and p.num_computed < len(p.prompt_ids)

    # ---- after the step ---------------------------------------------------------

    def postprocess(
        self, state: EngineState, plan: Plan, out: StepOutput
    ) -> tuple[EngineState, list[Sequence]]:
        """Record a step's results: stamp the written pages with the weights version, index newly
        full pages, append each sampled token with its version and finish sequences that stop.
        Returns the next state and the sequences the step touched."""
        w = _Work.of(state)
        page_version = state.kv.page_version.copy()
        page_adapter = state.kv.page_adapter.copy()
        sampled, routed = out
        rows = plan.rows
        at = 0  # the row's first sampled row: rows sample Sequence.samples each, in order
        for i, (seq, n) in enumerate(rows):
            first, at = at, at + seq.samples(n)
            # A verification keeps the last token and the draft's accepted prefix: its positions
            # now hold KV of the tokens the sequence has; the rest is rolled back.
            draft = seq.draft
            kept = 1 + accepted(draft, sampled.tokens[first:at]) if draft else n
            if routed[i] is not None:  # a MoE model: the experts of the row's tokens
                seq.record_routing(seq.num_computed, routed[i][:kept])
            table = w.pool.table(seq.seq_id)
            lo, hi = seq.num_computed // self.ps, (seq.num_computed + n - 1) // self.ps
            page_version[list(table[lo : hi + 1])] = w.version  # every page the step wrote
            page_adapter[list(table[lo : hi + 1])] = seq.adapter
            seq.num_computed += kept
            # Index newly full pages before a finish can release them (then they stay cached);
            # a page of accepted draft tokens reads them from the draft.
            self._register_full_pages(w, seq)
            w.pool.advance(seq.seq_id, seq.num_computed)
            if draft:
                self.num_drafts += 1
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += kept - 1
                seq.spec_drafts += 1
                seq.spec_proposed += len(draft)
                seq.spec_accepted += kept - 1
                seq.draft = []
                # the pages past the next token's hold only rejected positions
                w.pool.truncate(seq.seq_id, -(-(seq.num_computed + 1) // self.ps))
            elif seq.num_computed < seq.total_len:
                continue  # a prompt chunk short of the prompt's end: nothing sampled
            # the accepted draft tokens, then the target's own: row j's log-probs are of the
            # token at that position (an accepted draft token is the row's sampled token)
            tokens = [*draft[: kept - 1], int(sampled.tokens[first + kept - 1])] if draft else [None]
            for j, token in enumerate(tokens, first):
                if self._append(w, seq, sampled, j, token):
                    break
        state = w.into(state)
        kv = KVCache(pages=state.kv.pages, page_version=page_version, page_adapter=page_adapter)
        return dataclasses.replace(state, kv=kv), [s for s, _ in rows]

    def _append(self, w: _Work, seq: Sequence, sampled: Sampled, j: int, token: int | None) -> bool:
        """Append `token` (None: the token of sampled row j) with row j's log-probs to seq;
        True if that finished it."""
        k = seq.params.logprobs
        seq.append_token(
            int(sampled.tokens[j]) if token is None else token,
            float(sampled.logprobs[j]),
            w.version,
            (sampled.top_ids[j, :k].copy(), sampled.top_lps[j, :k].copy()) if k else None,
        )
        if seq.params.return_kept_set is not None:
            seq.append_kept(int(sampled.kept[j]), sampled.kept_mask[j])
        self.num_generated += 1
        reason, stop = finish_reason(seq, self.cfg.max_model_len)
        if reason is None:
            return False
        seq.stop_reason = stop
        self._finish(w, seq, reason)
        return True

    # ---- ending and preempting outside a step -------------------------------------

    def _finish(self, w: _Work, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        w.pool.release(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def finish(self, state: EngineState, seqs: list[Sequence], reason: str) -> EngineState:
        """End `seqs` (e.g. aborted) and release their pages."""
        w = _Work.of(state)
        for seq in seqs:
            if not seq.is_finished:
                self._finish(w, seq, reason)
        return w.into(state)

    def preempt_running(self, state: EngineState) -> EngineState:
        """Every running sequence back to the queue, to be recomputed (its pages released)."""
        return self.preempt(state, list(self.running))

    def preempt(self, state: EngineState, seqs: list[Sequence]) -> EngineState:
        """These running sequences back to the queue, to be recomputed (their pages released)."""
        w = _Work.of(state)
        for seq in seqs:
            if seq in self.running:
                self._preempt(w, seq)
        return w.into(state)


def accepted(draft: list[int], tokens) -> int:
    """How many leading draft tokens the target sampled too. Row i's token is what decoding
    without speculation samples at that output position given the same logits (the same
    uniform: programs/sampler.py), so the longest agreeing prefix, plus the target's token after
    it, is the run decoding would have produced. For a draft that is one proposal, not a
    distribution (prompt lookup, a greedy draft model), this is the modified rejection sampling
    of Leviathan et al. with q a point mass: the draft token x is kept with probability p(x),
    and otherwise the target's token is a draw from p without x."""
    n = 0
    while n < len(draft) and int(tokens[n]) == draft[n]:
        n += 1
    return n
