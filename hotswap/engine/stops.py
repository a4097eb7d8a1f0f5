"""When a sequence stops after a sampled token: EOS, a stop token, a stop string, or a length."""

from __future__ import annotations

from hotswap.engine.sequence import Sequence


def finish_reason(seq: Sequence, tokenizer, max_model_len: int) -> tuple[str | None, int | str | None]:
    """(finish reason, stop reason) after seq's last token; (None, None) to go on."""
    p, t = seq.params, seq.output_ids[-1]
    if t in seq.eos_ids:
        return "stop", None
    if t in p.stop_token_ids:
        return "stop", t
    if p.stop and tokenizer is not None:
        text = tokenizer.decode(seq.output_ids, skip_special_tokens=p.skip_special_tokens)
        hit = next((s for s in p.stop if s in text), None)
        if hit is not None:
            return "stop", hit
    if p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens:
        return "length", None
    if seq.total_len >= max_model_len:
        return "length", None
    return None, None
