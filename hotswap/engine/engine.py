"""Engine: owns the current EngineState, the request queues and the lifecycle lock.

One re-entrant lock serialises every step and every lifecycle call (update,
sleep, wakeup, reset), so the step loop never runs during a transition. A step
is schedule -> run -> postprocess, each taking the state and (but for the run)
returning the next; lifecycle calls are the pure transitions of `lifecycle.py`
plus the in-flight policy, which only touches request bookkeeping: which pages
anyone holds is in the state the transition returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
import uuid

import jax
import numpy as np

from hotswap import host_memory
from hotswap.config import EngineConfig
from hotswap.engine import lifecycle, pausing, policies
from hotswap.engine.adapters import AdapterError, Adapters, Loaded
from hotswap.engine.outputs import RequestOutput, SequenceText, request_output
from hotswap.engine.runner import Runner
from hotswap.engine.sampling import SamplingParams
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.sequence import Request, Sequence, Sink
from hotswap.engine.state import empty_state, new_kv_cache
from hotswap.engine.structured import Grammars
from hotswap.errors import (
    ConfigError,
    EngineAsleep,
    LifecycleConflict,
    PromptTooLong,
    QueueFull,
    RequestError,
    WeightsLost,
    WeightsMismatch,
)
from hotswap.kernels.backend import Backend
from hotswap.model import sharding
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params, abstract_params
from hotswap.programs import compile_cache
from hotswap.weights import pipeline, place, plan, readers
from hotswap.weights.chunks import ChunkStager
from hotswap.weights.options import UpdateOptions


class Engine:
    def __init__(
        self,
        mcfg: ModelConfig,
        params: Params,
        ecfg: EngineConfig,
        tokenizer=None,
        *,
        warmup: bool = True,
        progress: bool = True,
        weights_root: str | None = None,
        shardings: Params | None = None,
        kv_sharding=None,
        backend: Backend | None = None,
        seed: int = 0,
    ):
        """`backend`: the Backend already chosen for these shardings (`catalog.Target.on`), with
        `kv_sharding` in its page layout; None: chosen here, once (`sharding.engine_backend`)."""
        # before anything compiles: warm-up can load
        self._cache_on = compile_cache.enable(ecfg.compilation_cache) is not None
        if jax.default_backend() == "cpu":
            host_memory.tune_allocator()  # device buffers are host malloc here (host_memory.py)
        if backend is None:
            backend, kv_sharding = sharding.engine_backend(
                mcfg, ecfg.attention, kv_sharding, deterministic=ecfg.deterministic
            )
        self.backend = backend
        ecfg = dataclasses.replace(ecfg, attention=self.backend.attention)
        self.mcfg, self.ecfg, self.tokenizer = mcfg, ecfg, tokenizer
        self.weights_root = weights_root
        self.kv_sharding = kv_sharding
        spec = abstract_params(mcfg)
        if shardings is not None:
            spec = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), spec, shardings
            )
        else:
            dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            spec = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), spec)
        self.abstract = spec
        platform = next(iter(spec["embed"].sharding.device_set)).platform
        self.staging = place.resolve(ecfg.weight_update_staging, platform)  # how updates stage
        # The first load is an update into an empty state: the same read -> plan -> place
        # (`params` is any weight source). The path was given by whoever built the engine, so
        # `weights_root` (which bounds later updates) does not apply to it.
        staged = pipeline.stage(params, mcfg, self.abstract)
        empty = empty_state(mcfg, ecfg, kv_sharding=kv_sharding, backend=self.backend)
        self.state = lifecycle.update_weights(empty, staged)  # version 1
        if ecfg.enable_lora:
            empty_adapters = Adapters.empty(mcfg, self.abstract, ecfg.max_loras, ecfg.max_lora_rank)
            self.state = dataclasses.replace(self.state, adapters=empty_adapters)
        if ecfg.enable_return_routed_experts and not mcfg.num_experts:
            raise ConfigError(f"enable_return_routed_experts: this {mcfg.arch} model has no experts")
        self.runner = Runner(mcfg, ecfg, self.backend)
        self.sched = Scheduler(ecfg, fill=self.runner.buckets.fill)
        self.requests: dict[str, Request] = {}
        self.stager = ChunkStager()
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._rng = np.random.default_rng(seed)
        eos = set(mcfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_ids = tuple(sorted(eos))
        self._counts = {"prompt_tokens": 0, "cached_tokens": 0, "steps": 0}
        self._pause_mode: str | None = None  # set by pause(): the engine does not step
        # The constraint compiler, built on the first constrained request (engine/structured.py).
        self.grammars: Grammars | None = None
        if warmup:
            self.runner.warmup(self.state.step_params, self.state.kv.pages, progress, cache=self._cache_on)

    # ---- views --------------------------------------------------------------

    @property
    def weights_version(self) -> int:
        return self.state.weights_version

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_running(self) -> int:
        return len(self.sched.running)

    def num_waiting(self) -> int:
        return len(self.sched.waiting)

    @property
    def can_step(self) -> bool:
        """Serving and not paused: the step loop (and a drain) may run a step."""
        return self.state.serving and self._pause_mode is None

    @property
    def stats(self) -> dict[str, int]:
        return {**self._counts, "generated_tokens": self.sched.num_generated}

    def check_invariants(self) -> None:
        """Refcounts equal the owners the state's tables list; only running sequences hold pages."""
        with self._lock:
            self.sched.check(self.state)

    # ---- requests -----------------------------------------------------------

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

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        sink: Sink | None = None,
        stream: bool = False,
        lora_name: str | None = None,
    ) -> str:
        """Validate and queue. Raises before anything is queued, so a refused request leaves no trace.
        `lora_name`: a LoRA adapter loaded by name (`load_lora_adapter`) to serve it with."""
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
        with self._lock:
            if not self.state.serving:  # paused is fine: the request waits in the queue
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
            adapter = self._adapters().get(lora_name) if lora_name is not None else None
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
            self._counts["prompt_tokens"] += len(ids)
        return rid

    # ---- LoRA adapters served by name (engine/adapters.py) ----------------------------

    def _adapters(self) -> Adapters:
        if self.state.adapters is None:
            raise AdapterError("LoRA adapters are served by name only when the engine has enable_lora=True")
        return self.state.adapters

    def load_lora_adapter(self, name: str, source, *, lora_alpha: float | None = None) -> Loaded:
        """Load (or reload: version + 1) the adapter `name` from a PEFT directory (under the
        weights root), bytes or tensors, written in place into its buffer slot: no step
        recompiles. Read and validated (rank <= max_lora_rank, target modules, shapes, NaN)
        before the lock; a bad adapter changes nothing."""
        self._adapters().check_room(name)
        opened = readers.read(source, self.mcfg, weights_root=self.weights_root, abstract=self.abstract)
        if opened.adapter is None:
            raise WeightsMismatch(
                "not a LoRA adapter: pass a PEFT adapter directory (adapter_config.json and "
                "adapter_model.safetensors), PEFT-named safetensors or tensors"
            )
        options = UpdateOptions(lora_alpha=lora_alpha)
        checked = plan.plan(
            opened, self.mcfg, self.abstract, options=options, max_lora_rank=self.ecfg.max_lora_rank
        )
        factors = place.factors(checked)
        adapter = opened.adapter
        with self._lock:
            self._refuse_in_use(name)
            new = self._adapters().load(name, factors, source if isinstance(source, str) else adapter.where)
            self.state = dataclasses.replace(self.state, adapters=new)
            return new.get(name)

    def unload_lora_adapter(self, name: str) -> None:
        with self._lock:
            self._adapters().get(name)
            self._refuse_in_use(name)
            self.state = dataclasses.replace(self.state, adapters=self._adapters().unload(name))

    def lora_adapters(self) -> tuple[Loaded, ...]:
        return self.state.adapters.loaded if self.state.adapters is not None else ()

    def _refuse_in_use(self, name: str) -> None:
        """A reload or unload would change the slot under requests in flight: 409 until they end."""
        adapters = self._adapters()
        if not adapters.has(name):
            return
        ident = adapters.get(name).identity
        busy = sum(s.adapter == ident for s in (*self.sched.running, *self.sched.waiting))
        if busy:
            raise LifecycleConflict(
                f"LoRA adapter {name!r} serves {busy} sequence(s) in flight; retry when they end"
            )

    def _matchers(self, params: SamplingParams) -> list:
        """One constraint matcher per sample (None: unconstrained); compiling the constraint
        here refuses a bad schema, regex or grammar before anything is queued."""
        so = params.structured_outputs
        if so is None:
            return [None] * params.n
        if self.tokenizer is None:
            raise RequestError("structured_outputs: this model has no tokenizer to constrain the output with")
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.mcfg.vocab_size, self.eos_ids)
        return [self.grammars.matcher(so) for _ in range(params.n)]

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self.requests.get(request_id)
            if req is None:
                return
            self.state = self.sched.finish(self.state, req.seqs, "abort")
            self._emit(req)

    # ---- the step -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run, postprocess. Returns outputs of finished (and streaming) requests."""
        with self._lock:
            if not self.can_step:
                return []
            return self._step_locked()

    def _step_locked(self) -> list[RequestOutput]:
        plan, self.state = self.sched.schedule(self.state)
        if plan.empty:
            return []
        try:
            pages, out = self.runner.run(self.state, plan)
        except Exception:
            # Donated buffers may be gone: recompute every running sequence over a fresh, empty
            # cache, so no accepted request is lost, then re-raise.
            self._recover()
            raise
        self.state, touched = self.sched.postprocess(self.state.with_pages(pages), plan, out)
        self._counts["steps"] += 1
        reqs = dict.fromkeys(self.requests[s.request_id] for s in touched)
        return [o for o in map(self._emit, reqs) if o is not None]

    def _recover(self) -> None:
        self.state = self.sched.preempt_running(self.state)
        self.state = lifecycle.fresh_cache(
            self.state, new_kv_cache(self.mcfg, self.ecfg, sharding=self.kv_sharding, backend=self.backend)
        )

    # ---- outputs ------------------------------------------------------------

    def _emit(self, req: Request) -> RequestOutput | None:
        """Deliver to the request's sink; forget finished requests."""
        if not (req.finished or req.stream):
            return None
        out = request_output(req, self.state.weights_version)
        if req.finished:
            self.requests.pop(req.request_id, None)
            self._counts["cached_tokens"] += out.num_cached_tokens
        if req.sink is not None:
            req.sink(out)
        return out

    # ---- lifecycle ----------------------------------------------------------

    def update_weights(self, source, options: UpdateOptions | None = None, **fields) -> int:
        """Read -> plan -> place -> apply the in-flight policy (policies.py) -> swap. Returns the
        new version. `options` (or its fields as keywords): `weights/options.py`.

        The source is read, checked and placed before the lock is taken, so serving
        continues meanwhile and a bad source changes nothing. A LoRA adapter is merged into
        the base weights (the state's `base`, kept on the device; `lora_alpha` when the source
        does not state it); full weights replace the base. In place (`weight_update_staging`,
        `weights/place.py`) the source is checked first and written over the serving
        weights under the lock, so the device holds one copy of them.
        """
        opts = UpdateOptions.of(options, **fields)
        row = policies.policy(opts.policy)
        # Outside the lock: serving goes on. A bad source is refused here, nothing touched.
        opened = readers.read(source, self.mcfg, weights_root=self.weights_root, abstract=self.abstract)
        checked = plan.plan(opened, self.mcfg, self.abstract, options=opts)
        st = self.state
        prepared = place.prepare(checked, self.staging, st.base if st.base is not None else st.params)
        del st  # nothing here may hold the serving weights past the swap
        with self._lock:
            if self.state.weights_on_host:
                raise EngineAsleep(
                    "weights are asleep (level 1): call wakeup(['weights']) before update_weights"
                )
            row = self._while_paused(row)
            if row.refuses_if_busy:
                busy = len(self.sched.running) + len(self.sched.waiting)
                if busy or self.state.prefix.num_cached:
                    raise LifecycleConflict(
                        f"policy 'reject': {busy} request(s) in flight and {self.state.prefix.num_cached} "
                        "cached page(s); use policy 'drain', 'abort' or 'recompute', or wait until idle and "
                        "call reset_prefix_cache() first"
                    )
        timeout_s = opts.drain_timeout_s if opts.drain_timeout_s is not None else self.ecfg.drain_timeout_s
        with self._drained(row.drains, timeout_s):
            with self._lock:
                row = self._while_paused(row)  # a pause landed during the drain: its mode decides
                staged = prepared.staged or self._write_in_place(prepared)
                keep = [s.seq_id for s in self.sched.running] if row.keeps_tables else []
                new = lifecycle.update_weights(self.state, staged, version=opts.version, keep=keep)
                self._apply_policy(row)  # requests only: the new state already holds no other page
                self.state = new
                if row.keeps_tables:
                    self._recompute_stale()
                return self.state.weights_version

    def _write_in_place(self, prepared: place.Prepared) -> place.StagedParams:
        """Pass 2 of an in-place update, under the lock: drop the serving leaves it replaces, then
        write the checked source into their room. If the device fails meanwhile, the weights are
        gone: the state stays without them (as after sleep level 2), requests in flight are
        aborted, and WeightsLost says so."""
        replaced = prepared.plan.replaced
        current = self.state.base if self.state.base is not None else self.state.params
        kept = place.keeping(current, replaced) if replaced is not None else None
        self.state = lifecycle.drop_weights(self.state)
        del current  # the replaced leaves' last holder: dropped, they free their device memory
        try:
            return place.write(prepared, kept)
        except Exception as e:
            self._abort_all()  # nothing can step without weights: in-flight requests end, aborted
            raise WeightsLost(
                f"an in-place weight update failed while writing the checked weights ({type(e).__name__}: {e}); "
                "the old weights were already released, so the engine serves nothing until the next "
                "update_weights loads a full set"
            ) from e

    def _while_paused(self, row: policies.Policy) -> policies.Policy:
        """Paused, a draining update does not drain: the pause's mode already decided what happens
        to in-flight work, and its row names the policy (pausing.py)."""
        if self._pause_mode is not None and row.drains:
            return pausing.pause_mode(self._pause_mode).update
        return row

    @contextlib.contextmanager
    def _holding_admission(self):
        """New requests wait from entry to exit (a drain and the change that follows it);
        sequences that already started go on. Holds from concurrent calls stack."""
        with self._lock:
            self.sched.holds += 1
        try:
            yield
        finally:
            with self._lock:
                self.sched.holds -= 1

    @contextlib.contextmanager
    def _drained(self, drain: bool, timeout_s: float):
        """With `drain`: hold new requests, step until the started ones finish (abort them after
        `timeout_s`), and hold until the block, the change that follows, ends. Else nothing."""
        if not drain:
            yield
            return
        with self._holding_admission():
            self._drain(timeout_s)
            yield

    def _drain(self, timeout_s: float) -> None:
        """Step until started sequences finish on the old weights (abort after timeout). Called
        while holding admission, so nothing new starts meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                started = self.sched.started()
                if not started or not self.can_step:
                    return  # paused: the engine must not step (the caller applies the pause's mode)
                if time.monotonic() > deadline:
                    self._abort_seqs(started)
                    return
                self._step_locked()

    def _recompute_stale(self) -> None:
        """The staleness bound: kept sequences whose oldest KV is more than max_version_lag
        versions behind are recomputed (their pages released, tokens kept)."""
        old = pausing.stale(self.sched.running, self.state.weights_version, self.ecfg.max_version_lag)
        if old:
            self.state = self.sched.preempt(self.state, old)

    def _abort_seqs(self, seqs: list[Sequence]) -> None:
        self.state = self.sched.finish(self.state, seqs, "abort")
        for rid in dict.fromkeys(s.request_id for s in seqs):
            if rid in self.requests:
                self._emit(self.requests[rid])

    def _abort_all(self) -> None:
        self._abort_seqs([s for req in self.requests.values() for s in req.seqs])

    def _apply_policy(self, row: policies.Policy) -> None:
        """What an update does to in-flight requests (its row in policies.py); the pages a kept
        sequence holds are the update's to keep."""
        if row.aborts:
            self._abort_seqs(self.sched.started())
        if row.recomputes:
            self.state = self.sched.preempt_running(self.state)
        if row.marks_mixed:
            for s in self.sched.running:
                s.mixed_kv = True

    # ---- pause / resume -------------------------------------------------------

    def pause(self, mode: str = "abort", *, clear_cache: bool = False) -> None:
        """Stop stepping until `resume()`; `mode` decides what happens to in-flight requests
        (pausing.py). Updates made while paused apply without their own drain. `clear_cache`
        empties the prefix index (running sequences keep their pages)."""
        row = pausing.pause_mode(mode)
        with self._drained(row.drains, self.ecfg.drain_timeout_s):
            with self._lock:
                if row.aborts:
                    self._abort_all()
                if row.retracts:
                    self.state = self.sched.preempt_running(self.state)
                if clear_cache:
                    self.state = lifecycle.reset_prefix_cache(self.state)
                self._pause_mode = row.name

    def resume(self) -> None:
        """Step again: held, retracted and newly queued requests go on under the current weights."""
        with self._lock:
            self._pause_mode = None

    @property
    def is_paused(self) -> bool:
        return self._pause_mode is not None

    @property
    def pause_mode(self) -> str | None:
        return self._pause_mode

    def update_weights_chunk(
        self,
        tensors_or_bytes,
        *,
        finished: bool,
        update_id: str | None = None,
        content_type: str = "application/octet-stream",
        options: UpdateOptions | None = None,
        **fields,
    ) -> int | None:
        """Stage one chunk (HF-named tensors, payload bytes, or a parsed JSON `tensors` list);
        on `finished`, commit every staged tensor atomically, as one update run with `options`."""
        opts = UpdateOptions.of(options, **fields)  # refused before anything is staged
        tensors = readers.wire_tensors(tensors_or_bytes, content_type)
        merged = self.stager.add(tensors, finished=finished, update_id=update_id)
        if merged is None:
            return None
        return self.update_weights(merged, opts)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free device memory. mode 'abort' ends in-flight requests now; 'wait' drains them first."""
        drains = lifecycle.sleep_drains(level, mode)  # a bad level or mode changes nothing
        with self._drained(drains, self.ecfg.drain_timeout_s):
            with self._lock:
                new = lifecycle.sleep(self.state, level)  # no page held in it: every request ends
                self._abort_all()
                self.state = new
        host_memory.release_free_memory()  # the freed buffers go back to the OS, not the heap

    def wakeup(self, tags: list[str] | None = None) -> None:
        with self._lock:
            self.state = lifecycle.wakeup(
                self.state,
                tags,
                abstract=self.abstract,
                mcfg=self.mcfg,
                ecfg=self.ecfg,
                kv_sharding=self.kv_sharding,
                backend=self.backend,
            )

    @property
    def is_sleeping(self) -> bool:
        return bool(self.state.asleep)

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self.state = lifecycle.reset_prefix_cache(self.state)
