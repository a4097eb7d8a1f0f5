"""Multi-host serving on JAX's multi-controller runtime: process 0 drives, the others follow.

Every process holds the same Engine over one global mesh, and every jitted
step is a collective program that all of them must issue, in the same order,
with the same inputs. Process 0 owns the outside world (HTTP, the user's
script): it wraps its engine in a `Driver`, which broadcasts each engine
command (add_request, abort, step, update_weights, sleep, wakeup,
reset_prefix_cache) before running it. Followers run `follow(engine)`, which
applies the same commands in the same order. The scheduler is deterministic
host code (and sampling seeds come from the engine's seeded RNG), so the
processes stay in lock-step and every one of them sees the same tokens.

Transport is JAX's own runtime, no sockets of ours: commands are small JSON
records in the coordination service's key-value store; weight data travels as
a device collective (`multihost_utils.broadcast_one_to_all`), or, from a trainer
that published one offer per process, straight to each process's devices
(`multihost_transfer.py`: each pulls its own shards, all agree, then all swap).

Two rules keep the processes in step, and the Driver enforces them:
- Nothing depends on wall-clock time: the `drain` policy waits without a
  timeout, and `sleep(mode="wait")` is broadcast steps until the queue is empty.
- Commands are broadcast and run under the engine lock, so the local order is
  the broadcast order even with an HTTP thread and a step-loop thread.

Limits: a command that fails on one process only (a checkpoint path missing
on one host) leaves the others waiting in a collective, so paths must be
readable everywhere; partial updates are refused (they would read the
current, cross-process weights on one host); `LLM.score` is not a command,
so in a multi-process run call it on every process or not at all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import uuid
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from hotswap.engine import lifecycle, multihost_transfer
from hotswap.engine.engine import Engine
from hotswap.engine.sampling import SamplingParams
from hotswap.errors import ConfigError, HotswapError, TransferError
from hotswap.model.params import path_name
from hotswap.weights import lora_forms, place, plan, readers, transfer
from hotswap.weights.options import UpdateOptions

log = logging.getLogger(__name__)
PREFIX = "hotswap/cmd"


def initialize(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, **kwargs
) -> None:
    """`jax.distributed.initialize`. On TPU pods call it with no arguments (the TPU metadata has
    them). gloo carries CPU collectives (jax 0.10's default already; set so a CPU run never
    falls back to having none); the setting does nothing on TPU or GPU."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id, **kwargs
    )


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise ConfigError("jax.distributed is not initialized: call multihost.initialize(...) first")
    return client


class Channel:
    """An ordered command stream from process 0 to every other process (the coordination KV store)."""

    def __init__(self, prefix: str = PREFIX, poll_s: float = 60.0):
        self.client, self.prefix, self.poll_ms = _client(), prefix, int(poll_s * 1000)
        self.next = 0  # index of the next command to send / receive
        self.kept = 0  # oldest key not yet deleted (driver)

    def send(self, cmd: dict) -> int:
        self.client.key_value_set(f"{self.prefix}/{self.next}", json.dumps(cmd))
        self.next += 1
        return self.next - 1

    def recv(self) -> dict:
        """Block until the next command arrives (an idle server sends nothing for a long time)."""
        key = f"{self.prefix}/{self.next}"
        while True:
            try:
                raw = self.client.blocking_key_value_get(key, self.poll_ms)
                break
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self.next += 1
        return json.loads(raw)

    def forget_through(self, index: int) -> None:
        """Delete keys <= index: only once every follower is known to have read them."""
        for i in range(self.kept, index + 1):
            self.client.key_value_delete(f"{self.prefix}/{i}")
        self.kept = max(self.kept, index + 1)


def _encode_sampling(p: SamplingParams | None) -> dict | None:
    return dataclasses.asdict(p) if p is not None else None


@dataclasses.dataclass(frozen=True)
class _Sendable:
    """A checked source as named host arrays, and the form that reads them back: "hf" (HF
    names), "tree" (params names), or an adapter's form (`validate.LORA_FORMS`)."""

    form: str
    tensors: dict[str, np.ndarray]
    alpha: float | None = None
    rslora: bool = False


