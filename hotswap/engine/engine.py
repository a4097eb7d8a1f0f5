"""Engine: owns the current EngineState and the lock; steps, and holds admission and the
lifecycle controller.

One re-entrant lock serialises every step and every lifecycle call (update,
sleep, wakeup, reset), so the step loop never runs during a transition. A step
is schedule -> run -> postprocess, each taking the state and (but for the run)
returning the next. Requests enter and leave through `Admission` (admission.py:
the requests table, the queue limits, aborts, delivery); every other change goes
through the `LifecycleController` (controller.py: updates, adapters, pause, sleep,
reset, and the in-flight policy). Both read and replace the one state through
`StateRef`, which the Engine holds.
"""

from __future__ import annotations

import dataclasses
import threading

import jax

from hotswap import host_memory
from hotswap.engine import lifecycle, speculation
from hotswap.engine.adapters import Adapters, Loaded
from hotswap.engine.admission import Admission
from hotswap.engine.controller import LifecycleController
from hotswap.engine.draft_model import DraftModel
from hotswap.engine.outputs import RequestOutput
from hotswap.engine.runner import Runner
from hotswap.engine.sampling import SamplingParams
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.sequence import Request, Sink
from hotswap.engine.state import EngineState, StateRef, empty_state, new_kv_cache
from hotswap.engine.structured import Grammars
from hotswap.engine_config import EngineConfig
from hotswap.errors import ConfigError
from hotswap.kernels.backend import Backend
from hotswap.model import sharding
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params, abstract_params
from hotswap.programs import compile_cache
from hotswap.speculative import MAX_VERIFYING_ROWS
from hotswap.weights import pipeline, place, plan
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
        state = lifecycle.update_weights(empty, staged)  # version 1
        if ecfg.enable_lora:
            empty_adapters = Adapters.empty(mcfg, self.abstract, ecfg.max_loras, ecfg.max_lora_rank)
            state = dataclasses.replace(state, adapters=empty_adapters)
        if ecfg.enable_return_routed_experts and not mcfg.num_experts:
            raise ConfigError(f"enable_return_routed_experts: this {mcfg.arch} model has no experts")
        self.ref = StateRef(state)
        self.runner = Runner(mcfg, ecfg, self.backend)
        self.sched = Scheduler(
            ecfg, fill=self.runner.buckets.fill, propose=speculation.proposer(ecfg.speculative_config)
        )
        self.drafter = speculation.drafter(mcfg, ecfg, self.backend)
        self._lock = threading.RLock()
        self._steps = 0
        self.admission = Admission(
            mcfg, ecfg, tokenizer, ref=self.ref, sched=self.sched, lock=self._lock, seed=seed
        )
        self.controller = LifecycleController(
            mcfg,
            ecfg,
            abstract=self.abstract,
            staging=self.staging,
            weights_root=weights_root,
            kv_sharding=kv_sharding,
            backend=self.backend,
            ref=self.ref,
            sched=self.sched,
            lock=self._lock,
            admission=self.admission,
            step=self._step_locked,
        )
        if warmup:
            self.runner.warmup(self.state.step_params, self.state.kv.pages, progress, cache=self._cache_on)
            if self.drafter is not None:
                rows = min(ecfg.max_num_seqs, MAX_VERIFYING_ROWS)
                self.drafter.warmup(self.state, rows, progress, cache=self._cache_on)

    # ---- views --------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self.ref.state

    @state.setter
    def state(self, state: EngineState) -> None:
        self.ref.state = state

    @property
    def weights_version(self) -> int:
        return self.state.weights_version

    @property
    def draft_model(self) -> DraftModel | None:
        """The draft checkpoint speculation runs (speculative_config `model: <path>`), or None."""
        return self.drafter if isinstance(self.drafter, DraftModel) else None

    @property
    def draft_version(self) -> int | None:
        """The draft checkpoint's version (1 at load, + 1 per draft update); None without one."""
        return self.draft_model.version if self.draft_model is not None else None

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    @property
    def requests(self) -> dict[str, Request]:
        return self.admission.requests

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.admission.eos_ids

    @property
    def grammars(self) -> Grammars | None:
        return self.admission.grammars

    @property
    def stager(self) -> ChunkStager:
        return self.controller.stager

    @property
    def weights_root(self) -> str | None:
        return self.controller.weights_root

    @weights_root.setter
    def weights_root(self, root: str | None) -> None:
        self.controller.weights_root = root

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_running(self) -> int:
        return len(self.sched.running)

    def num_waiting(self) -> int:
        return len(self.sched.waiting)

    @property
    def can_step(self) -> bool:
        """Serving and not paused: the step loop (and a drain) may run a step."""
        return self.controller.can_step

    @property
    def is_paused(self) -> bool:
        return self.controller.pause_mode is not None

    @property
    def pause_mode(self) -> str | None:
        return self.controller.pause_mode

    @property
    def is_sleeping(self) -> bool:
        return bool(self.state.asleep)

    @property
    def stats(self) -> dict[str, int]:
        s = self.sched
        return {
            **self.admission.counts,
            "steps": self._steps,
            "generated_tokens": s.num_generated,
            "spec_drafts": s.num_drafts,
            "spec_draft_tokens": s.num_draft_tokens,
            "spec_accepted_tokens": s.num_accepted_tokens,
        }

    def check_invariants(self) -> None:
        """Refcounts equal the owners the state's tables list; only running sequences hold pages."""
        with self._lock:
            self.sched.check(self.state)

    # ---- requests (admission.py) ----------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return self.admission.tokenize(prompt)

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
        return self.admission.add(request_id, prompt, params, sink=sink, stream=stream, lora_name=lora_name)

    def abort(self, request_id: str) -> None:
        self.admission.abort(request_id)

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
            if self.drafter is not None:  # a draft model drafts what the plan verifies
                self.state = self.state.with_pages(self.drafter.fill(self.state, plan))
            pages, out = self.runner.run(self.state, plan)
        except Exception:
            # Donated buffers may be gone: recompute every running sequence over a fresh, empty
            # cache, so no accepted request is lost, then re-raise.
            self._recover()
            raise
        self.state, touched = self.sched.postprocess(self.state.with_pages(pages), plan, out)
        self._steps += 1
        return self.admission.deliver(touched)

    def _recover(self) -> None:
        self.state = self.sched.preempt_running(self.state)
        self.state = lifecycle.fresh_cache(
            self.state, new_kv_cache(self.mcfg, self.ecfg, sharding=self.kv_sharding, backend=self.backend)
        )
        if self.draft_model is not None:
            self.draft_model.recover()

    # ---- lifecycle (controller.py) ----------------------------------------------

    def update_weights(
        self, source, options: UpdateOptions | None = None, *, draft: bool = False, **fields
    ) -> int:
        """Read -> plan -> place -> apply the in-flight policy -> swap; returns the new version
        (`LifecycleController.update_weights`). `draft`: the source replaces the draft
        checkpoint instead (`update_draft_weights`)."""
        if draft:
            if options is not None or fields:
                raise ConfigError("a draft update takes no update options: it changes no token nor cache")
            return self.update_draft_weights(source)
        return self.controller.update_weights(source, options, **fields)

    def update_draft_weights(self, source) -> int:
        """Swap the draft checkpoint's params (read and checked before the lock: a bad source,
        another vocabulary included, changes nothing); returns its new version. The target's
        weights, version and cache are untouched; requests in flight go on, their draft KV
        recomputed by the new draft as they next draft (drafts never decide a token)."""
        draft = self.draft_model
        if draft is None:
            raise ConfigError(
                'no draft checkpoint to update: speculative_config has no {"method": "draft_model", "model": <path>}'
            )
        staged = draft.staged(source, self.weights_root)
        with self._lock:
            return draft.swap(staged)

    def update_planned(self, checked: plan.Plan) -> int:
        """Place and swap a source already checked (`LifecycleController.update_planned`)."""
        return self.controller.update_planned(checked)

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
        """Stage one chunk; on `finished`, commit every staged tensor as one update."""
        return self.controller.update_weights_chunk(
            tensors_or_bytes,
            finished=finished,
            update_id=update_id,
            content_type=content_type,
            options=options,
            **fields,
        )

    def load_lora_adapter(self, name: str, source, *, lora_alpha: float | None = None) -> Loaded:
        return self.controller.load_lora_adapter(name, source, lora_alpha=lora_alpha)

    def unload_lora_adapter(self, name: str) -> None:
        self.controller.unload_lora_adapter(name)

    def lora_adapters(self) -> tuple[Loaded, ...]:
        return self.controller.lora_adapters()

    def pause(self, mode: str = "abort", *, clear_cache: bool = False) -> None:
        self.controller.pause(mode, clear_cache=clear_cache)

    def resume(self) -> None:
        self.controller.resume()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.controller.sleep(level, mode)  # (a drain takes the lock step by step)
        if self.draft_model is not None:  # the draft's params and KV sleep with the target's
            with self._lock:
                self.draft_model.sleep()

    def wakeup(self, tags: list[str] | None = None) -> None:
        with self._lock:
            self.controller.wakeup(tags)
            if self.draft_model is not None:
                self.draft_model.wakeup(tags)

    def reset_prefix_cache(self) -> None:
        self.controller.reset_prefix_cache()
