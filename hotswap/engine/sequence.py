"""Host-side bookkeeping of requests: each `Request` and its `Sequence`s (one per sample of `n`):
tokens, status, sampling settings, text. The pages a sequence holds are in the engine state's
page pool."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hotswap.engine.prompt_record import PromptRecord
from hotswap.engine.sampling import SamplingParams
from hotswap.programs.sampler import unpack_mask

if TYPE_CHECKING:
    from hotswap.engine.outputs import RequestOutput, SequenceText

Sink = Callable[["RequestOutput"], None]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int  # admission priority: lower is older
    eos_ids: tuple[int, ...] = ()
    fork_parent: Sequence | None = None  # n > 1: share the parent's prompt pages
    # The LoRA adapter served to it (model/lora.py): its buffer slot (-1: the base model) and its
    # (adapter id, adapter version), part of every cache key it writes or reads (prefix.py).
    lora_slot: int = -1
    adapter: tuple[int, int] = (0, 0)

    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top: list[tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)
    # SamplingParams.return_kept_set: per token (kept count, its ids "ids" | packed words "mask" | None)
    output_kept: list[tuple[int, np.ndarray | None]] = dataclasses.field(default_factory=list)
    output_versions: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: SequenceText | None = None  # detokenized output, stop strings, deltas; None: no tokenizer

    # num_computed tokens have KV in the sequence's pages (its block table is in the
    # engine state's page pool); the next step feeds all_ids[num_computed:...].
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    # Set under the `keep` update policy: this sequence's KV mixes weights
    # versions, so pages it writes must never enter the prefix index.
    mixed_kv: bool = False
    # Sticky: some output token was computed over KV that mixed weights versions (`keep`).
    tokens_over_mixed_kv: bool = False
    admitted_once: bool = False
    # The weights version of this sequence's oldest KV: set when it is admitted (prefix hits
    # are of the current version only), None while it holds no KV. Under `keep` it falls
    # behind the serving version; `max_version_lag` bounds how far (controller.py).
    kv_version: int | None = None
    output_kv_versions: list[int] = dataclasses.field(default_factory=list)  # kv_version per token
    prompt_keys: tuple[int, list[int]] | None = None  # (version, chain keys of full prompt pages)
    # Structured outputs: the llguidance matcher of this sample's output so far (its next
    # token's mask; engine/structured.py), None when unconstrained.
    matcher: Any = None
    # A MoE model's routing record: routed[t] holds the experts token t went to in each sparse
    # layer ([moe layers, k] int16), for every token that has KV (computed here, or read with
    # the prefix pages it hit). Grown as tokens are computed; None for a dense model.
    routed: np.ndarray | None = None
    # SamplingParams.prompt_logprobs (the first sample only): the prompt tokens' log-probs so far,
    # chunk by chunk as the step computes them (engine/prompt_record.py).
    prompt_record: PromptRecord | None = None
    # Speculative decoding (engine/speculation.py): the tokens proposed to follow the last one,
    # fed after it to this step's verification and cleared once the step is done; and over the
    # sequence's life, how many drafts were verified, their tokens and how many the target accepted.
    draft: list[int] = dataclasses.field(default_factory=list)
    spec_drafts: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    # The draft checkpoint's versions whose drafts it verified, in order (engine/draft_model.py).
    draft_versions: list[int] = dataclasses.field(default_factory=list)

    def record_prompt(self, start: int, lp, rank, top_ids, top_lps) -> None:
        """A step's prompt log-probs for the chunk of positions [start, start + len(lp))."""
        if self.prompt_record is None:
            self.prompt_record = PromptRecord.empty(len(self.prompt_ids), self.params.prompt_logprobs or 0)
        self.prompt_record.record(start, lp, rank, top_ids, top_lps)

    def record_routing(self, start: int, experts: np.ndarray) -> None:
        """The experts of tokens [start, start + len(experts)) (a step's, or a prefix hit's)."""
        end = start + len(experts)
        if self.routed is None or len(self.routed) < end:
            grown = np.zeros(
                (max(end, 2 * (0 if self.routed is None else len(self.routed))), *experts.shape[1:]), np.int16
            )
            if self.routed is not None:
                grown[: len(self.routed)] = self.routed
            self.routed = grown
        self.routed[start:end] = experts

    def append_token(self, token: int, logprob: float, version: int, top) -> None:
        """One sampled token, the weights version that produced it and its top-k (or None)."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.output_versions.append(version)
        self.output_kv_versions.append(version if self.kv_version is None else self.kv_version)
        self.tokens_over_mixed_kv |= self.mixed_kv
        if top is not None:
            self.output_top.append(top)

    def append_kept(self, count: int, words: np.ndarray) -> None:
        """The last token's kept set (`SamplingParams.return_kept_set`): its size, and what the
        request asked of it: its ids (decoded now, from the packed `words`) or the words."""
        form = self.params.return_kept_set
        held = unpack_mask(words).nonzero()[0].astype(np.int32) if form == "ids" else None
        self.output_kept.append((count, words.copy() if form == "mask" else held))

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """all_ids[start:start+n] without building all_ids (a decode step reads one token), and
        past the last token the draft (what a verification step feeds)."""
        p = len(self.prompt_ids)
        if start >= p:
            out = self.output_ids[start - p : start - p + n]
        else:
            out = (self.prompt_ids[start : start + n] + self.output_ids[: max(0, start + n - p)])[:n]
        if len(out) < n and self.draft:
            past = start + len(out) - self.total_len
            out = out + self.draft[past : past + n - len(out)]
        return out

    def samples(self, n: int) -> int:
        """Rows a step's chunk of n of this sequence's tokens samples: every position of a
        verification (its last token and its whole draft), else the chunk's last."""
        return n if self.draft and n == 1 + len(self.draft) else 1

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than one token still needs KV before the next sample."""
        return self.total_len - self.num_computed > 1


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    sink: Sink | None = None
    stream: bool = False
    # SamplingParams.prompt_logprobs: vLLM's list, built once the prompt is whole (outputs.py)
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
