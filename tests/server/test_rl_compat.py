"""RL controllers as they are written for SGLang and vLLM, against a real `hotswap serve` process
with plain HTTP: pause -> update -> resume with streams open, labelled versions, per-token spans,
the pickle refusal, and the staleness bound. One server for the module; each test first puts it
on the weights and version label it starts from (`serving`), so the tests run alone and in any order.
"""

from __future__ import annotations

import json
import pickle
import threading
import time

import httpx
import pytest
from helpers import KNOBS
from reliability.relkit import ADMIN, AUTH, ServerProc

from hotswap import LLM, SamplingParams
from hotswap.checkpoint.hf import read_hf_tensors
from hotswap.checkpoint.payload import encode_safetensors

# Long generations (see NEW) and 4 streams at once.
RL_KNOBS = {**KNOBS, "max_model_len": 2048, "max_num_seqs": 4, "max_num_batched_tokens": 32, "num_pages": 320}
PROMPTS = [list(range(30 + 7 * i, 46 + 7 * i)) for i in range(3)]  # 16 tokens: one full page
# Long enough to still be running when the pause lands: the tiny model decodes 400 tokens in
# ~0.45 s on a quiet box, and a loaded CI box once finished all of them before the pause arrived.
NEW = 1500


@pytest.fixture(scope="module")
def ckpts(weights_root):
    return {"root": weights_root, "seed0": weights_root / "seed0", "seed1": weights_root / "seed1"}


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    log = tmp_path_factory.mktemp("rl-log") / "server.log"
    proc = ServerProc(ckpts["seed0"], log, weights_root=ckpts["root"], max_version_lag=1, **RL_KNOBS)
    try:
        proc.wait_healthy()
        yield proc
        assert "Traceback" not in proc.log(), proc.log()[-5000:]
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def oracle(ckpts):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = LLM(ckpts[name], max_model_len=2048, num_pages=136, warmup=False)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def serving(server):
    """`serving("seed1", "step-1")` puts the server on that checkpoint of the weights root, under
    that version label, nothing cached, unpaused and awake: the state a test starts from."""

    def at(checkpoint: str, label: str) -> None:
        if httpx.get(f"{server.base}/vllm/is_paused", headers=ADMIN).json()["is_paused"]:
            assert _post(server, "/continue_generation").status_code == 200
        body = {"model_path": checkpoint, "weight_version": label, "flush_cache": True}
        r = _post(server, "/update_weights_from_disk", json=body)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        if httpx.get(f"{server.base}/is_sleeping", headers=ADMIN).json()["is_sleeping"]:
            assert _post(server, "/resume_memory_occupation", json={}).json()["success"] is True

    return at


@pytest.fixture(scope="module")
def http_transfer(server):
    """vLLM's four-phase update needs a transfer backend first: hotswap's one, `http`."""
    r = _post(server, "/vllm/init_weight_transfer_engine", json={"init_info": {"backend": "http"}})
    assert r.status_code == 200, r.text


def _post(server, path, headers=None, **kw):
    return httpx.post(f"{server.base}{path}", headers={**ADMIN, **(headers or {})}, timeout=120, **kw)


class _Stream(threading.Thread):
    """One streamed request; `events` are its parsed SSE chunks, `done` its [DONE]."""

    def __init__(self, server, path: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = f"{server.base}{path}", body
        self.events: list[dict] = []
        self.done = False
        self.started = threading.Event()

    def run(self):
        with httpx.stream("POST", self.url, json=self.body, headers=ADMIN, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))
                    self.started.set()


def _open(server, path, bodies) -> list[_Stream]:
    streams = [_Stream(server, path, b) for b in bodies]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60)
    return streams


def _greedy_continuation(llm, prefix, n):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return llm.generate([prefix], sp, use_tqdm=False)[0].outputs[0].token_ids


