"""The output processor: request and output types (vLLM names), each sample's text, and
whether a sample stops after its latest token.

`SequenceText` owns a sample's text: incremental detokenization (each token costs
a decode of a few-token window, never of the whole output), stop strings (searched
in the new text plus the tail a stop string could straddle) and the deltas a stream
sends (text that no later token can change or cut). `finish_reason` is the one stop
decision (EOS, stop token, stop string, length); `request_output` builds what a
caller or a stream receives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from hotswap.checkpoint.tokenizer import IncrementalDecoder, Tokenizer
from hotswap.engine import structured
from hotswap.engine.prompt_record import Logprob
from hotswap.engine.sampling import SamplingParams
from hotswap.engine.sequence import Request, Sequence


@dataclasses.dataclass
class CompletionOutput:
    """One sample. logprobs[i] is token i's log-prob under the raw model distribution (or what
    the request's `logprobs_mode` names); weights_versions[i] is the weights version that
    produced token i."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    weights_versions: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    top_logprobs: list[dict[int, float]] | None = None  # when SamplingParams.logprobs > 0
    # True when some token was computed over KV written partly under older weights: only
    # after an update with policy "keep" lands mid-request (its tokens are labelled with
    # the version that sampled them, but their context was not recomputed).
    mixed_weights_kv: bool = False
    # The text since this sample's previous output: what a stream sends next. The deltas of
    # a sample's outputs concatenate to its final `text`.
    text_delta: str = ""
    # kv_versions[i]: the weights version of the oldest KV token i was computed over (equal to
    # weights_versions[i] unless a `keep` update landed while the sample ran).
    kv_versions: list[int] = dataclasses.field(default_factory=list)
    # With SamplingParams(return_routed_experts=True) on a MoE model: the experts each input
    # token (the prompt's and every generated one but the last) went to in each sparse layer,
    # int16 [prompt_len + generated - 1, moe layers, k], best first; tokens read from the prefix
    # cache report the routing their pages were written with.
    routed_experts: np.ndarray | None = None
    # With SamplingParams(return_kept_set=...): per token, the size of the set the sampler could
    # draw it from (after the structured-output mask and the top-k/top-p/min-p filters; 1 for a
    # greedy token), and with "ids" that set's ids (int32, ascending), with "mask" that set as
    # packed words (int32 [ceil(V / 32)], bit t % 32 of word t // 32).
    kept_counts: list[int] | None = None
    kept_token_ids: list[np.ndarray] | None = None
    kept_masks: list[np.ndarray] | None = None
    # Speculative decoding (speculative_config): drafts verified for this sample, their tokens,
    # and how many of those the target accepted (all 0 without speculation).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # A draft checkpoint's versions whose drafts this sample verified, in order (a draft update
    # mid-request shows as two); empty without one.
    draft_versions: list[int] = dataclasses.field(default_factory=list)
    # How each weights version in `weights_versions` was served: None unquantized, else
    # `weights/quantize.label` ("int8", "int8-g128", "fp8", "gguf:q4_1+q8_0").
    quantization: dict[int, str | None] = dataclasses.field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted; None when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verification yields on average, the target's own one included (vLLM's
        "mean acceptance length": 1 + accepted / drafts); None when nothing was drafted."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def cumulative_logprob(self) -> float:
        return float(np.sum(self.logprobs)) if self.logprobs else 0.0

    @property
    def weights_version_spans(self) -> list[dict[str, int]]:
        """Runs of equal version: [{"version", "start", "end"}] (end exclusive)."""
        spans: list[dict[str, int]] = []
        for i, v in enumerate(self.weights_versions):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": v, "start": i, "end": i + 1})
        return spans


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool
    weights_version: int  # the engine's version when this output was built
    # SamplingParams.prompt_logprobs = k: vLLM's list, None for the first prompt token, then per
    # token {token id: Logprob} (the token itself and the top k); None until the prompt is whole.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class SequenceText:
    """One sample's output text, fed one token at a time.

    `append` decodes the new token against a short window (`IncrementalDecoder`), so
    a token costs O(1) text work however long the output is. Stop strings are
    searched in the newly decoded text plus the last `max(len(stop)) - 1` characters
    before it, so a stop string that spans tokens is found on the token that completes
    it. As in vLLM, the text is cut just before the stop string (or just after it, with
    `include_stop_str_in_output`). Without stop strings
    nothing needs the text per token, so decoding waits until `text` or `take_delta`
    is read (one decode of the whole output for a request that is not streamed).
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self._dec = IncrementalDecoder(tokenizer, params.skip_special_tokens)
        self._stops: list[str] = list(params.stop or [])
        self._keep_stop = params.include_stop_str_in_output
        self._tail_len = max(0, max((len(s) for s in self._stops), default=0) - 1)
        self._unread: list[int] = []  # appended ids not yet decoded (no stop strings: decoded lazily)
        self._joined = ""  # the decoded text, up to the pieces in `_fresh`
        self._fresh: list[str] = []  # decoded pieces not yet joined (joined when `text` is read)
        self._length = 0  # characters decoded (the held-back end not counted)
        self._tail = ""  # the last `_tail_len` characters of the decoded text
        self._unsent: list[str] = []  # decoded text not yet handed out by `take_delta`
        self._sent = 0  # characters handed out by `take_delta`
        self._stop_at: int | None = None  # set by a stop string: the text's final length
        self._done = False  # the final delta was taken

    def append(self, token_id: int, stop_terminated: bool = False) -> str | None:
        """Add one generated token; returns the stop string it completes, else None.

        `stop_terminated`: the token itself ends the sample (EOS or a stop token id), so
        no stop string is checked and the text stays whole. After a stop string matched,
        the sample is over and later tokens add nothing.
        """
        if self._stop_at is not None:
            return None
        self._unread.append(token_id)
        if not self._stops or stop_terminated:
            return None
        tail, start = self._tail, self._length
        # The text a stop string completed by this token can lie in: the tail before it, the
        # new text, and the held-back end a full decode shows (a partial character as U+FFFD).
        window = tail + self._decode() + self._dec.pending
        for s in self._stops:
            j = window.find(s)
            if j >= 0:
                self._stop_at = start - len(tail) + j + (len(s) if self._keep_stop else 0)
                return s
        return None

    @property
    def text(self) -> str:
        """The text so far, as a full decode of the ids shows it (cut before a matched stop string)."""
        self._decode()
        if self._fresh:
            self._joined += "".join(self._fresh)
            self._fresh = []
        text = self._joined + self._dec.pending
        return text if self._stop_at is None else text[: self._stop_at]

    def take_delta(self, final: bool = False) -> str:
        """The text not yet taken, except what a later token could still change or cut: a
        partial character, and an end that is the start of a stop string. With `final`
        (the sample has finished) the rest of the text; the deltas then add up to `text`."""
        self._decode()
        if self._done:
            return ""
        unsent = "".join(self._unsent)
        if final or self._stop_at is not None:
            rest = unsent + self._dec.pending
            if self._stop_at is not None:
                rest = rest[: max(0, self._stop_at - self._sent)]
            self._unsent, self._done = [], True
            self._sent += len(rest)
            return rest
        hold = max(
            (k for s in self._stops for k in range(1, len(s)) if self._tail.endswith(s[:k])), default=0
        )
        delta = unsent[: max(0, len(unsent) - hold)]
        self._unsent = [unsent[len(delta) :]] if len(delta) < len(unsent) else []
        self._sent += len(delta)
        return delta

    def _decode(self) -> str:
        """Decode the unread ids; returns the newly completed text."""
        if not self._unread:
            return ""
        piece = self._dec.push(self._unread)
        self._unread = []
        if piece:
            self._fresh.append(piece)
            self._unsent.append(piece)
            self._length += len(piece)
            tail = self._tail + piece
            self._tail = tail[max(0, len(tail) - self._tail_len) :]
        return piece


def finish_reason(seq: Sequence, max_model_len: int) -> tuple[str | None, int | str | None]:
    """Feed seq's latest token to its text and decide: (finish reason, stop reason), or
    (None, None) to go on. EOS and stop token ids end it first (their text is kept whole)."""
    p, t = seq.params, seq.output_ids[-1]
    reason, stop = None, None
    if t in seq.eos_ids:
        reason = "stop"
    elif t in p.stop_token_ids:
        reason, stop = "stop", t
    if seq.output_text is not None:
        hit = seq.output_text.append(t, stop_terminated=reason is not None)
        if hit is not None:
            reason, stop = "stop", hit
    # A constraint that is complete (nothing may follow) ends the sample, as EOS would.
    if seq.matcher is not None and structured.consume(seq.matcher, t) and reason is None:
        reason = "stop"
    if reason is None and p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens:
        reason = "length"
    if reason is None and seq.total_len >= max_model_len:
        reason = "length"
    return reason, stop


def _completion(seq: Sequence, quantization) -> CompletionOutput:
    p = seq.params
    text, delta = "", ""
    if seq.output_text is not None:
        # Consumes the delta: call once per output built for the sequence.
        delta = seq.output_text.take_delta(final=seq.finish_reason is not None)
        text = seq.output_text.text
    top = None
    if p.logprobs:
        top = [dict(zip(map(int, ids), map(float, lps), strict=True)) for ids, lps in seq.output_top]
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=list(seq.output_ids),
        logprobs=list(seq.output_logprobs),
        weights_versions=list(seq.output_versions),
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        top_logprobs=top,
        mixed_weights_kv=seq.tokens_over_mixed_kv,
        text_delta=delta,
        kv_versions=list(seq.output_kv_versions),
        routed_experts=_routed(seq) if p.return_routed_experts else None,
        num_drafts=seq.spec_drafts,
        num_draft_tokens=seq.spec_proposed,
        num_accepted_tokens=seq.spec_accepted,
        draft_versions=list(seq.draft_versions),
        quantization={v: quantization(v) for v in dict.fromkeys(seq.output_versions)},
        **_kept(seq),
    )


def _kept(seq: Sequence) -> dict:
    """The kept-set fields of `CompletionOutput` the sample's params ask for."""
    form = seq.params.return_kept_set
    if form is None:
        return {}
    out = {"kept_counts": [count for count, _ in seq.output_kept]}
    if form != "count":
        out["kept_token_ids" if form == "ids" else "kept_masks"] = [held for _, held in seq.output_kept]
    return out


