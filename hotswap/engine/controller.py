"""LifecycleController: every change to a serving engine that is not a step. Weight updates
(whole or in chunks), LoRA adapters served by name, pause/resume, sleep/wakeup and the prefix
cache reset.

Each is a pure transition of `lifecycle.py` on the one `EngineState` (the Engine's, through
`StateRef`) plus the in-flight policy (`policies.py`, `pausing.py`), which only touches request
bookkeeping: which pages anyone holds is in the state the transition returns. Every change
happens under the Engine's lock, so the step loop never runs during one; a drain steps the
engine itself, through the `step` it is given, while admission holds new requests back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable

from hotswap import host_memory
from hotswap.engine import lifecycle, pausing, policies
from hotswap.engine.adapters import Loaded
from hotswap.engine.admission import Admission, adapters_of
from hotswap.engine.outputs import RequestOutput
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.state import StateRef
from hotswap.engine_config import EngineConfig
from hotswap.errors import (
    BaseVersionMismatch,
    EngineAsleep,
    LifecycleConflict,
    WeightsLost,
    WeightsMismatch,
)
from hotswap.kernels.backend import Backend
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.weights import place, plan, readers
from hotswap.weights.chunks import ChunkStager
from hotswap.weights.options import UpdateOptions


class LifecycleController:
    def __init__(
        self,
        mcfg: ModelConfig,
        ecfg: EngineConfig,
        *,
        abstract: Params,
        staging: str,
        weights_root: str | None,
        kv_sharding,
        backend: Backend,
        ref: StateRef,
        sched: Scheduler,
        lock: threading.RLock,
        admission: Admission,
        step: Callable[[], list[RequestOutput]],
    ):
        """`step`: one step under the lock (`Engine._step_locked`), run by a drain."""
        self.mcfg, self.ecfg = mcfg, ecfg
        self.abstract, self.staging = abstract, staging
        self.weights_root = weights_root  # bounds the paths an update may read (the server sets it)
        self.kv_sharding, self.backend = kv_sharding, backend
        self.ref, self.sched, self.lock = ref, sched, lock
        self.admission = admission
        self._step_locked = step
        self.stager = ChunkStager()
        self.pause_mode: str | None = None  # set by pause(): the engine does not step

    @property
    def can_step(self) -> bool:
        """Serving and not paused: the step loop (and a drain) may run a step."""
        return self.ref.state.serving and self.pause_mode is None

    # ---- weight updates --------------------------------------------------------

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
        policies.policy(opts.policy)  # an unknown policy is refused before the source is opened
        # Outside the lock: serving goes on. A bad source is refused here, nothing touched.
        opened = readers.read(source, self.mcfg, weights_root=self.weights_root, abstract=self.abstract)
        return self.update_planned(plan.plan(opened, self.mcfg, self.abstract, options=opts))

    def update_planned(self, checked: plan.Plan) -> int:
        """A source already read and checked (`plan.plan`, with its `UpdateOptions`): placed,
        then swapped under the in-flight policy. The multi-host driver and a per-process
        transfer call this with the plan they checked, so a source is checked once a process."""
        return self.commit_prepared(self.prepare_planned(checked))

    def prepare_planned(self, checked: plan.Plan) -> place.Prepared:
        """Pass 1 of a checked source, outside the lock (serving goes on): placed beside the
        serving weights, or (in place) its values checked. Nothing serving changes; dropping
        the result drops the update. A fleet stages this on every replica before any commits."""
        policies.policy(checked.options.policy)
        st = self.ref.state
        self._check_base(checked.options)  # a delta on other weights: refused before it is staged
        return place.prepare(checked, self.staging, st.base if st.base is not None else st.params)

    def commit_prepared(self, prepared: place.Prepared) -> int:
        """Pass 2: the in-flight policy, then the swap under the lock; the new version."""
        opts = prepared.plan.options
        row = policies.policy(opts.policy)
        with self.lock:
            if self.ref.state.weights_on_host:
                raise EngineAsleep(
                    "weights are asleep (level 1): call wakeup(['weights']) before update_weights"
                )
            self._check_base(opts)
            row = self._while_paused(row)
            if row.refuses_if_busy:
                busy = len(self.sched.running) + len(self.sched.waiting)
                if busy or self.ref.state.prefix.num_cached:
                    raise LifecycleConflict(
                        f"policy 'reject': {busy} request(s) in flight and {self.ref.state.prefix.num_cached} "
                        "cached page(s); use policy 'drain', 'abort' or 'recompute', or wait until idle and "
                        "call reset_prefix_cache() first"
                    )
        timeout_s = opts.drain_timeout_s if opts.drain_timeout_s is not None else self.ecfg.drain_timeout_s
        with self._drained(row.drains, timeout_s):
            with self.lock:
                row = self._while_paused(row)  # a pause landed during the drain: its mode decides
                self._check_base(opts)  # an update committed during the drain: this delta is stale
                staged = prepared.staged or self._write_in_place(prepared)
                keep = [s.seq_id for s in self.sched.running] if row.keeps_tables else []
                new = lifecycle.update_weights(self.ref.state, staged, version=opts.version, keep=keep)
                self._apply_policy(row)  # requests only: the new state already holds no other page
                self.ref.state = new
                if row.keeps_tables:
                    self._recompute_stale()
                return self.ref.state.weights_version

    def _check_base(self, opts: UpdateOptions) -> None:
        """A delta (`base_version`) applies only to the version it was computed against."""
        serving = self.ref.state.weights_version
        if opts.base_version is not None and opts.base_version != serving:
            raise BaseVersionMismatch(
                f"delta update computed against weights version {opts.base_version}, but version "
                f"{serving} is serving; recompute the delta against version {serving} or send the "
                "full weights"
            )

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

    def _write_in_place(self, prepared: place.Prepared) -> place.StagedParams:
        """Pass 2 of an in-place update, under the lock: drop the serving leaves it replaces, then
        write the checked source into their room. If the device fails meanwhile, the weights are
        gone: the state stays without them (as after sleep level 2), requests in flight are
        aborted, and WeightsLost says so."""
        replaced = prepared.plan.replaced
        current = self.ref.state.base if self.ref.state.base is not None else self.ref.state.params
        kept = place.keeping(current, replaced) if replaced is not None else None
        self.ref.state = lifecycle.drop_weights(self.ref.state)
        del current  # the replaced leaves' last holder: dropped, they free their device memory
        try:
            return place.write(prepared, kept)
        except Exception as e:
            self.admission.abort_all()  # nothing can step without weights: in-flight requests end, aborted
            raise WeightsLost(
                f"an in-place weight update failed while writing the checked weights ({type(e).__name__}: {e}); "
                "the old weights were already released, so the engine serves nothing until the next "
                "update_weights loads a full set"
            ) from e

    # ---- the in-flight policy ------------------------------------------------------

    def _while_paused(self, row: policies.Policy) -> policies.Policy:
        """Paused, a draining update does not drain: the pause's mode already decided what happens
        to in-flight work, and its row names the policy (pausing.py)."""
        if self.pause_mode is not None and row.drains:
            return pausing.pause_mode(self.pause_mode).update
        return row

    @contextlib.contextmanager
    def _drained(self, drain: bool, timeout_s: float):
        """With `drain`: hold new requests, step until the started ones finish (abort them after
        `timeout_s`), and hold until the block, the change that follows, ends. Else nothing."""
        if not drain:
            yield
            return
        with self.admission.holding():
            self._drain(timeout_s)
            yield

    def _drain(self, timeout_s: float) -> None:
        """Step until started sequences finish on the old weights (abort after timeout). Called
        while holding admission, so nothing new starts meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                started = self.sched.started()
                if not started or not self.can_step:
                    return  # paused: the engine must not step (the caller applies the pause's mode)
                if time.monotonic() > deadline:
                    self.admission.abort_seqs(started)
                    return
                self._step_locked()

    def _recompute_stale(self) -> None:
        """The staleness bound: kept sequences whose oldest KV is more than max_version_lag
        versions behind are recomputed (their pages released, tokens kept)."""
        old = pausing.stale(self.sched.running, self.ref.state.weights_version, self.ecfg.max_version_lag)
        if old:
            self.ref.state = self.sched.preempt(self.ref.state, old)

    def _apply_policy(self, row: policies.Policy) -> None:
        """What an update does to in-flight requests (its row in policies.py); the pages a kept
        sequence holds are the update's to keep."""
        if row.aborts:
            self.admission.abort_seqs(self.sched.started())
        if row.recomputes:
            self.ref.state = self.sched.preempt_running(self.ref.state)
        if row.marks_mixed:
            for s in self.sched.running:
                s.mixed_kv = True

    # ---- LoRA adapters served by name (engine/adapters.py) ----------------------------

    def load_lora_adapter(self, name: str, source, *, lora_alpha: float | None = None) -> Loaded:
        """Load (or reload: version + 1) the adapter `name` from a PEFT directory (under the
        weights root), bytes or tensors, written in place into its buffer slot: no step
        recompiles. Read and validated (rank <= max_lora_rank, target modules, shapes, NaN)
        before the lock; a bad adapter changes nothing."""
        adapters_of(self.ref.state).check_room(name)
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
        with self.lock:
            self._refuse_in_use(name)
            where = source if isinstance(source, str) else adapter.where
            new = adapters_of(self.ref.state).load(name, factors, where)
            self.ref.state = dataclasses.replace(self.ref.state, adapters=new)
            return new.get(name)

    def unload_lora_adapter(self, name: str) -> None:
        with self.lock:
            adapters_of(self.ref.state).get(name)
            self._refuse_in_use(name)
            self.ref.state = dataclasses.replace(
                self.ref.state, adapters=adapters_of(self.ref.state).unload(name)
            )

    def lora_adapters(self) -> tuple[Loaded, ...]:
        adapters = self.ref.state.adapters
        return adapters.loaded if adapters is not None else ()

    def _refuse_in_use(self, name: str) -> None:
        """A reload or unload would change the slot under requests in flight: 409 until they end."""
        adapters = adapters_of(self.ref.state)
        if not adapters.has(name):
            return
        ident = adapters.get(name).identity
        busy = sum(s.adapter == ident for s in (*self.sched.running, *self.sched.waiting))
        if busy:
            raise LifecycleConflict(
                f"LoRA adapter {name!r} serves {busy} sequence(s) in flight; retry when they end"
            )

    # ---- pause / resume -------------------------------------------------------

    def pause(self, mode: str = "abort", *, clear_cache: bool = False) -> None:
        """Stop stepping until `resume()`; `mode` decides what happens to in-flight requests
        (pausing.py). Updates made while paused apply without their own drain. `clear_cache`
        empties the prefix index (running sequences keep their pages)."""
        row = pausing.pause_mode(mode)
        with self._drained(row.drains, self.ecfg.drain_timeout_s):
            with self.lock:
                if row.aborts:
                    self.admission.abort_all()
                if row.retracts:
                    self.ref.state = self.sched.preempt_running(self.ref.state)
                if clear_cache:
                    self.ref.state = lifecycle.reset_prefix_cache(self.ref.state)
                self.pause_mode = row.name

    def resume(self) -> None:
        """Step again: held, retracted and newly queued requests go on under the current weights."""
        with self.lock:
            self.pause_mode = None

    # ---- sleep / wakeup / reset -------------------------------------------------

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free device memory. mode 'abort' ends in-flight requests now; 'wait' drains them first."""
        drains = lifecycle.sleep_drains(level, mode)  # a bad level or mode changes nothing
        with self._drained(drains, self.ecfg.drain_timeout_s):
            with self.lock:
                new = lifecycle.sleep(self.ref.state, level)  # no page held in it: every request ends
                self.admission.abort_all()
                self.ref.state = new
        host_memory.release_free_memory()  # the freed buffers go back to the OS, not the heap

    def wakeup(self, tags: list[str] | None = None) -> None:
        with self.lock:
            self.ref.state = lifecycle.wakeup(
                self.ref.state,
                tags,
                abstract=self.abstract,
                mcfg=self.mcfg,
                ecfg=self.ecfg,
                kv_sharding=self.kv_sharding,
                backend=self.backend,
            )

    def reset_prefix_cache(self) -> None:
        with self.lock:
            self.ref.state = lifecycle.reset_prefix_cache(self.ref.state)
