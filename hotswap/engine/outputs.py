"""Request and output types (vLLM names), built from host-side sequences."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class CompletionOutput:
    """One sample. logprobs[i] is token i's log-prob under the raw model distribution;
    weights_versions[i] is the weights version that produced token i."""

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

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool
    weights_version: int  # the engine's version when this output was built