def _routed(seq: Sequence) -> np.ndarray | None:
    """The routing of the tokens with KV so far (all but the last one once the sample ends)."""
    if seq.routed is None:
        return None
    return seq.routed[: min(seq.num_computed, seq.total_len - 1)].copy()


def _prompt_logprobs(req: Request, tokenizer: Tokenizer | None) -> list | None:
    """vLLM's `prompt_logprobs` once the first sample's prompt is computed, built once per request."""
    if req.params.prompt_logprobs is None:
        return None
    if req.prompt_logprobs is None:
        record = req.seqs[0].prompt_record
        if len(req.prompt_ids) <= 1:
            req.prompt_logprobs = [None] * len(req.prompt_ids)
        elif record is not None and record.complete:
            texts: dict[int, str] = {}

            def decode(tid: int) -> str | None:
                if tokenizer is None:
                    return None
                if tid not in texts:
                    texts[tid] = tokenizer.decode([tid], skip_special_tokens=False)
                return texts[tid]

            req.prompt_logprobs = record.to_vllm(req.prompt_ids, decode)
    return req.prompt_logprobs


def request_output(
    req: Request,
    weights_version: int,
    tokenizer: Tokenizer | None = None,
    quantization: Callable[[int], str | None] = lambda version: None,
) -> RequestOutput:
    """The request's outputs now (each sample's text delta since the previous call); `tokenizer`
    spells the prompt log-probs' tokens; `quantization` names how each version was served
    (`StateRef.quantization`)."""
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_ids,
        outputs=[_completion(s, quantization) for s in req.seqs],
        num_cached_tokens=req.seqs[0].num_cached_tokens,
        finished=req.finished,
        weights_version=weights_version,
        prompt_logprobs=_prompt_logprobs(req, tokenizer),
    )
