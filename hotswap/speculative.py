"""`SpeculativeConfig`: the `speculative_config` option (vLLM's shape), parsed and checked once.

A user gives it as vLLM's users do: a dict to `LLM(..., speculative_config={...})`, a JSON
object to `--speculative-config '{...}'`. Methods:

- `ngram` (prompt lookup): the draft is what followed the latest earlier occurrence of the
  sequence's last n tokens, for the longest n in [`prompt_lookup_min`, `prompt_lookup_max`]
  that occurs (engine/ngram.py). vLLM's defaults: both 5 when neither is given, else the one
  given for the other.
- `draft_model` with `model: "self"`: the target's own first `draft_layers` layers, its final
  norm and its head (self-speculation, as in LayerSkip), a draft any model here has without a
  second checkpoint; its KV is the target's KV of those layers, in the same pages.
- `draft_model` with `model: <path>`: a separate draft checkpoint (any the engine loads: an HF
  directory, a GGUF file) with the target's vocabulary; its own params and KV buffers, indexed
  by the target's pages (engine/draft_model.py), with a version of its own.

Imports nothing heavy (the CLI parses it before JAX is loaded).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hotswap.errors import ConfigError

METHODS = ("ngram", "draft_model")
SELF = "self"  # `model` of a draft made from the target's own first layers
# A verification feeds the last token and its draft as one chunk; the packed-prefill backends
# lay a chunk in rows of 16 (programs/step.py PREFILL_ROW), and one row per verifying sequence
# keeps its samples in one place.
MAX_SPECULATIVE_TOKENS = 15
# Sequences that verify a draft in one step at most. Each draft token is one more sampled row
# (its logits over the vocabulary), and every step whose tokens outnumber the running sequences
# (a prefill) pays for those rows whether it verifies or not; speculation pays at small batches
# (the tail of a rollout), where decoding is bound by reading the weights once per token.
MAX_VERIFYING_ROWS = 32
_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "draft_layers",
    "disable_by_batch_size",
}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0
    model: str | None = None  # draft_model only: "self" or a draft checkpoint's path
    draft_layers: int = 0  # draft_model "self": how many of the target's first layers draft
    # vLLM's: no sequence drafts in a step while at least this many run (None: always draft).
    # A large batch is compute-bound: verifying drafts there costs more than it yields.
    disable_by_batch_size: int | None = None

    @staticmethod
    def parse(value: Any) -> SpeculativeConfig | None:
        """A dict, a JSON string or a `SpeculativeConfig` -> a checked `SpeculativeConfig`; None
        (or an empty dict) is no speculation. Every mistake is a ConfigError naming the key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be an object, got {type(value).__name__}")
        if not value:
            return None
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        method = value.get("method")
        if method not in METHODS:
            raise ConfigError(f"speculative_config.method={method!r}; use one of {', '.join(METHODS)}")
        k = _int(value, "num_speculative_tokens")
        if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
            )
        off = _int(value, "disable_by_batch_size")
        if off is not None and off < 1:
            raise ConfigError(f"speculative_config.disable_by_batch_size must be >= 1, got {off}")
        config = _ngram(value, k) if method == "ngram" else _draft(value, k)
        return dataclasses.replace(config, disable_by_batch_size=off)

    def drafts_with(self, running: int) -> bool:
        """Whether sequences draft in a step of `running` sequences (`disable_by_batch_size`)."""
        return self.disable_by_batch_size is None or running < self.disable_by_batch_size

    def check_model(self, num_layers: int) -> None:
        """What can only be checked against the target: a self-draft shorter than the model."""
        if self.method == "draft_model" and self.model == SELF and not 1 <= self.draft_layers < num_layers:
            raise ConfigError(
                f"speculative_config.draft_layers must be in [1, {num_layers - 1}] for this "
                f"{num_layers}-layer model, got {self.draft_layers}"
            )

    def describe(self) -> str:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v not in (None, 0)})


def _int(value: dict, key: str) -> int | None:
    v = value.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise ConfigError(f"speculative_config.{key} must be an integer, got {v!r}")
    return v


def _ngram(value: dict, k: int) -> SpeculativeConfig:
    for key in ("model", "draft_layers"):
        if key in value:
            raise ConfigError(f"speculative_config.{key} is a draft_model key, not ngram's")
    lo, hi = _int(value, "prompt_lookup_min"), _int(value, "prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    if not 1 <= lo <= hi:
        raise ConfigError(
            f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}"
        )
    return SpeculativeConfig("ngram", k, prompt_lookup_min=lo, prompt_lookup_max=hi)


def _draft(value: dict, k: int) -> SpeculativeConfig:
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in value:
            raise ConfigError(f"speculative_config.{key} is an ngram key, not draft_model's")
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise ConfigError(
            f'speculative_config.model={model!r}: draft_model takes "self" (the target\'s first '
            "`draft_layers` layers and its head) or the path of a draft checkpoint"
        )
    layers = _int(value, "draft_layers")
    if model != SELF:
        if layers is not None:
            raise ConfigError('speculative_config.draft_layers is for model "self", not a draft checkpoint')
        return SpeculativeConfig("draft_model", k, model=model)
    if layers is None or layers < 1:
        raise ConfigError(f"speculative_config.draft_layers must be >= 1, got {layers}")
    return SpeculativeConfig("draft_model", k, model=SELF, draft_layers=layers)


def verified_per_step(config: SpeculativeConfig | None, max_num_seqs: int) -> int:
    """Draft tokens one step verifies at most (0: no speculation): what the step programs size
    their sampled rows for, and what the scheduler keeps a step within."""
    if config is None:
        return 0
    return config.num_speculative_tokens * min(max_num_seqs, MAX_VERIFYING_ROWS)
