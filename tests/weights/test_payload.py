"""Wire formats for weight updates: safetensors, base64 JSON, pickle refusal."""

from __future__ import annotations

import base64
import io
import json
import pickle
import struct

import ml_dtypes
import numpy as np
import pytest

from hotswap.checkpoint.payload import (
    decode_json_entries,
    decode_payload,
    decode_safetensors,
    encode_json_entries,
    encode_safetensors,
    sniff_refuse_pickle,
)
from hotswap.errors import PayloadError, PickleRefused


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "layers.0.wq": rng.standard_normal((4, 6)).astype(np.float32),
        "embed": rng.standard_normal((5, 3)).astype(ml_dtypes.bfloat16),
        "final_norm": rng.standard_normal(3).astype(np.float16),
        "scale": np.array(2.5, np.float64),  # 0-d
        "ids": np.arange(7, dtype=np.int64),
        "empty": np.zeros((0, 3), np.int32),
    }


def _assert_bit_exact(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert got[k].tobytes() == w.tobytes(), k


def _st(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


# --------------------------------------------------------------------------- safetensors


def test_safetensors_roundtrip_bit_exact():
    t = _tensors()
    _assert_bit_exact(decode_safetensors(encode_safetensors(t)), t)


def test_safetensors_interop_with_reference_library():
    # We read what safetensors writes (bf16 included); it reads what we write
    # (minus bf16, which safetensors.numpy cannot load).
    from safetensors.numpy import load, save

    t = _tensors()
    _assert_bit_exact(decode_safetensors(save(t)), t)
    no_bf16 = {k: v for k, v in t.items() if v.dtype != ml_dtypes.bfloat16}
    _assert_bit_exact(load(encode_safetensors(no_bf16)), no_bf16)


def test_safetensors_arrays_are_read_only():
    arr = decode_safetensors(encode_safetensors({"w": np.ones(4, np.float32)}))["w"]
    assert not arr.flags.writeable


@pytest.mark.parametrize("cut", [0, 3, 7, 8, 20, -1, -13])
def test_safetensors_truncated(cut):
    data = encode_safetensors(_tensors())
    with pytest.raises(PayloadError, match="truncated"):
        decode_safetensors(data[:cut])


def test_safetensors_truncated_message_says_sizes():
    data = encode_safetensors({"w": np.ones(1024, np.float32)})
    with pytest.raises(PayloadError, match="header says 4096 bytes of data, got 1000"):
        decode_safetensors(data[: len(data) - 4096 + 1000])


def test_safetensors_corrupt_header_json():
    data = bytearray(encode_safetensors({"w": np.ones(4, np.float32)}))
    data[9] = ord("!")  # break the JSON right after its opening brace
    with pytest.raises(PayloadError, match="not valid JSON"):
        decode_safetensors(bytes(data))


@pytest.mark.parametrize(
    "header, data, match",
    [
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "truncated"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 16, "truncated"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 12, "needs 16 bytes"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "trailing"),
        ({"w": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unsupported"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "shape"),
        ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "data_offsets"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "begin <= end"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlaps",
        ),
        ([1, 2], b"", "JSON object"),
    ],
)
def test_safetensors_bad_headers(header, data, match):
    with pytest.raises(PayloadError, match=match):
        decode_safetensors(_st(header, data))


def test_safetensors_duplicate_header_key():
    head = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    with pytest.raises(PayloadError, match="key .w. twice"):
        decode_safetensors(struct.pack("<Q", len(head)) + head + b"\0" * 4)


def test_safetensors_huge_header_length():
    with pytest.raises(PayloadError, match="implausible"):
        decode_safetensors(struct.pack("<Q", 2**62) + b"{}")


# --------------------------------------------------------------------------- JSON entries


def test_json_entries_roundtrip_bit_exact():
    t = _tensors()
    entries = json.loads(json.dumps(encode_json_entries(t)))  # survives a real JSON trip
    _assert_bit_exact(decode_json_entries(entries), t)


@pytest.mark.parametrize("name", ["float32", "torch.float32", "F32", "float", "torch.float"])
def test_json_dtype_aliases(name):
    got = decode_json_entries(
        [{"name": "w", "dtype": name, "shape": [2], "data": base64.b64encode(b"\0" * 8).decode()}]
    )
    assert got["w"].dtype == np.float32


def test_json_bfloat16_torch_name():
    w = np.array([1.5, -2.0], ml_dtypes.bfloat16)
    e = {"name": "w", "dtype": "torch.bfloat16", "shape": [2], "data": base64.b64encode(w.tobytes()).decode()}
    _assert_bit_exact(decode_json_entries([e]), {"w": w})


def _entry(**kw):
    e = {
        "name": "layers.0.wq",
        "dtype": "float32",
        "shape": [2, 2],
        "data": base64.b64encode(b"\0" * 16).decode(),
    }
    e.update(kw)
    return e


@pytest.mark.parametrize(
    "entry, match",
    [
        (_entry(data=base64.b64encode(b"\0" * 12).decode()), r"'layers.0.wq'.*needs 16 bytes, got 12"),
        (_entry(data="not base64!!"), r"'layers.0.wq'.*base64"),
        (_entry(dtype="complex128"), r"'layers.0.wq'.*unknown dtype 'complex128'"),
        (_entry(shape="2x2"), r"'layers.0.wq'.*shape"),
        (_entry(shape=[2, True]), r"'layers.0.wq'.*shape"),
        (_entry(data=123), r"'layers.0.wq'.*base64 string"),
        ({"name": "x", "dtype": "float32", "shape": [1]}, r"missing \['data'\]"),
        ("nope", "must be an object"),
    ],
)
def test_json_entry_errors(entry, match):
    with pytest.raises(PayloadError, match=match):
        decode_json_entries([entry])


def test_json_duplicate_names():
    with pytest.raises(PayloadError, match="more than once"):
        decode_json_entries([_entry(), _entry()])


# --------------------------------------------------------------------------- pickle refusal


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_pickle_refused(protocol):
    data = pickle.dumps({"w": np.ones((2, 2), np.float32)}, protocol=protocol)
    with pytest.raises(PickleRefused):
        sniff_refuse_pickle(data)
    for ct in ("application/octet-stream", "application/json"):
        with pytest.raises(PickleRefused, match="never"):
            decode_payload(data, ct)


def test_torch_save_refused():
    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2, 2)}, buf)
    with pytest.raises(PickleRefused, match="torch.save"):
        decode_payload(buf.getvalue(), "application/octet-stream")
    # Even a truncated archive (no central directory) is recognised.
    with pytest.raises(PickleRefused, match="torch.save"):
        sniff_refuse_pickle(buf.getvalue()[:-200])


