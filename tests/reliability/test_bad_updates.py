"""Malformed weight updates over HTTP: each is refused with a 4xx that names the problem,
and the old weights keep serving (same version, same greedy output).

Every payload is sent to the shared server as a real client would: safetensors bytes,
base64 JSON entries, chunks, or a path under the weights root.
"""

from __future__ import annotations

import io
import pickle  # builds the payloads the server must refuse; nothing here loads one
import struct
import zipfile

import httpx
import numpy as np
import pytest

from hotswap.checkpoint.create import create_checkpoint
from hotswap.checkpoint.hf import read_hf_tensors
from hotswap.checkpoint.payload import encode_json_entries, encode_safetensors

from .relkit import ADMIN, AUTH, MODEL, TIMEOUT

NORM, UP = "model.norm.weight", "model.layers.0.mlp.up_proj.weight"
OCTET = {"Content-Type": "application/octet-stream"}


def _hdr(*entries: tuple[str, int, int], tag: str = "F32") -> str:
    """A literal safetensors header of float [64] tensors (name, begin, end), duplicates allowed."""
    fields = [f'"{n}":{{"dtype":"{tag}","shape":[64],"data_offsets":[{b},{e}]}}' for n, b, e in entries]
    return "{" + ",".join(fields) + "}"


def _st_raw(header_json: str, data: bytes) -> bytes:
    """Safetensors bytes from a literal header (so it can say things json.dumps would not)."""
    head = header_json.encode()
    return struct.pack("<Q", len(head)) + head + data


def _torch_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": [1.0]}))
    return buf.getvalue()