def _sendable(checked: plan.Plan) -> _Sendable:
    """Process 0's checked source as host arrays every process can receive."""
    if checked.kind == "adapter":
        a = checked.opened.adapter
        tensors = {n: np.asarray(jax.device_get(x)) for n, x in a.tensors.items()}
        return _Sendable(a.form, tensors, a.alpha, a.rslora)
    if checked.kind == "hf":
        return _Sendable("hf", {n: np.asarray(jax.device_get(x)) for n, x in checked.tensors.items()})
    tree = place.tree_of(checked)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return _Sendable("tree", {path_name(p): np.asarray(jax.device_get(x)) for p, x in flat})


def _received(engine: Engine, cmd: dict, tensors: dict | None = None):
    """The broadcast source on every process (`tensors` only matter on process 0), as the
    reader table reads it: HF-named tensors, a params tree, or an adapter."""
    form, manifest = cmd["form"], cmd["manifest"]
    like = tensors or {n: np.zeros(shape, np.dtype(dt)) for n, (shape, dt) in manifest.items()}
    got = multihost_utils.broadcast_one_to_all(like)
    if form == "hf":
        return got
    if form == "tree":
        flat, treedef = jax.tree_util.tree_flatten_with_path(engine.abstract)
        return treedef.unflatten([got[path_name(p)] for p, _ in flat])
    where = f"adapter ({form}) from process 0"
    return lora_forms.AdapterSource(got, form, alpha=cmd["alpha"], rslora=cmd["rslora"], where=where)


class Driver:
    """Process 0's handle on the engine: each command is broadcast to the followers, then run here.

    It can stand in for the Engine (`llm.engine = Driver(llm.engine)`, or handed to the server):
    commands are the methods below, and reads (weights_version, tokenizer, lock, ...) go to the engine.
    """

    def __init__(self, engine: Engine, channel: Channel | None = None):
        if jax.process_index() != 0:
            raise ConfigError(f"the Driver runs on process 0; this is process {jax.process_index()}")
        self.engine, self.channel = engine, channel or Channel()

    def __getattr__(self, name):  # views only: every command is defined below
        return getattr(self.engine, name)

    @property
    def weights_root(self) -> str | None:  # the server sets it; it must reach the engine
        return self.engine.weights_root

    @weights_root.setter
    def weights_root(self, root: str | None) -> None:
        self.engine.weights_root = root

    def _send(self, op: str, **args) -> int:
        return self.channel.send({"op": op, **args})

    def add_request(self, request_id, prompt, params=None, *, sink=None, stream=False) -> str:
        rid = request_id or uuid.uuid4().hex  # chosen here so every process uses the same id
        with self.engine.lock:
            self._send(
                "add_request", request_id=rid, prompt=prompt, params=_encode_sampling(params), stream=stream
            )
            return self.engine.add_request(rid, prompt, params, sink=sink, stream=stream)

    def abort(self, request_id: str) -> None:
        with self.engine.lock:
            self._send("abort", request_id=request_id)
            self.engine.abort(request_id)

    def step(self):
        with self.engine.lock:
            index = self._send("step")
            before = self.engine.stats["steps"]
            outputs = self.engine.step()
            if self.engine.stats["steps"] != before:
                # The step ran collectives, so every follower has read every command up to it.
                self.channel.forget_through(index)
            return outputs

    def update_weights(self, source, options: UpdateOptions | None = None, **fields) -> int:
        """As Engine.update_weights, on every process. The source's reader row says how it gets
        there (`readers.ACROSS`): a path is read by every process (a shared filesystem or
        bucket); a per-process transfer offer (`transfer.publish(params, for_processes=N)`) is
        opened by every process, each its own shards (`multihost_transfer`); anything else is
        read and checked here (the plan: a bad source is refused before any follower hears of
        it) and its tensors are sent over a device broadcast."""
        opts = UpdateOptions.of(options, **fields)
        if opts.partial or opts.base_version is not None:
            raise ConfigError(
                "partial and delta (base_version) updates are not supported across processes; send the "
                "full weights (or a checkpoint path)"
            )
        # No deadline: a timeout would let processes stop draining at different steps.
        opts = dataclasses.replace(opts, drain_timeout_s=math.inf)
        e = self.engine
        with e.lock:
            path = readers.resolve_path(source, e.weights_root)  # refused here, outside the root
            across = readers.row_for(source, path).across
            if across == "path":
                self._send("update_weights", kind="path", path=os.fspath(path), options=opts.to_dict())
                return e.update_weights(os.fspath(path), opts)
            if across == "offers":
                if source.processes != jax.process_count():  # refused before any follower starts
                    raise TransferError(
                        f"transfer {source.address} uuid {source.uuid}: published for {source.processes} "
                        f"engine processes, this engine runs in {jax.process_count()}"
                    )
                self._send("update_weights", kind="offers", transfer=source.to_json(), options=opts.to_dict())
                return multihost_transfer.update(e, source, opts)
            checked = plan.plan(
                readers.read(source, e.mcfg, abstract=e.abstract), e.mcfg, e.abstract, options=opts
            )
            sent = _sendable(checked)
            cmd = {
                "kind": "tensors",
                "form": sent.form,
                "manifest": {n: (list(np.shape(x)), np.dtype(x.dtype).name) for n, x in sent.tensors.items()},
                "alpha": sent.alpha,
                "rslora": sent.rslora,
                "options": opts.to_dict(),
            }
            self._send("update_weights", **cmd)
            _received(e, cmd, sent.tensors)  # the broadcast is collective: process 0 takes part
            return e.update_planned(checked)  # checked above, once

    def update_planned(self, checked) -> int:
        raise ConfigError("a plan is one process's: call update_weights(source), which every process runs")

    def update_weights_chunk(
        self, tensors_or_bytes, *, finished, update_id=None, content_type=None, options=None, **fields
    ):
        """Chunks are staged here only; the merged update is broadcast as one in-memory source."""
        opts = UpdateOptions.of(options, **fields)
        tensors = readers.wire_tensors(tensors_or_bytes, content_type or "application/octet-stream")
        merged = self.engine.stager.add(tensors, finished=finished, update_id=update_id)
        return None if merged is None else self.update_weights(merged, opts)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        drains = lifecycle.sleep_drains(level, mode)  # refused here, before any follower hears of it
        with self.engine.lock:
            if drains:  # by broadcast steps, not by a deadline
                while self.engine.has_unfinished() and self.engine.can_step:
                    self.step()
            self._send("sleep", level=level)
            self.engine.sleep(level, "abort")

    def wakeup(self, tags: list[str] | None = None) -> None:
        lifecycle.wake_tags(tags)  # refused here, before any follower hears of it
        with self.engine.lock:
            self._send("wakeup", tags=tags)
            self.engine.wakeup(tags)

    def reset_prefix_cache(self) -> None:
        with self.engine.lock:
            self._send("reset_prefix_cache")
            self.engine.reset_prefix_cache()

    def stop(self) -> None:
        """Release the followers from `follow`."""
        with self.engine.lock:
            self._send("stop")


