"""Prompt-lookup drafts (speculative_config method "ngram"): the tokens that followed an earlier
occurrence of the sequence's last n tokens, in its prompt or its output so far.

Input-grounded work (an edit, an extraction, a summary, a refactor of given code) copies long
runs of its input, so the run that followed the last n tokens last time is a good guess of what
follows now; free generation rarely repeats, and then nothing is proposed and the row decodes as
it would without speculation. The longest n in [lo, hi] that occurs wins (a longer match is a
surer guess), and of its occurrences the latest that has k tokens after it (the nearest
context), else the earliest (the most tokens after it: a run that repeats itself).
"""

from __future__ import annotations

import numpy as np


def propose(ids: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Up to k tokens to follow `ids`; [] when no n-gram of the last n in [lo, hi] tokens occurs
    earlier with a token after it."""
    a = np.asarray(ids, np.int64)
    for n in range(min(hi, len(a) - 1), lo - 1, -1):
        # windows that end before the last token: each is followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(a[:-1], n)
        hits = np.flatnonzero((windows == a[-n:]).all(axis=1))
        if len(hits):
            whole = hits[hits + n + k <= len(a)]
            start = int(whole[-1] if len(whole) else hits[0]) + n
            return a[start : start + k].tolist()
    return []
