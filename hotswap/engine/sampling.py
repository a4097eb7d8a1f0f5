"""What a request asks of sampling (vLLM's `SamplingParams`), validated on the host.

The device side, per-row arrays and the sampler itself, is `programs/sampler.py`.
"""

from __future__ import annotations

import dataclasses

from hotswap.args import LOGPROBS_MODES
from hotswap.engine.structured import StructuredOutputs, structured_outputs
from hotswap.errors import RequestError
from hotswap.programs.sampler import TOP_LOGPROBS

KEPT_SET_FORMS = ("count", "ids", "mask")  # SamplingParams.return_kept_set


@dataclasses.dataclass
class SamplingParams:
    """vLLM-compatible sampling parameters."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0..20)
    # vLLM's: the prompt tokens' log-probs (`RequestOutput.prompt_logprobs`), each with the k
    # most likely tokens at its position (0..20); raw distribution, as `LLM.score`. A request
    # that asks recomputes its whole prompt (no prefix-cache hit: engine/prompt_record.py).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's (SGLang's `no_stop_trim`): a matched stop string stays at the end of the text
    # instead of being cut off (the text still ends with it: what follows in its token is cut).
    include_stop_str_in_output: bool = False
    # The output must match this (JSON schema, regex, choice, grammar: engine/structured.py);
    # a dict is read as vLLM's JSON form.
    structured_outputs: StructuredOutputs | dict | None = None
    # A MoE model: return the experts every token was routed to (`CompletionOutput.routed_experts`),
    # what a trainer replays ("rollout routing replay").
    return_routed_experts: bool = False
    # What `logprobs` and `top_logprobs` are of (vLLM's engine option `logprobs_mode`, here per
    # request too; None: the engine's): LOGPROBS_MODES.
    logprobs_mode: str | None = None
    # Per token, the set the sampler could draw from (after the structured-output mask and the
    # top-k/top-p/min-p filters; a greedy token's: itself): "count" its size
    # (`CompletionOutput.kept_counts`), "ids" its size and ids (`kept_token_ids`), "mask" its size
    # and a packed bitmask (`kept_masks`). True: "count".
    return_kept_set: str | bool | None = None

    def __post_init__(self):
        if self.n < 1:
            raise RequestError(f"n must be >= 1, got {self.n}")
        if not (self.temperature >= 0.0):
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not (0 <= self.logprobs <= TOP_LOGPROBS):
            raise RequestError(f"logprobs must be in [0, {TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= TOP_LOGPROBS):
            raise RequestError(f"prompt_logprobs must be in [0, {TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if self.logprobs_mode is not None and self.logprobs_mode not in LOGPROBS_MODES:
            raise RequestError(
                f"logprobs_mode={self.logprobs_mode!r}; use one of {', '.join(LOGPROBS_MODES)}"
            )
        if isinstance(self.return_kept_set, bool):
            self.return_kept_set = "count" if self.return_kept_set else None
        if self.return_kept_set is not None and self.return_kept_set not in KEPT_SET_FORMS:
            raise RequestError(
                f"return_kept_set={self.return_kept_set!r}; use one of {', '.join(KEPT_SET_FORMS)} (or true)"
            )
        self.structured_outputs = structured_outputs(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
