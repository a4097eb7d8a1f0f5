"""Prompt log-probs on the wire: `RequestOutput.prompt_logprobs` (vLLM's list: None for the first
prompt token, then {token id: Logprob} holding the token itself and the top k) in each server's
shape: vLLM's `prompt_logprobs`, OpenAI's `echo` + `logprobs` (the prompt's tokens lead the
legacy completions log-probs, the first one's null) and SGLang's `input_token_logprobs` /
`input_top_logprobs`.

JSON has no -inf: a log-prob is clamped at -9999.0, as vLLM clamps it.
"""

from __future__ import annotations

from typing import Any

from hotswap.engine.prompt_record import Logprob

FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, FLOOR)


def vllm_json(plp: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's `prompt_logprobs` as JSON: [null, {"<id>": {logprob, rank, decoded_token}}, ...]."""
    if plp is None:
        return None
    return [
        None
        if d is None
        else {
            str(t): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}
            for t, e in d.items()
        }
        for d in plp
    ]


def top_k(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k likeliest of a position's entries, best first (the prompt's own token is among them
    only when its rank is within k)."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return [(t, e) for t, e in ranked if e.rank is not None and e.rank <= k][:k]


def echo_logprobs(
    prompt_ids: list[int],
    plp: list[dict[int, Logprob] | None],
    top: int,
    token_str,
    completion: dict[str, Any] | None,
) -> dict[str, Any]:
    """The legacy completions `logprobs` of an echoed prompt followed by `completion`'s (the
    generated tokens', as `protocol.completion_logprobs` builds them; None: none shown). The first
    prompt token's log-prob and top are null; with `top` > 0 each later prompt token's top is the
    token itself and the `top` likeliest, as vLLM gives them. `token_str(id) -> str`."""
    tokens = [token_str(t) for t in prompt_ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    lps: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for t, entry in zip(prompt_ids[1:], plp[1:], strict=True):
        lps.append(_lp(entry[t].logprob))
        tops.append({token_str(i): _lp(e.logprob) for i, e in entry.items()})
    out = {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": tops if top > 0 else None,
        "text_offset": offsets,
    }
    if completion is not None:
        out["tokens"] += completion["tokens"]
        out["token_logprobs"] += completion["token_logprobs"]
        out["text_offset"] += completion["text_offset"]
        if out["top_logprobs"] is not None:
            out["top_logprobs"] += completion["top_logprobs"] or [{} for _ in completion["tokens"]]
    return out


def sglang_input(prompt_ids: list[int], plp: list | None, start: int, top: int, text) -> dict[str, list]:
    """SGLang's `input_token_logprobs` [[logprob, id, text], ...] for the prompt tokens from
    `start` (the first entry's log-prob null, as SGLang pads it whatever `start` is) and, with
    `top` > 0, `input_top_logprobs` (null, then per token its top `top` as [logprob, id, text]).
    `plp`: the request's prompt log-probs (None: not computed, only `start` = the last token);
    `text(id) -> str | None`."""
    ids = prompt_ids[start:]
    first = [[None, ids[0], text(ids[0])]] if ids else []
    rest = range(start + 1, len(prompt_ids) if plp is not None else 0)  # (a stream: not yet computed)
    out: dict[str, list] = {
        "input_token_logprobs": first
        + [[_lp(plp[t][prompt_ids[t]].logprob), prompt_ids[t], text(prompt_ids[t])] for t in rest]
    }
    if top > 0:
        out["input_top_logprobs"] = [None] * len(first) + [
            [[_lp(e.logprob), i, text(i)] for i, e in top_k(plp[t], top)] for t in rest
        ]
    return out
