"""Device-to-device weight pushes (`hotswap/weights/transfer.py`) between real processes on loopback.

A trainer subprocess (`tests/support/transfer_trainer.py`) publishes params; a real `hotswap serve`
process pulls them on `POST /update_weights {"transfer": ...}`. Faults on the push path (the
trainer killed mid-pull, a wrong-shaped or NaN tree, an unreachable address, a uuid nobody
published) each end in a clear 400, the old version keeps serving, and a stream accepted
before the failed update finishes normally.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import KNOBS, SUPPORT
from server_process import ServerProcess, cli_flags, free_port

ADMIN_KEY = "transfer-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = "Once upon a time there was a little robot who lived in a quiet town by the sea."
GREEDY = {"max_tokens": 8, "temperature": 0.0}
TRAINER = SUPPORT / "transfer_trainer.py"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def dirs(weights_root):
    return {"seed0": weights_root / "seed0", "seed1": weights_root / "seed1"}


@pytest.fixture(scope="module")
def oracle(dirs):
    """Fresh in-process engines: what the server must say on each checkpoint's weights."""
    from hotswap import SamplingParams
    from hotswap.engine.llm import LLM

    out = {}
    for name in ("seed0", "seed1"):
        llm = LLM(dirs[name], **KNOBS, warmup=False)
        out[name] = llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text
    return out


@pytest.fixture(scope="module")
def server(dirs, oracle, tmp_path_factory):
    flags = [str(dirs["seed0"]), "--admin-key", ADMIN_KEY, "--served-model-name", "tiny"]
    flags += ["--log-level", "warning", *cli_flags(**KNOBS)]
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    with ServerProcess(flags, log_path, env=ENV) as proc:
        proc.wait_healthy(240)
        with httpx.Client(base_url=proc.base, timeout=90) as http:
            yield http
        assert proc.proc.poll() is None, proc.log()[-3000:]
        assert "Traceback" not in proc.log(), proc.log()[-3000:]


class Trainer:
    """A trainer process holding one offer; `ref` is what it printed."""

    def __init__(self, ckpt: Path, mode: str):
        args = [sys.executable, str(TRAINER), str(ckpt), mode]
        self.proc = subprocess.Popen(args, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, f"trainer ({mode}) exited with {self.proc.wait(30)}"
        self.ref = json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
        self.proc.wait(30)


def _push(http, ref: dict, **opts) -> httpx.Response:
    return http.post("/update_weights", json={"transfer": ref, **opts}, headers=ADMIN)


def _version(http) -> int:
    return http.get("/weights_version", headers=ADMIN).json()["weights_version"]


def _text(http) -> str:
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, **GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_push_swaps_and_output_equals_fresh_engine(server, dirs, oracle):
    assert _text(server) == oracle["seed0"] != oracle["seed1"]
    before = _version(server)
    trainer = Trainer(dirs["seed1"], "ok")
    try:
        r = _push(server, trainer.ref, policy="drain")
    finally:
        trainer.close()
    assert r.status_code == 200, r.text
    assert r.json() == {"weights_version": before + 1, "policy": "drain"}
    assert _text(server) == oracle["seed1"]


class _Stream:
    """A streamed completion started before an update; `first` is set at its first token."""

    def __init__(self, base: str):
        self.first, self.events, self.error = threading.Event(), [], None
        self.thread = threading.Thread(target=self._run, args=(base,), daemon=True)
        self.thread.start()
        assert self.first.wait(60), self.error

    def _run(self, base: str) -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 96, "temperature": 0.0, "stream": True}
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=90) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.events.append(json.loads(line[6:]))
                        self.first.set()
        except Exception as e:  # reported by finished()
            self.error = e
            self.first.set()

    def finished(self) -> str | None:
        self.thread.join(90)
        assert self.error is None, self.error
        return next(
            (c["finish_reason"] for e in self.events for c in e.get("choices", []) if c["finish_reason"]),
            None,
        )


FAULTS = ["killed_mid_pull", "wrong_shape", "nan", "unreachable", "never_published"]


