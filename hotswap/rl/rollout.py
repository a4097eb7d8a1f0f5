"""Rollouts from the in-process engine, with the evidence that no KV was stale.

`rollout_local` drives `Engine.add_request` / `Engine.step` the way
`LLM.generate` does, and after every step looks at the sequences the scheduler
has just admitted: the KV pages each one reused (prefix-cache hits and the
prompt pages its `n` siblings share) must have been written under the weights
version now serving, according to `state.kv.page_version`. Together with the
per-token `weights_versions` and the trainer's independent recomputation of
every logprob (`grpo.max_mismatch`), that is the demo's stale-KV check.
"""

from __future__ import annotations

import dataclasses
import time

from hotswap.engine.llm import LLM
from hotswap.engine.sampling import SamplingParams


@dataclasses.dataclass
class Sample:
    """One completion; `group` is its prompt's index (GRPO normalises rewards within a group)."""

    group: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the engine's (or server's) raw-distribution log-prob of each token
    versions: list[int]  # the weights version that produced each token
    # --via-http only: (position, candidate ids) of tokens whose text maps to several ids.
    ambiguous: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Rollout:
    samples: list[Sample]
    version: int  # the weights version serving when the rollout started
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    first_cached_tokens: int  # of the step's first request: the cache was just emptied, so must be 0
    stale_pages: int  # reused KV pages written under another version (local engine only)
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    @property
    def stale_tokens(self) -> int:
        return sum(v != self.version for s in self.samples for v in s.versions)


def _audit_admitted(engine, version: int, seen: set[int]) -> int:
    """Reused pages of newly admitted sequences whose recorded writer is not `version`."""
    ps, page_version = engine.ecfg.page_size, engine.state.kv.page_version
    stale = 0
    for seq in engine.sched.running:
        if seq.seq_id in seen:
            continue
        seen.add(seq.seq_id)
        # num_cached_tokens counts whole reused pages at the front of the block table.
        reused = engine.state.pool.table(seq.seq_id)[: seq.num_cached_tokens // ps]
        stale += sum(int(page_version[p]) != version for p in reused)
    return stale


def rollout_local(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> Rollout:
    """Generate every prompt (n samples each) on the in-process engine, auditing page provenance."""
    engine, t0 = llm.engine, time.perf_counter()
    version = engine.weights_version
    done: dict = {}
    rids = [
        engine.add_request(None, p, sp, sink=lambda o: done.__setitem__(o.request_id, o))
        for p, sp in zip(prompts, params, strict=True)
    ]
    seen: set[int] = set()
    stale = 0
    while len(done) < len(rids):
        engine.step()
        stale += _audit_admitted(engine, version, seen)
    outs = [done[r] for r in rids]
    samples = [
        Sample(g, list(o.prompt_token_ids), c.token_ids, c.logprobs, c.weights_versions)
        for g, o in enumerate(outs)
        for c in o.outputs
    ]
    return Rollout(
        samples=samples,
        version=version,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
        cached_tokens=sum(o.num_cached_tokens for o in outs),
        first_cached_tokens=outs[0].num_cached_tokens,
        stale_pages=stale,
        seconds=time.perf_counter() - t0,
    )
