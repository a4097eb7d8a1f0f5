"""Safe wire formats for weight updates: safetensors bytes and base64 JSON entries.

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
import threading
import time
import zipfile
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
            raise PayloadError(f"safetensors header has the key {k!r} twice")
        out[k] = v
    return out


def decode_safetensors(data: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """Parse safetensors bytes with strict validation; PayloadError says what is wrong."""
    buf = memoryview(data).cast("B")
    if len(buf) < 8:
        raise PayloadError(f"truncated safetensors payload: need 8 bytes of header length, got {len(buf)}")
    (header_len,) = struct.unpack("<Q", buf[:8])
    if header_len > _MAX_HEADER_BYTES:
        raise PayloadError(
            f"safetensors header length {header_len} is implausible (limit {_MAX_HEADER_BYTES})"
        )
    if 8 + header_len > len(buf):
        raise PayloadError(
            f"truncated safetensors payload: header says {header_len} header bytes, got {len(buf) - 8}"
        )
    try:
        header = json.loads(bytes(buf[8 : 8 + header_len]).decode("utf-8"), object_pairs_hook=_no_dup_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"safetensors header is not valid JSON: {e}") from None
    except RecursionError:  # [[[[...]]]] thousands deep: json's parser gives up
        raise PayloadError("safetensors header is nested too deeply (not a safetensors header)") from None
    if not isinstance(header, dict):
        raise PayloadError(f"safetensors header must be a JSON object, got {type(header).__name__}")
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
            f"truncated safetensors payload: header says {expected_end} bytes of data, got {len(body)}"
        )
    pos = 0
    for begin, end, name, _, _ in specs:
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else f"leaves a gap at byte {pos}"
            raise PayloadError(f"tensor {name!r}: data_offsets [{begin}, {end}] {what}")
        pos = end
    if len(body) != expected_end:
        raise PayloadError(
            f"safetensors payload has {len(body) - expected_end} trailing bytes after the tensor data"
        )
    base = 8 + header_len
    return {name: _view(buf, dtype, shape, base + begin) for begin, _, name, dtype, shape in specs}


def encode_safetensors(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """Encode numpy (or jax) arrays as safetensors bytes, in name order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    chunks, pos = [], 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        tag = _ST_TAGS.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if tag is None:
            raise PayloadError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors equivalent")
        raw = np.ascontiguousarray(arr).astype(_ST_DTYPES[tag], copy=False).tobytes()
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [pos, pos + len(raw)]}
        chunks.append(raw)
        pos += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # pad so the data section is 8-byte aligned, as safetensors does
    return b"".join([struct.pack("<Q", len(head)), head, *chunks])


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


def decode_payload(data: bytes | bytearray | memoryview, content_type: str | None) -> dict[str, np.ndarray]:
    """Decode a REST weight payload by content type, refusing pickles first."""
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


# --------------------------------------------------------------------------- chunked updates


class ChunkStager:
    """Staging area for a chunked update; commits all-or-nothing on `finished=True`.

    One sequence at a time. Choices, so that nothing mixes silently:
    - a chunk whose `update_id` differs from the in-progress sequence's (None
      counts as an id) is refused with PayloadError and the in-progress sequence
      is left alone: the newcomer has to wait, or `abort()` first. A sequence
      idle for over `stale_after_s` is dropped instead, so a client that died
      mid-upload cannot block updates forever;
    - a chunk that repeats a staged tensor name, or pushes the total over
      `max_bytes`, poisons its own sequence: PayloadError and everything staged
      is dropped, so the client restarts rather than committing a partial set.
    """

    def __init__(
        self, max_bytes: int | None = None, stale_after_s: float | None = None, clock=time.monotonic
    ):
        self._lock = threading.Lock()
        self._max_bytes, self._stale_after_s, self._clock = max_bytes, stale_after_s, clock
        self._last_chunk_at = 0.0
        self._tensors: dict[str, np.ndarray] = {}
        self._update_id: str | None = None
        self._active = False  # distinct from "no tensors": an empty first chunk still opens a sequence
        self._nbytes = 0

    def add(
        self, tensors: dict[str, np.ndarray], *, finished: bool, update_id: str | None = None
    ) -> dict[str, np.ndarray] | None:
        """Stage one chunk. Returns the merged update only on `finished=True`, else None."""
        with self._lock:
            now = self._clock()
            stale = self._stale_after_s is not None and now - self._last_chunk_at > self._stale_after_s
            if self._active and update_id != self._update_id and stale:
                self._clear()
            if self._active and update_id != self._update_id:
                raise PayloadError(
                    f"chunk for update {update_id!r} while update {self._update_id!r} is in progress "
                    f"({len(self._tensors)} tensors staged); finish or abort it first"
                )
            dup = sorted(set(tensors) & self._tensors.keys())
            if dup:
                self._clear()
                raise PayloadError(
                    f"tensor {dup[0]!r} was already sent in an earlier chunk; staged update aborted"
                )
            nbytes = self._nbytes + sum(int(a.nbytes) for a in tensors.values())
            if self._max_bytes is not None and nbytes > self._max_bytes:
                self._clear()
                raise PayloadError(
                    f"chunked update exceeds the staging limit of {self._max_bytes} bytes; staged update aborted"
                )
            self._tensors.update(tensors)
            self._nbytes, self._update_id, self._active, self._last_chunk_at = nbytes, update_id, True, now
            if not finished:
                return None
            merged = self._tensors
            self._clear()
            return merged

    def abort(self) -> None:
        """Drop everything staged; nothing is committed."""
        with self._lock:
            self._clear()

    @property
    def pending(self) -> dict[str, Any]:
        """What is staged now: update_id, sorted names, count and bytes."""
        with self._lock:
            return {
                "update_id": self._update_id,
                "names": sorted(self._tensors),
                "count": len(self._tensors),
                "bytes": self._nbytes,
            }

    def _clear(self) -> None:
        self._tensors, self._update_id, self._active, self._nbytes = {}, None, False, 0