def test_torch_legacy_save_refused():
    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf, _use_new_zipfile_serialization=False)
    with pytest.raises(PickleRefused):
        decode_payload(buf.getvalue(), "application/octet-stream")


def test_object_npy_refused_plain_npy_rejected():
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(PickleRefused, match="object dtype"):
        decode_payload(buf.getvalue(), "application/octet-stream")
    buf = io.BytesIO()
    np.save(buf, np.ones(3, np.float32))
    with pytest.raises(PayloadError, match="npy"):
        decode_payload(buf.getvalue(), "application/octet-stream")


def test_safetensors_that_starts_like_a_pickle_is_accepted():
    # Header length 0x0280 = 640 puts the bytes 80 02 first: pickle's protocol-2 signature.
    w = np.ones(2, np.float32)
    header = {"__metadata__": {"pad": ""}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    header["__metadata__"]["pad"] = "x" * (640 - len(json.dumps(header)))
    data = _st(header, w.tobytes())
    assert data[:2] == b"\x80\x02"
    _assert_bit_exact(decode_payload(data, "application/octet-stream"), {"w": w})


# --------------------------------------------------------------------------- dispatch


def test_decode_payload_dispatch():
    t = {"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 3), ml_dtypes.bfloat16)}
    _assert_bit_exact(decode_payload(encode_safetensors(t), "application/octet-stream"), t)
    _assert_bit_exact(decode_payload(encode_safetensors(t), "application/x-safetensors"), t)
    body = json.dumps({"tensors": encode_json_entries(t)}).encode()
    _assert_bit_exact(decode_payload(body, "application/json; charset=utf-8"), t)
    _assert_bit_exact(decode_payload(json.dumps(encode_json_entries(t)).encode(), "application/json"), t)


@pytest.mark.parametrize(
    "data, ct, match",
    [
        (b"{}", "text/plain", "unsupported content type"),
        (b"{}", None, "unsupported content type"),
        (b"{not json", "application/json", "not valid JSON"),
        (b'{"weights": []}', "application/json", '"tensors"'),
        (b'{"tensors": {"a": 1}}', "application/json", "JSON list"),
    ],
)
def test_decode_payload_errors(data, ct, match):
    with pytest.raises(PayloadError, match=match):
        decode_payload(data, ct)


def test_nothing_is_ever_unpickled(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("unpickling was attempted")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, boom)
    monkeypatch.setattr(np, "load", boom)
    for proto in (0, 2, 5):
        with pytest.raises(PickleRefused):
            decode_payload(pickle.dumps([np.ones(2)], protocol=proto), "application/octet-stream")


def test_safetensors_like_protocol0_signature_is_accepted():
    # Header length 40 starts with '(' (pickle MARK) and a float ending in 0x2e ends with '.'.
    w = np.frombuffer(b"\x00\x00\x80\x2e", np.float32)
    header = {"__metadata__": {"p": ""}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    header["__metadata__"]["p"] = "x" * (ord("(") + 256 - len(json.dumps(header)))
    data = _st(header, w.tobytes())
    assert data[:1] == b"(" and data[-1:] == b"."
    _assert_bit_exact(decode_payload(data, "application/octet-stream"), {"w": w})
