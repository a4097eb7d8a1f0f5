"""Each token's kept set on the wire (`SamplingParams.return_kept_set`), the same fields on the
OpenAI routes (a choice, or a stream chunk's choice, for its tokens), the vLLM ones (those
routes under `/vllm`) and SGLang's `/generate` (`meta_info`):

- `kept_counts`: per token, the size of the set the sampler could draw it from (after the
  structured-output mask and the top-k/top-p/min-p filters; 1 for a greedy token);
- `kept_token_ids` (`return_kept_set: "ids"`): per token, that set's ids, ascending;
- `kept_masks` (`"mask"`): per token, that set as base64 of ceil(V / 32) little-endian uint32
  words, token t at bit t % 32 of word t // 32 (V / 8 bytes a token, whatever the set's size).

A trainer renormalising over the sampler's support reads the ids when the sets are small (a
top-k of 50 is 200 bytes a token as ids) and the mask when they are not.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from hotswap.engine.outputs import CompletionOutput


def kept_json(c: CompletionOutput, start: int = 0) -> dict[str, Any]:
    """The kept-set fields of `c`'s tokens [start:] (none unless the request asked)."""
    if c.kept_counts is None:
        return {}
    out: dict[str, Any] = {"kept_counts": c.kept_counts[start:]}
    if c.kept_token_ids is not None:
        out["kept_token_ids"] = [ids.tolist() for ids in c.kept_token_ids[start:]]
    if c.kept_masks is not None:
        out["kept_masks"] = [
            base64.b64encode(np.ascontiguousarray(w, "<i4").tobytes()).decode() for w in c.kept_masks[start:]
        ]
    return out
