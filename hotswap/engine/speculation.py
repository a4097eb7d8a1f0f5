"""Speculative decoding: where a step's drafts come from (`proposer`), one place.

A decoding sequence with a draft is verified in the step as a chunk of its last token and the
draft; every position of the chunk is sampled as decoding would sample it, and the scheduler
keeps the draft's longest prefix the target agrees with, plus the target's next token
(scheduler.py `accepted`). So speculation changes how many tokens a step yields, never which:
with the same logits, the output is the one decoding without speculation gives, greedy or
seeded. The verified rows ride in the step's batch beside every other row (continuous batching
kept), their rejected positions' pages are released, and only accepted tokens' pages enter the
prefix index.
"""

from __future__ import annotations

from hotswap.engine import ngram
from hotswap.engine.draft_model import DraftModel
from hotswap.engine.scheduler import Propose
from hotswap.engine.self_draft import PENDING, SelfDraft
from hotswap.engine.sequence import Sequence
from hotswap.engine_config import EngineConfig
from hotswap.kernels.backend import Backend
from hotswap.model.config import ModelConfig
from hotswap.speculative import SELF, SpeculativeConfig


def proposer(config: SpeculativeConfig | None) -> Propose | None:
    """The scheduler's draft source for `config` (None: no speculation). A draft model's
    tokens come from the device after the plan is made: the scheduler plans their number
    (PENDING tokens) and `SelfDraft.fill` (`DraftModel.fill`) drafts them before the step runs."""
    if config is None:
        return None
    k, lo, hi = config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max

    def prompt_lookup(seq: Sequence, room: int) -> list[int]:
        return ngram.propose(seq.all_ids, lo, hi, min(k, room))

    def draft_model(seq: Sequence, room: int) -> list[int]:
        return [PENDING] * min(k, room)

    return prompt_lookup if config.method == "ngram" else draft_model


def drafter(mcfg: ModelConfig, ecfg: EngineConfig, backend: Backend) -> SelfDraft | DraftModel | None:
    """The draft model a step runs before its verification (None: the drafts are the host's):
    the target's own first layers, or a draft checkpoint (engine/draft_model.py)."""
    config = ecfg.speculative_config
    if config is None or config.method != "draft_model":
        return None
    if config.model != SELF:
        return DraftModel(mcfg, ecfg)
    config.check_model(mcfg.num_layers)
    return SelfDraft(mcfg, ecfg, backend)
