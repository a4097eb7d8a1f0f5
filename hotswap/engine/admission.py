"""Admission: requests in (checked against the limits, then queued) and out (aborted, or
delivered to their sink when finished or streaming).

It owns the requests table and holds new requests back while a drain or a pause is under way
(`holding`). Everything it checks raises before anything is queued, so a refused request
leaves no trace. The one `EngineState` is the Engine's (`StateRef`); admission reads it and,
to end sequences, replaces it, under the Engine's lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import uuid

import numpy as np

from hotswap.engine.adapters import AdapterError, Adapters
from hotswap.engine.outputs import RequestOutput, SequenceText, request_output
from hotswap.engine.sampling import SamplingParams
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.sequence import Request, Sequence, Sink
from hotswap.engine.state import EngineState, StateRef
from hotswap.engine.structured import Grammars
from hotswap.engine_config import EngineConfig
from hotswap.errors import EngineAsleep, PromptTooLong, QueueFull, RequestError
from hotswap.model.config import ModelConfig


def adapters_of(state: EngineState) -> Adapters:
    """The LoRA adapters the state serves by name; AdapterError when the engine has none."""
    if state.adapters is None:
        raise AdapterError("LoRA adapters are served by name only when the engine has enable_lora=True")
    return state.adapters


class Admission:
    def __init__(
        self,
        mcfg: ModelConfig,
        ecfg: EngineConfig,
        tokenizer,
        *,
        ref: StateRef,
        sched: Scheduler,
        lock: threading.RLock,
        seed: int = 0,
    ):
        self.mcfg, self.ecfg, self.tokenizer = mcfg, ecfg, tokenizer
        self.ref, self.sched, self.lock = ref, sched, lock
        self.requests: dict[str, Request] = {}
        self.counts = {"prompt_tokens": 0, "cached_tokens": 0}
        self._ids = itertools.count()
        self._rng = np.random.default_rng(seed)
        eos = set(mcfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_ids = tuple(sorted(eos))
        # The constraint compiler, built on the first constrained request (engine/structured.py).
        self.grammars: Grammars | None = None

    # ---- in -----------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer: pass prompt token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.mcfg.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.mcfg.vocab_size})")
        return None, ids

    def add(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        sink: Sink | None = None,
        stream: bool = False,
        lora_name: str | None = None,
    ) -> str:
        """Validate and queue (`Engine.add_request`)."""
        params = params or SamplingParams()
        text, ids = self.tokenize(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.ecfg.max_model_len:
            raise PromptTooLong(
                f"prompt has {len(ids)} tokens; max_model_len is {self.ecfg.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        if params.return_routed_experts and not self.mcfg.num_experts:
            raise RequestError(f"return_routed_experts: this {self.mcfg.arch} model has no experts")
        if self.ecfg.enable_return_routed_experts and not params.return_routed_experts:
            params = dataclasses.replace(params, return_routed_experts=True)
        matchers = self._matchers(params)
        rid = request_id or uuid.uuid4().hex
        with self.lock:
            if not self.ref.state.serving:  # paused is fine: the request waits in the queue
                raise EngineAsleep(
                    "the engine is asleep: call wakeup() (and update_weights after sleep level 2) first"
                )
            if rid in self.requests:
                raise RequestError(f"request id {rid!r} is already in use")
            if params.n > self.ecfg.max_waiting:
                raise RequestError(
                    f"n={params.n} exceeds the queue capacity max_waiting={self.ecfg.max_waiting}"
                )
            if len(self.sched.waiting) + params.n > self.ecfg.max_waiting:
                raise QueueFull(
                    f"{len(self.sched.waiting)} requests are waiting (max_waiting={self.ecfg.max_waiting})"
                )
            adapter = adapters_of(self.ref.state).get(lora_name) if lora_name is not None else None
            base_seed = int(self._rng.integers(2**31)) if params.seed is None else int(params.seed)
            arrival = next(self._ids)
            seqs: list[Sequence] = []
            for i in range(params.n):
                seqs.append(
                    Sequence(
                        seq_id=next(self._ids),
                        request_id=rid,
                        index=i,
                        prompt_ids=list(ids),
                        params=params,
                        seed=(base_seed + i * 0x9E3779B1) & 0xFFFFFFFF,
                        arrival=arrival,
                        eos_ids=() if params.ignore_eos else self.eos_ids,
                        fork_parent=seqs[0] if i > 0 else None,
                        lora_slot=adapter.slot if adapter else -1,
                        adapter=adapter.identity if adapter else (0, 0),
                        matcher=matchers[i],
                        output_text=SequenceText(self.tokenizer, params)
                        if self.tokenizer is not None
                        else None,
                    )
                )
            self.requests[rid] = Request(rid, text, ids, params, seqs, sink, stream)
            for s in seqs:
                self.sched.add(s)
            self.counts["prompt_tokens"] += len(ids)
        return rid

    def _matchers(self, params: SamplingParams) -> list:
        """One constraint matcher per sample (None: unconstrained); compiling the constraint
        here refuses a bad schema, regex or grammar before anything is queued."""
        so = params.structured_outputs
        if so is None:
            return [None] * params.n
        if self.tokenizer is None:
            raise RequestError("structured_outputs: this model has no tokenizer to constrain the output with")
        if self.grammars is None:
            self.grammars = Grammars(
                self.tokenizer,
                self.mcfg.vocab_size,
                self.eos_ids,
                strict_mode=self.ecfg.structured_outputs_strict_mode,
            )
        return [self.grammars.matcher(so) for _ in range(params.n)]

    @contextlib.contextmanager
    def holding(self):
        """New requests wait from entry to exit (a drain and the change that follows it);
        sequences that already started go on. Holds from concurrent calls stack."""
        with self.lock:
            self.sched.holds += 1
        try:
            yield
        finally:
            with self.lock:
                self.sched.holds -= 1

    # ---- out ----------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        with self.lock:
            req = self.requests.get(request_id)
            if req is None:
                return
            self.ref.state = self.sched.finish(self.ref.state, req.seqs, "abort")
            self.emit(req)

    def abort_seqs(self, seqs: list[Sequence]) -> None:
        """End these sequences (finish_reason "abort") and deliver their requests. Under the lock."""
        self.ref.state = self.sched.finish(self.ref.state, seqs, "abort")
        for rid in dict.fromkeys(s.request_id for s in seqs):
            if rid in self.requests:
                self.emit(self.requests[rid])

    def abort_all(self) -> None:
        self.abort_seqs([s for req in self.requests.values() for s in req.seqs])

    def deliver(self, touched: list[Sequence]) -> list[RequestOutput]:
        """A step's outputs: one per request whose sequences it touched, if finished or streaming."""
        reqs = dict.fromkeys(self.requests[s.request_id] for s in touched)
        return [o for o in map(self.emit, reqs) if o is not None]

    def emit(self, req: Request) -> RequestOutput | None:
        """Deliver to the request's sink; forget finished requests."""
        if not (req.finished or req.stream):
            return None
        out = request_output(req, self.ref.state.weights_version, self.tokenizer, self.ref.quantization)
        if req.finished:
            self.requests.pop(req.request_id, None)
            self.counts["cached_tokens"] += out.num_cached_tokens
        if req.sink is not None:
            req.sink(out)
        return out
