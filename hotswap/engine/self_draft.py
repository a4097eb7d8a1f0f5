"""The self-speculative draft (speculative_config `{"method": "draft_model", "model": "self"}`):
the target's own first `draft_layers` layers, then its final norm and its head (as LayerSkip
drafts), decoding greedily.

Its KV is the target's KV of those layers, in the same pages: the target computed them for
every token the sequence has (same weights, same tokens), so the draft needs no cache, no
catch-up and no version of its own. It is the policy's own layers, so it is swapped with the
policy by every update, and a page it wrote under old weights cannot outlive the update that
empties the cache. Its passes write those layers' K/V at the drafted positions; the
verification that follows in the same step rewrites every layer there, and rolls back the
rejected positions as it does for any draft.
"""

from __future__ import annotations

import contextlib

from hotswap.engine.runner import Runner
from hotswap.engine.scheduler import Plan
from hotswap.engine.sequence import Sequence
from hotswap.engine.state import EngineState
from hotswap.engine_config import EngineConfig
from hotswap.kernels.backend import Backend
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params

# What the scheduler plans for a self-drafted sequence: the draft's length, its tokens still to come.
PENDING = -1


class SelfDraft:
    def __init__(self, mcfg: ModelConfig, ecfg: EngineConfig, backend: Backend):
        self.layers = ecfg.speculative_config.draft_layers
        self.runner = Runner(mcfg.first_layers(self.layers), ecfg, backend)

    def params(self, params: Params) -> Params:
        """The draft's view of the target's params: the same arrays, the first layers only."""
        return {**params, "layers": params["layers"][: self.layers]}

    def warmup(self, state: EngineState, rows: int, progress: bool, cache: bool) -> None:
        """Compile the draft's decode steps of up to `rows` sequences (what a step drafts)."""
        pages = state.kv.pages[: self.layers]
        self.runner.warmup(self.params(state.step_params), pages, progress, cache, decode_upto=rows)

    def fill(self, state: EngineState, plan: Plan) -> tuple:
        """Draft the tokens the plan's verifications will check (their drafts hold PENDING):
        one greedy pass of every drafting sequence per draft position. Returns the state's
        page buffers with the draft's layers rewritten (the rest are untouched)."""
        rows = [s for s, _ in plan.rows if s.draft and s.draft[0] == PENDING]
        full = state.kv.pages
        if not rows:
            return full
        want = [len(s.draft) for s in rows]
        for s in rows:
            s.draft = []
        params, pages = self.params(state.step_params), full[: self.layers]
        for j in range(max(want)):
            live = [s for s, k in zip(rows, want, strict=True) if j < k]
            with _ahead(live, j):
                for kind, call in self.runner.calls([(s, 1) for s in live], []):
                    pages, tokens = self.runner.greedy(params, pages, kind, call, state.pool)
                    for (s, _), t in zip(call, tokens, strict=True):
                        s.draft.append(int(t))
        return (*pages, *full[self.layers :])


@contextlib.contextmanager
def _ahead(seqs: list[Sequence], j: int):
    """The draft's pass j feeds position last + j: the sequences read as if j more tokens had
    KV (the tokens past the last one come from the draft so far, `Sequence.token_slice`)."""
    for s in seqs:
        s.num_computed += j
    try:
        yield
    finally:
        for s in seqs:
            s.num_computed -= j
