"""The demo's task: count up one digit at a time, scored by a program (no reward model).

Every prompt is one shared instruction plus a start digit, so the prompts of a
step share their leading KV pages (prefix-cache hits). A random-init tiny model
writes digits about 2% of the time; GRPO first learns "write digits", then the
bigram "digit d is followed by d+1 (mod 10)", which the model can express
directly through its embeddings and LM head, so the reward climbs within a few
hundred cheap steps.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# 24 tokens with the tiny preset's tokenizer (BOS included): with page_size 8 and the start
# digit appended, three full pages are shared by every prompt of a step.
INSTRUCTION = "The robot counts the boats one at a time and writes the number:"
DIGIT_CREDIT = 0.25  # any digit earns a little; the successor of the previous token earns the rest


@dataclasses.dataclass(frozen=True)
class CountTask:
    """digit_ids[d] is the token of the digit d; prefix_ids is BOS + the instruction."""

    digit_ids: tuple[int, ...]
    prefix_ids: tuple[int, ...]

    @staticmethod
    def from_tokenizer(tok) -> CountTask:
        digits = tuple(tok.token_to_id(str(d)) for d in range(10))
        if any(
            t is None or tok.decode([t], skip_special_tokens=False) != str(d) for d, t in enumerate(digits)
        ):
            raise ValueError("the tokenizer has no single-token digits 0-9; the count task needs them")
        return CountTask(digit_ids=digits, prefix_ids=tuple(tok.encode(INSTRUCTION)))

    def prompts(self, rng: np.random.Generator, k: int) -> list[list[int]]:
        """k prompts: the shared prefix plus a random start digit each."""
        return [[*self.prefix_ids, self.digit_ids[d]] for d in rng.integers(0, 10, k)]

    def reward(self, prompt_ids: list[int], completion_ids: list[int]) -> float:
        """Mean per-token score in [0, 1]: DIGIT_CREDIT for a digit, 1 for the previous digit + 1."""
        value = {t: d for d, t in enumerate(self.digit_ids)}
        prev, score = value.get(prompt_ids[-1]), 0.0
        for t in completion_ids:
            d = value.get(t)
            if d is not None:
                score += 1.0 if prev is not None and d == (prev + 1) % 10 else DIGIT_CREDIT
            prev = d
        return score / max(len(completion_ids), 1)