def _cases(t: dict[str, np.ndarray]) -> list[tuple[str, list[dict], int, str]]:
    """(id, requests to send in order (the last one is judged), status, word the message must contain)."""
    norm = t[NORM].tobytes()
    full = encode_safetensors(t)
    nan = {**t, NORM: np.where(np.arange(64) == 3, np.nan, t[NORM]).astype(np.float32)}
    inf = {NORM: np.full(64, np.inf, np.float32)}
    dup_entry = encode_json_entries({NORM: t[NORM]})[0]

    def octet(body: bytes, **params) -> dict:
        return {"content": body, "headers": {**ADMIN, **OCTET}, "params": params}

    def js(obj, **params) -> dict:
        return {"json": obj, "headers": ADMIN, "params": params}

    return [
        ("truncated file", [octet(full[: len(full) // 2])], 400, "truncated"),
        ("truncated header", [octet(full[:6])], 400, "truncated"),
        ("header length overflow", [octet(struct.pack("<Q", 2**63) + b"{}")], 400, "header length"),
        ("header longer than body", [octet(_st_raw('{"a":1}', b"")[:8] + b"{")], 400, "truncated"),
        (
            "header nested too deeply",
            [octet(_st_raw("[" * 5000 + "]" * 5000, b""))],
            400,
            "nested too deeply",
        ),
        ("header not json", [octet(_st_raw("{nope", b""))], 400, "not valid JSON"),
        (
            "overlapping offsets",
            [
                octet(
                    _st_raw(
                        _hdr((NORM, 0, 256), ("x", 128, 384)),
                        norm * 2,
                    )
                )
            ],
            400,
            "overlaps",
        ),
        ("gap in offsets", [octet(_st_raw(_hdr((NORM, 4, 260)), b"\0" * 260))], 400, "gap"),
        (
            "trailing bytes",
            [octet(_st_raw(_hdr((NORM, 0, 256)), norm + b"junk"))],
            400,
            "trailing",
        ),
        (
            "offsets disagree with shape",
            [octet(_st_raw(_hdr((NORM, 0, 128)), norm[:128]))],
            400,
            "needs",
        ),
        ("wrong shape", [octet(encode_safetensors({UP: t[UP].T.copy()}), partial="true")], 400, UP),
        (
            "wrong dtype",
            [octet(encode_safetensors({NORM: t[NORM].astype(np.int32)}), partial="true")],
            400,
            "float",
        ),
        (
            "unsupported dtype tag",
            [octet(_st_raw(_hdr((NORM, 0, 256), tag="C64"), norm))],
            400,
            "dtype",
        ),
        ("NaN", [octet(encode_safetensors(nan))], 400, "NaN"),
        ("Inf (JSON entries)", [js({"tensors": encode_json_entries(inf), "partial": True})], 400, "Inf"),
        (
            "missing tensor",
            [octet(encode_safetensors({k: v for k, v in t.items() if k != UP}))],
            400,
            "missing",
        ),
        (
            "extra tensor",
            [octet(encode_safetensors({**t, "model.layers.7.mlp.up_proj.weight": t[UP]}))],
            400,
            "unexpected",
        ),
        (
            "duplicate name (safetensors)",
            [octet(_st_raw(_hdr((NORM, 0, 256), (NORM, 0, 256)), norm))],
            400,
            "twice",
        ),
        (
            "duplicate name (JSON)",
            [js({"tensors": [dup_entry, dup_entry], "partial": True})],
            400,
            "more than once",
        ),
        (
            "duplicate name across chunks",
            [
                octet(encode_safetensors({NORM: t[NORM]}), finished="false", update_id="dup"),
                octet(encode_safetensors({NORM: t[NORM]}), finished="true", update_id="dup", partial="true"),
            ],
            400,
            "already sent",
        ),
        ("bad base64", [js({"tensors": [{**dup_entry, "data": "@@@"}], "partial": True})], 400, "base64"),
        (
            "byte count mismatch",
            [js({"tensors": [{**dup_entry, "shape": [65]}], "partial": True})],
            400,
            "needs",
        ),
        (
            "body not JSON",
            [{"content": b"{oops", "headers": {**ADMIN, "Content-Type": "application/json"}}],
            400,
            "not valid JSON",
        ),
        ("path and tensors", [js({"path": "seed1", "tensors": []})], 400, "exactly one"),
        ("unknown policy", [js({"path": "seed1", "policy": "yolo"})], 400, "policy"),
        ("version not increasing", [js({"path": "seed1", "version": 1})], 409, "greater"),
        ("path outside the root", [js({"path": "../outside"})], 403, "outside the allowed root"),
        ("absolute path outside the root", [js({"path": "/etc"})], 403, "outside the allowed root"),
        ("symlink escaping the root", [js({"path": "escape"})], 403, "outside the allowed root"),
        ("path that is a file", [js({"path": "seed1/config.json"})], 400, "not a directory"),
        ("other architecture", [js({"path": "other_arch"})], 400, "num_layers"),
        ("pickle", [octet(pickle.dumps({NORM: t[NORM]}))], 400, "pickle"),
        (
            "pickle labelled JSON",
            [{"content": pickle.dumps([1]), "headers": {**ADMIN, "Content-Type": "application/json"}}],
            400,
            "pickle",
        ),
        ("protocol-0 pickle", [octet(pickle.dumps({"w": 1}, protocol=0))], 400, "pickle"),
        ("torch.save zip", [octet(_torch_zip())], 400, "torch.save"),
        (
            "unfinished chunk sequence, then another update",
            [
                octet(encode_safetensors({NORM: t[NORM]}), finished="false", update_id="first"),
                octet(encode_safetensors({UP: t[UP]}), finished="true", update_id="second", partial="true"),
            ],
            400,
            "in progress",
        ),
        (
            "chunk sequence finished without all tensors",
            [
                octet(encode_safetensors({NORM: t[NORM]}), finished="false", update_id="short"),
                octet(encode_safetensors({UP: t[UP]}), finished="true", update_id="short"),
            ],
            400,
            "missing",
        ),
    ]


@pytest.fixture(scope="module")
def seed1_tensors(rel_ckpts):
    create_checkpoint(rel_ckpts["root"] / "other_arch", seed=3, overrides={"num_hidden_layers": 1})
    return {k: np.asarray(v) for k, v in read_hf_tensors(rel_ckpts["seed1"]).items()}


def _greedy(base: str) -> list:
    body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 0.0, "logprobs": 0}
    body["return_tokens_as_token_ids"] = True
    r = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_malformed_updates_are_refused_and_old_weights_keep_serving(main_server, seed1_tensors):
    server = main_server
    version = server.restore("seed0")
    expected = _greedy(server.base)
    cases = _cases(seed1_tensors)
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as http:
        for name, reqs, status, word in cases:
            for kw in reqs:
                r = http.post("/update_weights", **kw)
            assert r.status_code == status, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert word.lower() in err["message"].lower(), (name, err)
            assert http.get("/weights_version", headers=ADMIN).json()["weights_version"] == version, name
            assert _greedy(server.base) == expected, name
            http.delete("/update_weights", headers=ADMIN)  # drop whatever a chunk case left staged
        # Control: the same client path with a well-formed payload does update.
        r = http.post(
            "/update_weights", content=encode_safetensors(seed1_tensors), headers={**ADMIN, **OCTET}
        )
        assert r.status_code == 200 and r.json()["weights_version"] == version + 1, r.text
        server.versions[version + 1] = "seed1"
    assert _greedy(server.base) != expected
    print(
        f"\nbad updates: {len(cases)} malformed payloads refused, version {version} kept serving throughout"
    )