def test_sglang_rl_sequence(server, oracle, serving):
    serving("seed0", "step-0")
    # A prompt cached under the old weights, to show nothing cached from before is reused.
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    r = httpx.post(f"{server.base}/generate", json=body, headers=ADMIN, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "step-0", r.text
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    streams = _open(
        server, "/generate", [{"input_ids": p, "sampling_params": sp, "stream": True} for p in PROMPTS]
    )

    r = _post(server, "/pause_generation", json={"mode": "retract"})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    r = _post(
        server,
        "/update_weights_from_disk",
        json={"model_path": "seed1", "flush_cache": True, "weight_version": "step-1"},
    )
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert httpx.get(f"{server.base}/get_weight_version", headers=ADMIN).json() == {
        "weight_version": "step-1"
    }
    assert _post(server, "/continue_generation").status_code == 200

    for s, prompt in zip(streams, PROMPTS, strict=True):
        s.join(120)
        assert s.done, "every stream ends normally"
        final = s.events[-1]
        meta = final["meta_info"]
        assert meta["finish_reason"] == {"type": "length"} and len(final["output_ids"]) == NEW
        spans = meta["weight_versions"]
        assert [x["version"] for x in spans] == ["step-0", "step-1"], spans  # paused mid-stream
        k = spans[1]["start"]
        # retract: the KV under every post-update token was recomputed on the new weights
        assert meta["kv_weight_versions"][-1] == {"version": "step-1", "start": k, "end": NEW}
        ids = final["output_ids"]
        assert ids[k:] == _greedy_continuation(oracle("seed1"), prompt + ids[:k], NEW - k)
    r = httpx.post(f"{server.base}/generate", json=body, headers=ADMIN, timeout=60).json()
    assert r["meta_info"]["weight_version"] == "step-1"
    # PROMPTS[0]'s page is cached again only by the recomputed stream, under step-1: never the old one
    assert r["output_ids"] == _greedy_continuation(oracle("seed1"), PROMPTS[0], 2)


class _Canary:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickled_tensors_are_refused(server, tmp_path, serving):
    """A body whose bytes are a pickle: SGLang's and vLLM's 415. A pickled
    `serialized_named_tensors` field: PickleRefused's 400, on every route that reads one (before
    vLLM's route asks whether an update is open)."""
    serving("seed1", "step-1")
    canary = tmp_path / "pwned"
    blob = pickle.dumps(_Canary(canary))
    for headers in ({"content-type": "application/octet-stream"}, {"content-type": "application/json"}):
        r = _post(server, "/update_weights_from_tensor", content=blob, headers={**ADMIN, **headers})
        assert r.status_code == 415, r.text
        assert r.json()["success"] is False and "safetensors" in r.json()["message"]
    r = _post(
        server,
        "/vllm/update_weights",
        content=blob,
        headers={**ADMIN, "content-type": "application/octet-stream"},
    )
    assert r.status_code == 415 and "safetensors" in r.json()["error"]["message"]
    field = {"serialized_named_tensors": [blob.hex()], "flush_cache": True}
    r = _post(server, "/update_weights_from_tensor", json=field)
    assert r.status_code == 400 and "never" in r.json()["message"], r.text
    assert r.json()["error"]["code"] == "pickle_refused"
    for path, body in (("/vllm/update_weights", {"update_info": field}), ("/update_weights", field)):
        r = _post(server, path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "pickle_refused", (path, r.text)
    assert not canary.exists()
    assert httpx.get(f"{server.base}/get_weight_version", headers=ADMIN).json() == {
        "weight_version": "step-1"
    }


def _four_phase(server, ckpt, label: str) -> None:
    tensors = read_hf_tensors(ckpt)
    names = sorted(tensors)
    half = len(names) // 2
    assert _post(server, "/vllm/start_weight_update", json={"is_checkpoint_format": True}).status_code == 200
    for part in (names[:half], names[half:]):
        blob = encode_safetensors({n: tensors[n] for n in part})
        r = _post(
            server,
            "/vllm/update_weights",
            content=blob,
            headers={**ADMIN, "content-type": "application/octet-stream"},
        )
        assert r.status_code == 200, r.text
    r = _post(server, "/vllm/finish_weight_update", json={"weight_version": label})
    assert r.status_code == 200, r.text


def _vllm_streams(server):
    bodies = [
        {
            "model": "tiny",
            "prompt": p,
            "max_tokens": NEW,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        for p in PROMPTS
    ]
    return _open(server, "/vllm/v1/completions", bodies)


def _final_choice(s: _Stream) -> dict:
    s.join(120)
    assert s.done
    return next(c for e in s.events for c in e["choices"] if c.get("finish_reason"))


def test_vllm_rl_sequence_keep(server, ckpts, serving):
    serving("seed1", "step-1")
    r = _post(server, "/vllm/init_weight_transfer_engine", json={"init_info": {"backend": "nccl"}})
    assert r.status_code == 400 and "'http'" in r.text  # says which backend exists
    assert (
        _post(
            server, "/vllm/init_weight_transfer_engine", json={"init_info": {"backend": "http"}}
        ).status_code
        == 200
    )
    streams = _vllm_streams(server)
    assert _post(server, "/vllm/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert httpx.get(f"{server.base}/vllm/is_paused", headers=ADMIN).json() == {"is_paused": True}
    time.sleep(0.5)  # every token sampled before the pause reaches its client
    before = [sum(len(c.get("text", "")) >= 0 for e in s.events for c in e["choices"]) for s in streams]
    _four_phase(server, ckpts["seed0"], "step-2")
    time.sleep(0.3)
    assert [sum(1 for e in s.events for c in e["choices"]) for s in streams] == before  # nothing while paused
    assert _post(server, "/vllm/resume").json() == {"status": "resumed"}
    assert httpx.get(f"{server.base}/vllm/weight_info", headers=ADMIN).json() == {"weight_version": "step-2"}
    for s in streams:
        c = _final_choice(s)
        spans = c["weight_versions"]
        assert [x["version"] for x in spans] == ["step-1", "step-2"], spans
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == NEW
        assert c["mixed_weights_kv"] is True  # keep: step-2 tokens over step-1 KV, labelled
        assert c["kv_weight_versions"] == [{"version": "step-1", "start": 0, "end": NEW}]
        assert c["weights_version_spans"][1]["start"] == spans[1]["start"]


def test_max_version_lag_under_keep(server, ckpts, serving, http_transfer):
    serving("seed0", "step-2")
    streams = _vllm_streams(server)
    _post(server, "/vllm/pause", params={"mode": "keep", "clear_cache": "false"})
    _four_phase(server, ckpts["seed1"], "step-3")
    _four_phase(server, ckpts["seed0"], "step-4")  # two quick updates: kept KV would be 2 behind
    _post(server, "/vllm/resume")
    order = {"step-2": 3, "step-3": 4, "step-4": 5}
    paused_mid_stream = 0
    for s in streams:
        c = _final_choice(s)

        def per_token(spans):
            return [order[x["version"]] for x in spans for _ in range(x["start"], x["end"])]

        versions, kv = per_token(c["weight_versions"]), per_token(c["kv_weight_versions"])
        assert len(versions) == len(kv) == NEW
        assert all(v - k <= 1 for v, k in zip(versions, kv, strict=True)), (
            c["weight_versions"],
            c["kv_weight_versions"],
        )
        if versions[-1] > 3:  # it was running across both updates: recomputed, not kept 2 behind
            paused_mid_stream += 1
            assert versions[-1] == 5 and kv[-1] == 5
    assert paused_mid_stream > 0


def test_flush_cache_while_running_and_memory_occupation(server, serving):
    serving("seed0", "step-0")
    streams = _vllm_streams(server)
    r = _post(server, "/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed")
    for s in streams:
        assert _final_choice(s)["finish_reason"] == "length"
    r = _post(server, "/release_memory_occupation", json={})
    assert r.json()["success"] is True
    assert httpx.get(f"{server.base}/vllm/is_sleeping", headers=ADMIN).json() == {"is_sleeping": True}
    r = _post(server, "/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]})
    assert r.json()["success"] is True
    assert httpx.get(f"{server.base}/is_sleeping", headers=ADMIN).json()["is_sleeping"] is False


def test_compat_routes_take_the_admin_key(server, serving):
    serving("seed0", "step-0")
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{server.base}/generate", json=body, headers=AUTH, timeout=30).status_code == 403
    for path in ("/pause_generation", "/vllm/pause", "/vllm/v1/completions"):
        assert httpx.post(f"{server.base}{path}", json={}, headers=AUTH, timeout=30).status_code == 403, path
    assert httpx.post(f"{server.base}/pause_generation", json={}, timeout=30).status_code == 401
    assert httpx.get(f"{server.base}/vllm/is_paused", headers=ADMIN).json() == {"is_paused": False}


def test_sglang_update_from_tensor_safe_formats_and_refusals(server, ckpts, oracle, serving):
    serving("seed0", "step-4")
    blob = encode_safetensors(read_hf_tensors(ckpts["seed1"]))
    r = _post(
        server,
        "/update_weights_from_tensor",
        content=blob,
        params={"weight_version": "step-5"},
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert httpx.get(f"{server.base}/get_weight_version", headers=ADMIN).json() == {
        "weight_version": "step-5"
    }
    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    out = httpx.post(f"{server.base}/generate", json=body, headers=ADMIN, timeout=60).json()
    assert out["output_ids"] == _greedy_continuation(oracle("seed1"), PROMPTS[1], 4)
    assert out["meta_info"]["weight_versions"] == [{"version": "step-5", "start": 0, "end": 4}]
    r = _post(server, "/update_weights_from_disk", json={"model_path": "../../etc", "weight_version": "x"})
    assert r.status_code == 403 and r.json()["success"] is False
    r = _post(server, "/update_weights_from_disk", json={"model_path": "missing"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert httpx.get(f"{server.base}/get_weight_version", headers=ADMIN).json() == {
        "weight_version": "step-5"
    }
    # abort_all_requests during a pause ends what is in flight and stays paused, in its mode
    assert _post(server, "/pause_generation", json={"mode": "in_place"}).status_code == 200
    body = {"model_path": "seed0", "abort_all_requests": True, "weight_version": "step-6"}
    r = _post(server, "/update_weights_from_disk", json=body)
    assert r.json() == {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
    }
    assert httpx.get(f"{server.base}/vllm/is_paused", headers=ADMIN).json() == {"is_paused": True}
    assert _post(server, "/continue_generation").status_code == 200
