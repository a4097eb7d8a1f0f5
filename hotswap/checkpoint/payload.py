"""Safe wire formats for weight updates, and the one safetensors codec (files use it too).

The safetensors parser (`decode_safetensors`) and its dtype table are the only
ones in hotswap: `safetensors_io.py` reads and writes checkpoint files through
them. Base64 JSON entries are the other wire format.

Nothing here ever unpickles. Pickle, torch.save and object-dtype .npy payloads
are recognised by their bytes only so the client gets a clear PickleRefused
instead of a confusing "bad safetensors header"; the safety itself comes from
the fact that the only decoders are a JSON header parser and `np.frombuffer`.

Decoded arrays are read-only, zero-copy views into the request body where the
alignment allows it (the engine `device_put`s them anyway, so a host copy here
would only double peak memory for a multi-GB update).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import struct
import zipfile
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from hotswap.errors import PayloadError, PickleRefused

# safetensors dtype tag <-> numpy dtype. Little-endian throughout, as the format requires.
_ST_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_ST_TAGS: dict[np.dtype, str] = {dt: tag for tag, dt in _ST_DTYPES.items()}

# JSON-entry dtype names: numpy names ("float32", "bfloat16"), the same with a "torch."
# prefix, torch's C-style aliases, and the safetensors tags themselves.
_NAME_ALIASES: dict[str, str] = {
    **{dt.name: tag for tag, dt in _ST_DTYPES.items()},
    **{"short": "I16", "int": "I32", "long": "I64", "half": "F16", "float": "F32", "double": "F64"},
}

# A header larger than this is an attack or a bug, not a model (real ones are < 1 MiB).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def _dtype_from_name(name: Any, tensor: str) -> np.dtype:
    if not isinstance(name, str):
        raise PayloadError(f"tensor {tensor!r}: dtype must be a string, got {name!r}")
    key = name.removeprefix("torch.")
    tag = key if key in _ST_DTYPES else _NAME_ALIASES.get(key.lower())
    if tag is None:
        raise PayloadError(
            f"tensor {tensor!r}: unknown dtype {name!r}; use one of {sorted(set(_NAME_ALIASES))}"
        )
    return _ST_DTYPES[tag]


def _shape(shape: Any, tensor: str) -> tuple[int, ...]:
    # bool is an int subclass; `True` as a dimension is a client bug, not a 1.
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise PayloadError(f"tensor {tensor!r}: shape must be a list of non-negative ints, got {shape!r}")
    return tuple(shape)


def _view(buf: bytes | memoryview, dtype: np.dtype, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """Read-only array over buf[offset:]; copied only when misaligned for its dtype."""
    arr = np.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
    if not arr.flags.aligned:
        arr = arr.copy()
    arr.flags.writeable = False  # a bytearray body would otherwise give writable views
    return arr


# --------------------------------------------------------------------------- safetensors


def _no_dup_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of duplicate keys; two entries for one tensor name is an error.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise PayloadError(
                f"corrupt safetensors header: duplicate key {k!r} (it has the key {k!r} twice)"
            )
        out[k] = v
    return out


def decode_safetensors(data: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """Parse safetensors bytes with strict validation; PayloadError says what is wrong."""
    buf = memoryview(data).cast("B")
    if len(buf) < 8:
        raise PayloadError(f"truncated safetensors: need 8 bytes of header length, got {len(buf)}")
    (header_len,) = struct.unpack("<Q", buf[:8])
    if header_len > _MAX_HEADER_BYTES:
        raise PayloadError(
            f"corrupt or truncated safetensors header: header length {header_len} is implausible "
            f"(limit {_MAX_HEADER_BYTES})"
        )
    if 8 + header_len > len(buf):
        raise PayloadError(
            f"truncated safetensors: header says {header_len} header bytes, got {len(buf) - 8}"
        )
    try:
        header = json.loads(bytes(buf[8 : 8 + header_len]).decode("utf-8"), object_pairs_hook=_no_dup_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"corrupt safetensors header: not valid JSON: {e}") from None
    except RecursionError:  # [[[[...]]]] thousands deep: json's parser gives up
        raise PayloadError(
            "corrupt safetensors header: nested too deeply (not a safetensors header)"
        ) from None
    if not isinstance(header, dict):
        raise PayloadError(f"corrupt safetensors header: must be a JSON object, got {type(header).__name__}")
    header.pop("__metadata__", None)

    body = buf[8 + header_len :]
    specs = []
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise PayloadError(f"tensor {name!r}: header entry needs dtype, shape and data_offsets")
        tag = info["dtype"]
        if tag not in _ST_DTYPES:
            raise PayloadError(f"tensor {name!r}: unsupported safetensors dtype {tag!r}")
        dtype, shape = _ST_DTYPES[tag], _shape(info["shape"], name)
        offs = info["data_offsets"]
        if not (
            isinstance(offs, list)
            and len(offs) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            and 0 <= offs[0] <= offs[1]
        ):
            raise PayloadError(f"tensor {name!r}: data_offsets must be [begin, end] with begin <= end")
        need = math.prod(shape) * dtype.itemsize
        if offs[1] - offs[0] != need:
            raise PayloadError(
                f"tensor {name!r}: shape {list(shape)} {tag} needs {need} bytes, "
                f"data_offsets span {offs[1] - offs[0]}"
            )
        specs.append((offs[0], offs[1], name, dtype, shape))

    # Tensors must tile the data section exactly: no overlaps (aliasing), no gaps, no tail.
    specs.sort(key=lambda s: (s[0], s[1]))
    expected_end = specs[-1][1] if specs else 0
    if expected_end > len(body):
        raise PayloadError(
            f"truncated safetensors: header says {expected_end} bytes of data, got {len(body)}"
        )
    pos = 0
    for begin, end, name, _, _ in specs:
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else f"leaves a gap at byte {pos}"
            raise PayloadError(f"tensor {name!r}: data_offsets [{begin}, {end}] {what}")
        pos = end
    if len(body) != expected_end:
        raise PayloadError(
            f"safetensors data has {len(body) - expected_end} trailing bytes after the tensor data"
        )
    base = 8 + header_len
    return {name: _view(buf, dtype, shape, base + begin) for begin, _, name, dtype, shape in specs}


def safetensors_layout(
    tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[np.ndarray]]:
    """(length + header bytes, the C-contiguous arrays whose bytes follow, in name order).

    What `encode_safetensors` joins in memory and `safetensors_io.write_safetensors`
    streams to a file, so both write the same bytes.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    arrays, pos = [], 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        tag = _ST_TAGS.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if tag is None:
            raise PayloadError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors equivalent")
        shape = list(arr.shape)  # before ascontiguousarray, which may make a 0-d array 1-d
        arr = np.ascontiguousarray(arr).astype(_ST_DTYPES[tag], copy=False)
        header[name] = {"dtype": tag, "shape": shape, "data_offsets": [pos, pos + arr.nbytes]}
        arrays.append(arr)
        pos += arr.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # pad so the data section is 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(head)) + head, arrays