@pytest.mark.parametrize("fault", FAULTS)
def test_push_fault_changes_nothing(server, dirs, fault):
    before, text_before = _version(server), _text(server)
    stream = _Stream(str(server.base_url))  # accepted before the failed update
    trainer = None
    try:
        if fault == "unreachable":
            ref = {"address": f"127.0.0.1:{free_port()}", "uuid": 4, "timeout_s": 5}
        else:
            mode = {"killed_mid_pull": "stall", "wrong_shape": "shape", "nan": "nan"}.get(fault, "ok")
            trainer = Trainer(dirs["seed1"], mode)
            ref = {**trainer.ref, "timeout_s": 30}
            if fault == "never_published":
                ref = {**ref, "uuid": ref["uuid"] + 4, "timeout_s": 2}
            if fault == "killed_mid_pull":  # the weights never come; the trainer dies while the pull waits
                threading.Timer(1.0, trainer.proc.kill).start()
        t0 = time.monotonic()
        r = _push(server, ref, policy="drain")
        took = time.monotonic() - t0
    finally:
        if trainer is not None:
            trainer.close()
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    want = {
        "killed_mid_pull": ("transfer_failed", "Connection closed"),
        "wrong_shape": ("weights_mismatch", "layers.0.wq: expected (64, 4, 16) float32, got (64, 63)"),
        "nan": ("non_finite_weights", "layers.1.w_up: contains NaN"),
        "unreachable": ("transfer_failed", "cannot connect"),
        "never_published": ("transfer_failed", "no header within 2 s"),
    }[fault]
    assert err["code"] == want[0] and want[1] in err["message"], err
    assert took < 25, f"{fault}: the failed pull took {took:.1f} s"
    assert stream.finished() in ("length", "stop")  # the accepted request ran to its end
    assert _version(server) == before
    assert _text(server) == text_before  # the old weights keep serving


def test_transfer_body_validation(server):
    ok = {"address": "127.0.0.1:1", "uuid": 0}
    cases = [
        ({"transfer": {"address": "127.0.0.1:1"}}, "transfer"),
        ({"transfer": {**ok, "uuid": -1}}, "uuid"),
        ({"transfer": {**ok, "address": "127.0.0.1:70000"}}, "host:port"),
        ({"transfer": {**ok, "address": 5}}, "host:port"),
        ({"transfer": {**ok, "timeout_s": 0}}, "timeout_s"),
        ({"transfer": {**ok, "extra": 1}}, "unknown field"),
        ({"transfer": {**ok, "processes": 0}}, "processes"),
        ({"transfer": {**ok, "processes": True}}, "processes"),
        # One offer per process of a 2-process engine: this one runs in one, and pulls nothing.
        ({"transfer": {**ok, "processes": 2}}, "published for 2 engine processes"),
        ({"transfer": ok, "path": "x"}, "exactly one of"),
    ]
    for body, needle in cases:
        r = server.post("/update_weights", json=body, headers=ADMIN)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)


def test_llm_update_weights_takes_a_ref(dirs, oracle):
    """In process: `LLM.update_weights(TransferRef)` goes through the same Engine path."""
    from hotswap import SamplingParams
    from hotswap.engine.llm import LLM
    from hotswap.weights.transfer import TransferRef

    llm = LLM(dirs["seed0"], **KNOBS, warmup=False)
    trainer = Trainer(dirs["seed1"], "ok")
    try:
        assert llm.update_weights(TransferRef(**trainer.ref)) == 2
    finally:
        trainer.close()
    out = llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.text == oracle["seed1"]


SHARDED_ENGINE = """
import json, sys
import jax
from hotswap import LLM, SamplingParams
from hotswap.weights import place, plan, readers
from hotswap.weights.transfer import TransferRef

seed0, seed1, direct, whole = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
kw = dict(tensor_parallel_size=2, max_model_len=64, num_pages=16, warmup=False)
llm = LLM(seed0, **kw)
abstract = llm.engine.abstract
cfg = llm.engine.mcfg
opened = readers.read(TransferRef(**direct), cfg, abstract=abstract)  # the manifest, then the pull:
tree = place.fetched(plan.plan(opened, cfg, abstract))  # the trainer's shards are the engine's: no copy after
same = jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s.sharding, x.ndim), tree, abstract))
v = llm.update_weights(TransferRef(**whole))  # whole arrays: pulled to one device, resharded there
sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
got = llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0].outputs[0].token_ids
want = LLM(seed1, **kw).generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0].outputs[0].token_ids
print(json.dumps({"direct_on_engine_shardings": all(same), "version": v, "equal": got == want}))
"""


def test_sharded_engine_pulls_into_its_own_shardings(dirs):
    """A tensor_parallel_size=2 engine (2 fake CPU devices): a trainer sharded the same way is
    pulled straight into the engine's shardings; one holding whole arrays is resharded after."""
    env = {**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    trainers = []
    try:
        for mode in ("tp2", "ok"):
            args = [sys.executable, str(TRAINER), str(dirs["seed1"]), mode]
            trainers.append(
                subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            )
        refs = [t.stdout.readline().strip() for t in trainers]
        assert all(refs), "a trainer exited early"
        cmd = [sys.executable, "-c", SHARDED_ENGINE, str(dirs["seed0"]), str(dirs["seed1"]), *refs]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    finally:
        for t in trainers:
            t.stdin.close()
            t.wait(30)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"direct_on_engine_shardings": True, "version": 2, "equal": True}