def apply(engine: Engine, cmd: dict):
    """Run one broadcast command on a follower's engine."""
    op = cmd["op"]
    if op == "add_request":
        params = SamplingParams(**cmd["params"]) if cmd["params"] is not None else None
        return engine.add_request(cmd["request_id"], cmd["prompt"], params, stream=cmd["stream"])
    if op == "abort":
        return engine.abort(cmd["request_id"])
    if op == "step":
        return engine.step()
    if op == "update_weights":
        options = UpdateOptions(**cmd["options"])
        if cmd["kind"] == "offers":
            return multihost_transfer.update(engine, transfer.TransferRef.from_json(cmd["transfer"]), options)
        if cmd["kind"] == "path":
            return engine.update_weights(cmd["path"], options)
        return engine.update_weights(_received(engine, cmd), options)
    if op == "sleep":
        return engine.sleep(cmd["level"], "abort")
    if op == "wakeup":
        return engine.wakeup(cmd["tags"])
    if op == "reset_prefix_cache":
        return engine.reset_prefix_cache()
    raise ConfigError(f"unknown multihost command {op!r}")


def follow(engine: Engine, channel: Channel | None = None, on_output: Callable | None = None) -> int:
    """A follower's main loop: apply process 0's commands until it sends `stop`. Returns the count.

    `on_output` gets each RequestOutput a step returns (the driver's sinks live on process 0 only).

    A command that fails with a typed error fails the same way on process 0 (same state, same
    checks), which reports it to its caller; here it is logged and the loop goes on.
    """
    channel = channel or Channel()
    done = 0
    while True:
        cmd = channel.recv()
        if cmd["op"] == "stop":
            return done
        try:
            result = apply(engine, cmd)
            if cmd["op"] == "step" and on_output is not None:
                for out in result:
                    on_output(out)
        except HotswapError as e:
            log.info("process %d: %s failed as on process 0: %s", jax.process_index(), cmd["op"], e)
        done += 1