def encode_safetensors(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """Encode numpy (or jax) arrays as safetensors bytes, in name order."""
    head, arrays = safetensors_layout(tensors, metadata)
    return b"".join([head, *(a.tobytes() for a in arrays)])


# --------------------------------------------------------------------------- JSON entries


def decode_json_entries(entries: Any) -> dict[str, np.ndarray]:
    """`[{"name","dtype","shape","data": base64}]` -> arrays. PayloadError names the tensor."""
    if not isinstance(entries, list):
        raise PayloadError(f"tensors must be a JSON list of entries, got {type(entries).__name__}")
    out: dict[str, np.ndarray] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise PayloadError(f"tensors[{i}] must be an object, got {type(entry).__name__}")
        missing = {"name", "dtype", "shape", "data"} - entry.keys()
        if missing:
            raise PayloadError(f"tensors[{i}] ({entry.get('name')!r}) is missing {sorted(missing)}")
        name = entry["name"]
        if not isinstance(name, str) or not name:
            raise PayloadError(f"tensors[{i}]: name must be a non-empty string, got {name!r}")
        if name in out:
            raise PayloadError(f"tensor {name!r} appears more than once in the payload")
        dtype, shape = _dtype_from_name(entry["dtype"], name), _shape(entry["shape"], name)
        if not isinstance(entry["data"], str):
            raise PayloadError(f"tensor {name!r}: data must be a base64 string")
        try:
            raw = base64.b64decode(entry["data"], validate=True)
        except (binascii.Error, ValueError) as e:
            raise PayloadError(f"tensor {name!r}: data is not valid base64 ({e})") from None
        need = math.prod(shape) * dtype.itemsize
        if len(raw) != need:
            raise PayloadError(
                f"tensor {name!r}: shape {list(shape)} {entry['dtype']} needs {need} bytes, got {len(raw)}"
            )
        out[name] = _view(raw, dtype, shape, 0)
    return out


def encode_json_entries(tensors: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Arrays -> JSON entries with little-endian base64 data (dtype as its numpy name)."""
    entries = []
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        entries.append(
            {
                "name": name,
                "dtype": arr.dtype.name,
                "shape": list(arr.shape),
                "data": base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii"),
            }
        )
    return entries


# --------------------------------------------------------------------------- refusal + dispatch

_REFUSE_HINT = "send safetensors bytes (application/octet-stream) or base64 JSON entries instead"


def _looks_like_safetensors(data: bytes | memoryview) -> bool:
    # A header length such as 0x0280 starts with the bytes 80 02, exactly pickle's
    # protocol-2 signature; safetensors is told apart by its '{' at byte 8.
    if len(data) < 9:
        return False
    (n,) = struct.unpack("<Q", data[:8])
    return 8 + n <= len(data) and data[8:9] == b"{"


def sniff_refuse_pickle(data: bytes | bytearray | memoryview) -> None:
    """Raise PickleRefused if the bytes look like pickle, torch.save, or object .npy."""
    data = memoryview(data).cast("B")
    head = bytes(data[:16])
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        if not _looks_like_safetensors(data):
            raise PickleRefused(
                f"payload is a pickle (protocol {head[1]}; also what legacy torch.save and "
                f"ForkingPickler write); pickles are never loaded: {_REFUSE_HINT}"
            )
    # Protocol 0/1 pickles start with MARK / EMPTY_DICT / EMPTY_LIST / GLOBAL and end in STOP.
    # JSON never starts with these bytes, so this cannot catch a JSON body.
    if (
        head[:1] in (b"(", b"}", b"]", b"c", b")")
        and bytes(data[-1:]) == b"."
        and not _looks_like_safetensors(data)
    ):
        raise PickleRefused(
            f"payload looks like a protocol 0/1 pickle; pickles are never loaded: {_REFUSE_HINT}"
        )
    if head.startswith(b"PK\x03\x04"):
        try:
            names = zipfile.ZipFile(io.BytesIO(data)).namelist()  # reads the directory, not members
            is_torch = any(n == "data.pkl" or n.endswith("/data.pkl") for n in names)
        except (zipfile.BadZipFile, ValueError, OSError):
            # A truncated archive has no central directory; member names are also in local headers.
            is_torch = b"data.pkl" in bytes(data)
        if is_torch:
            raise PickleRefused(
                f"payload is a torch.save archive (zip with data.pkl); torch.load is never used: {_REFUSE_HINT}"
            )
    if head.startswith(b"\x93NUMPY"):
        try:
            f = io.BytesIO(bytes(data[: 1 << 20]))  # the header is at most a few KB; skip the body
            version = np.lib.format.read_magic(f)
            # read_array_header_* parse the header dict with a literal-only parser.
            header = (
                np.lib.format.read_array_header_1_0(f)
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0(f)
            )
            has_object = header[2].hasobject
        except Exception:  # a broken .npy header is simply not a pickle we can name
            has_object = False
        if has_object:
            raise PickleRefused(f"payload is a .npy with object dtype (pickled objects): {_REFUSE_HINT}")


def decode_json_body(body: Any) -> dict[str, np.ndarray]:
    """A parsed JSON body: `{"tensors": [entries]}` or a bare list of entries."""
    if isinstance(body, dict):
        if "tensors" not in body:
            raise PayloadError('JSON weight payload needs a "tensors" list of {name, dtype, shape, data}')
        body = body["tensors"]
    return decode_json_entries(body)


def decode_payload(
    data: bytes | bytearray | memoryview | list, content_type: str | None
) -> dict[str, np.ndarray]:
    """Decode a REST weight payload by content type, refusing pickles first.

    `data` is the body's bytes, or the `tensors` list of a JSON body the caller
    has parsed already (to read its other fields).
    """
    if isinstance(data, list):
        return decode_json_entries(data)
    sniff_refuse_pickle(data)
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind in ("application/octet-stream", "application/x-safetensors", "application/safetensors"):
        if bytes(memoryview(data)[:6]) == b"\x93NUMPY":
            raise PayloadError(f"numpy .npy payloads are not accepted: {_REFUSE_HINT}")
        return decode_safetensors(data)
    if kind == "application/json":
        try:
            body = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PayloadError(f"JSON weight payload is not valid JSON: {e}") from None
        except RecursionError:
            raise PayloadError("JSON weight payload is nested too deeply") from None
        return decode_json_body(body)
    raise PayloadError(
        f"unsupported content type {content_type!r} for weights; use application/octet-stream "
        "(safetensors) or application/json"
    )
