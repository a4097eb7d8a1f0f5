"""Prompt log-probs on the host: what the step returned for each prompt chunk, kept per sequence
until the prompt is whole, then vLLM's `RequestOutput.prompt_logprobs`.

`SamplingParams.prompt_logprobs = k` asks, for every prompt token after the first, its log-prob
given the tokens before it, its rank, and the k most likely tokens at that position. The step
program computes them from the prefill's own hidden states (`programs/prompt_logprobs.py`); the
runner asks for them chunk by chunk (`targets`) and hands each chunk's back (`PromptRecord.record`),
so a prompt spread over several steps (chunked prefill) fills in step by step.

A request that asks never reuses cached prefix pages (`Scheduler._match_prefix`): a cached
page holds K/V, not the log-probs of its tokens, so its positions are recomputed, as vLLM V1
does. Only the first sample of an `n > 1` request computes them (the others share its prompt).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Logprob:
    """vLLM's `Logprob`: a token's log-prob, its rank among the vocabulary (1: the likeliest)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def asks(seq) -> bool:
    """Whether the step computes prompt log-probs for this sequence's prompt chunks."""
    return seq.params.prompt_logprobs is not None and seq.fork_parent is None


def targets(seq, start: int, n: int) -> np.ndarray:
    """For the chunk of positions [start, start + n): the prompt token each position predicts
    (position t: token t + 1), -1 past the prompt's last token (a generated token's position,
    after a preemption, or the last prompt token, which predicts the first sample)."""
    prompt = seq.prompt_ids
    out = np.full(n, -1, np.int32)
    stop = min(start + n, len(prompt) - 1)  # positions with a next prompt token
    if stop > start:
        out[: stop - start] = prompt[start + 1 : stop + 1]
    return out


@dataclasses.dataclass
class PromptRecord:
    """Per prompt token t (index t of the prompt; 0 has no context and stays unset): its
    log-prob, rank and, with k > 0, the top-k (ids and log-probs) at position t - 1."""

    logprobs: np.ndarray  # f32 [P]
    ranks: np.ndarray  # i32 [P]
    top_ids: np.ndarray  # i32 [P, k]
    top_lps: np.ndarray  # f32 [P, k]
    done: np.ndarray  # bool [P]: computed

    @staticmethod
    def empty(prompt_len: int, k: int) -> PromptRecord:
        return PromptRecord(
            logprobs=np.zeros(prompt_len, np.float32),
            ranks=np.zeros(prompt_len, np.int32),
            top_ids=np.zeros((prompt_len, k), np.int32),
            top_lps=np.zeros((prompt_len, k), np.float32),
            done=np.zeros(prompt_len, bool),
        )

    @property
    def complete(self) -> bool:
        return bool(self.done[1:].all())

    def record(self, start: int, lp: np.ndarray, rank: np.ndarray, top_ids: np.ndarray, top_lps: np.ndarray):
        """The step's results for chunk positions [start, start + len(lp)): position t gives
        token t + 1's; positions past the prompt's second-to-last token are ignored."""
        n = max(0, min(len(lp), len(self.logprobs) - 1 - start))
        at = slice(start + 1, start + 1 + n)
        k = self.top_ids.shape[1]
        self.logprobs[at], self.ranks[at], self.done[at] = lp[:n], rank[:n], True
        self.top_ids[at], self.top_lps[at] = top_ids[:n, :k], top_lps[:n, :k]

    def to_vllm(self, prompt_ids: list[int], decode) -> list[dict[int, Logprob] | None]:
        """vLLM's shape: None for the first token, then per token a dict token id -> Logprob
        holding the prompt's token first, then the top-k (the prompt's token once, if among
        them). `decode(id) -> str | None`."""
        out: list[dict[int, Logprob] | None] = [None]
        for t in range(1, len(prompt_ids)):
            tid = int(prompt_ids[t])
            entry = {tid: Logprob(float(self.logprobs[t]), int(self.ranks[t]), decode(tid))}
            for r, (i, lp) in enumerate(zip(self.top_ids[t].tolist(), self.top_lps[t].tolist(), strict=True)):
                if i not in entry:
                    entry[i] = Logprob(float(lp), r + 1, decode(i))
            out.append(entry)
        return out[: len(prompt_ids)]
