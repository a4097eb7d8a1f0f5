"""The fields sglang-router (SGLang Model Gateway) and SGLang clients add to a request.

The router parses a request into its own types and sends that out again, filling each field
it knows with SGLang's default: `/v1/completions` gets `no_stop_trim`, `ignore_eos`,
`skip_special_tokens`, `echo`, `return_hidden_states`; `/v1/chat/completions` those plus
`continue_final_message`, `separate_reasoning` and `stream_reasoning`; `/generate` gets
`model`, `return_text_in_logprobs`, `log_metrics`, `return_hidden_states`, `background`,
`no_logs`, `return_bytes`, `return_entropy` (sglang-router 0.3.2, seen on the wire). The
request models forbid unknown fields (a typo is a 400), so each of these is declared, and
each is honoured, or accepted where every value means what hotswap does, or refused (a 400
naming it) when it asks for what hotswap does not do:

- `no_stop_trim` (SGLang's name of vLLM's `include_stop_str_in_output`): honoured, a matched
  stop string stays at the end of the text;
- `separate_reasoning`, `stream_reasoning`: accepted, either value; hotswap has no reasoning
  parser, and SGLang without `--reasoning-parser` ignores them too;
- `no_logs`: accepted, either value; hotswap never logs a request's contents;
- `model` on `/generate`: the served name or a LoRA adapter's, as on `/v1/*`;
- `return_hidden_states`, `background`, `return_bytes`, `return_entropy`: refused when true;
- `log_metrics`: refused when false (every request is counted in `/metrics`).
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from hotswap.errors import RequestError

# field -> (the one value hotswap serves, why another is refused)
_ONLY = {
    "return_hidden_states": (False, "hidden states are not returned by this server"),
    "background": (False, "background requests are not run by this server; send it and wait"),
    "return_bytes": (False, "token bytes are not returned by this server"),
    "return_entropy": (False, "per-token entropy is not returned by this server"),
    "log_metrics": (True, "every request is counted in /metrics (none can be excluded)"),
}


def refuse_unserved(body: BaseModel) -> None:
    """A 400 naming the first of `_ONLY`'s fields that `body` declares and sets otherwise."""
    for name, (served, why) in _ONLY.items():
        if name in type(body).model_fields and getattr(body, name) != served:
            got, keep = json.dumps(getattr(body, name)), json.dumps(served)
            raise RequestError.of_field(name, f"{why} (got {got}; send {keep} or leave it out)")
