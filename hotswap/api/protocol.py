"""OpenAI wire format: request models (pydantic) and response/chunk builders.

Requests forbid unknown fields, so a typo such as `max_token` is a 400 naming
the field instead of a silently ignored knob. Fields the official `openai`
client can send are accepted; those this engine cannot honour (penalties,
logit_bias) are accepted only at their neutral value and refused otherwise,
again naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hotswap.api import router_fields, structured_fields
from hotswap.api.prompt_fields import FLOOR
from hotswap.engine.outputs import CompletionOutput, RequestOutput
from hotswap.engine.sampling import SamplingParams
from hotswap.engine.structured import StructuredOutputs
from hotswap.errors import RequestError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # vLLM's field: logprob tokens as "token_id:<id>", so a client (an RL trainer re-scoring
    # its samples) gets exact ids; decoded strings of byte-level tokens are ambiguous.
    return_tokens_as_token_ids: bool = False
    # vLLM's: `prompt_token_ids` and each choice's `token_ids`, so a trainer never re-tokenizes.
    return_token_ids: bool = False
    # The output's constraint: OpenAI's `response_format` or vLLM's `structured_outputs` body
    # (api/structured_fields.py); vLLM's removed `guided_*` fields get a 400 naming the new one.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_json_object: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's: the prompt tokens' log-probs with the k likeliest at each position (a completions
    # choice's / a chat response's `prompt_logprobs`; api/prompt_fields.py).
    prompt_logprobs: int | None = None
    # What the log-probs are of (vLLM's engine option `logprobs_mode`, here per request; None: the
    # server's) and each token's kept set (`return_kept_set`: api/kept_fields.py); SamplingParams's.
    logprobs_mode: str | None = None
    return_kept_set: bool | str | None = None
    # vLLM's: the id this request answers with (`cmpl-<id>`, `chatcmpl-<id>`) and can be aborted
    # by; the X-Request-Id header wins (api/request_ids.py). Default: a fresh one.
    request_id: str | None = None
    # Fields sglang-router fills and SGLang / vLLM clients send (api/router_fields.py): a stop
    # string kept in the text (SGLang's `no_stop_trim`, vLLM's `include_stop_str_in_output`);
    # hidden states are not returned (true: a 400).
    no_stop_trim: bool = False
    include_stop_str_in_output: bool = False
    return_hidden_states: bool = False
    # Accepted for openai-client compatibility; only neutral values (see `_check_neutral`).
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def _check_neutral(self) -> None:
        router_fields.refuse_unserved(self)
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise unsupported(name, "penalties are not implemented; leave it unset or 0")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit bias is not implemented; leave it unset or {}")

    def constraint(self) -> StructuredOutputs | None:
        structured_fields.refuse_guided({name: getattr(self, name) for name in structured_fields.GUIDED})
        return structured_fields.request_constraint(self.response_format, self.structured_outputs)

    def _sampling(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        constraint: StructuredOutputs | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        self._check_neutral()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            logprobs_mode=self.logprobs_mode,
            return_kept_set=self.return_kept_set,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.no_stop_trim or self.include_stop_str_in_output,
            structured_outputs=constraint,
        )


def unsupported(param: str, why: str) -> RequestError:
    return RequestError.of_field(param, why)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise unsupported("prompt", "the prompt list is empty")
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        if self.best_of not in (None, self.n):
            raise unsupported("best_of", "best_of != n is not implemented")
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion) is not implemented")
        # echo + logprobs: the prompt's log-probs lead the choice's (vLLM's reading of OpenAI's).
        prompt = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt = max(prompt or 0, self.logprobs)
        # echo with max_tokens 0 (an eval harness scoring its prompt): one token is generated and
        # not shown, as vLLM does.
        max_tokens = 1 if self.prompt_only else self.max_tokens
        return self._sampling(max_tokens, self.logprobs, self.constraint(), prompt)

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the choice is the prompt alone."""
        return self.echo and self.max_tokens == 0


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant's calls (arguments as JSON text) and a tool result's call; checked in engine/chat.py.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's extra body fields for the chat template (engine/chat.py, the same code as `LLM.chat`).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and ignored: bookkeeping fields with no effect on generation.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Tool calling (hotswap/toolcalls/choice.py checks them).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # SGLang's reasoning split (sglang-router sends both true): either value, there is no
    # reasoning parser here (SGLang without --reasoning-parser ignores them too).
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise unsupported("top_logprobs", "top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(
            max_tokens, (self.top_logprobs or 0) if self.logprobs else None, self.constraint()
        )


_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


class TokenizeRequest(_Strict):
    """vLLM's `/tokenize` body: its TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest
    (`messages`, rendered by the chat template as /v1/chat/completions renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: true for a prompt (BOS added), false for messages (the template places it).
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def check(self) -> None:
        """Exactly one of prompt and messages; the chat fields only with messages."""
        if (self.prompt is None) == (self.messages is None):
            why = "neither was given" if self.prompt is None else "both were given"
            raise RequestError(f"/tokenize takes exactly one of `prompt` or `messages` ({why})")
        if self.prompt is not None:
            stray = [f for f in _CHAT_ONLY if f in self.model_fields_set]
            if stray:
                raise unsupported(stray[0], "applies to `messages` only (this request tokenizes a `prompt`)")


class DetokenizeRequest(_Strict):
    """vLLM's `/detokenize` body."""

    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- responses


def version_fields(comp: CompletionOutput) -> dict[str, Any]:
    """Per-choice provenance: spans only when the tokens came from more than one version (from a
    quantized engine, each with the quantization its version was served in), `quantization` (the last token's
    version's, `weights/quantize.label`) only from a quantized engine, and `mixed_weights_kv`
    only when some token's context mixed versions (update policy "keep")."""
    spans = comp.weights_version_spans
    fields: dict[str, Any] = {}
    quantized = any(q is not None for q in comp.quantization.values())  # else the wire is unchanged
    if len(spans) > 1:
        fields["weights_version_spans"] = (
            [{**s, "quantization": comp.quantization.get(s["version"])} for s in spans]
            if quantized
            else spans
        )
    if quantized:  # how the weights were served
        fields["quantization"] = comp.quantization[spans[-1]["version"]]
    if comp.mixed_weights_kv:
        fields["mixed_weights_kv"] = True
    return fields


def response_version(outs: list[RequestOutput]) -> int:
    """Top-level `weights_version`: the version that produced the newest token (else the engine's)."""
    last = [c.weights_versions[-1] for o in outs for c in o.outputs if c.weights_versions]
    return max(last) if last else max(o.weights_version for o in outs)


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    spec = spec_decode([c for o in outs for c in o.outputs])
    return out if spec is None else {**out, "spec_decode": spec}


def spec_decode(samples: list[CompletionOutput]) -> dict[str, Any] | None:
    """Speculative decoding's figures for these samples (`usage.spec_decode`, SGLang's
    `meta_info`): drafts verified, their tokens, the tokens accepted, the acceptance rate and
    the mean acceptance length (vLLM's: tokens a verification yields, its own included).
    None when nothing was drafted (no speculation, or nothing to look up)."""
    drafts = sum(c.num_drafts for c in samples)
    if not drafts:
        return None
    drafted = sum(c.num_draft_tokens for c in samples)
    accepted = sum(c.num_accepted_tokens for c in samples)
    spec = {
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted,
        "mean_acceptance_length": 1 + accepted / drafts,
    }
    versions = sorted({v for c in samples for v in c.draft_versions})
    # a draft checkpoint's versions that drafted for these samples (only where one ran)
    return {**spec, "draft_versions": versions} if versions else spec


def token_str(tokenizer, tid: int, as_ids: bool = False) -> str:
    if as_ids:
        return f"token_id:{tid}"
    return tokenizer.decode([tid], skip_special_tokens=False) if tokenizer is not None else str(tid)


def wire_logprob(lp: float) -> float:
    """JSON has no -inf (a token a processed `logprobs_mode` filtered out): clamped at
    `prompt_fields.FLOOR`, as vLLM's OpenAI server clamps it."""
    return max(lp, FLOOR)


def completion_logprobs(
    tokenizer, comp: CompletionOutput, start: int, text_offset: int, as_ids: bool = False
) -> dict[str, Any]:
    """Legacy completions format for tokens [start:]: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [token_str(tokenizer, t, as_ids) for t in comp.token_ids[start:]]
    offsets, pos = [], text_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = None
    if comp.top_logprobs is not None:
        top = [
            {token_str(tokenizer, i, as_ids): wire_logprob(lp) for i, lp in d.items()}
            for d in comp.top_logprobs[start:]
        ]
    return {
        "tokens": tokens,
        "token_logprobs": [wire_logprob(lp) for lp in comp.logprobs[start:]],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, comp: CompletionOutput, start: int, as_ids: bool = False) -> dict[str, Any]:
    """Chat format for tokens [start:]: content = [{token, logprob, bytes, top_logprobs}]."""

    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = token_str(tokenizer, tid, as_ids)
        return {"token": s, "logprob": wire_logprob(lp), "bytes": list(s.encode())}

    content = []
    for k in range(start, len(comp.token_ids)):
        e = entry(comp.token_ids[k], comp.logprobs[k])
        tops = comp.top_logprobs[k] if comp.top_logprobs is not None else {}
        e["top_logprobs"] = [entry(i, lp) for i, lp in tops.items()]
        content.append(e)
    return {"content": content}
