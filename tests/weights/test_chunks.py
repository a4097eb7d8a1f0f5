"""Chunk staging of a weight update (`weights/chunks.py`): all-or-nothing, one sequence at a time."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hotswap.errors import PayloadError
from hotswap.weights.chunks import ChunkStager


def test_chunks_commit_only_on_finished():
    s = ChunkStager()
    a, b = {"a": np.ones(2, np.float32)}, {"b": np.zeros(3, np.float32)}
    assert s.add(a, finished=False, update_id="u1") is None
    assert s.pending == {"update_id": "u1", "names": ["a"], "count": 1, "bytes": 8}
    merged = s.add(b, finished=True, update_id="u1")
    assert set(merged) == {"a", "b"}
    assert s.pending["count"] == 0 and s.pending["update_id"] is None


def test_half_finished_sequence_never_commits():
    s = ChunkStager()
    s.add({"a": np.ones(2)}, finished=False, update_id="u1")
    s.abort()
    # After the abort a new sequence starts clean: "a" is gone.
    assert s.add({"b": np.ones(2)}, finished=True, update_id="u2").keys() == {"b"}


def test_chunk_duplicate_name_aborts_sequence():
    s = ChunkStager()
    s.add({"a": np.ones(2)}, finished=False, update_id="u1")
    with pytest.raises(PayloadError, match="'a' was already sent"):
        s.add({"a": np.ones(2)}, finished=True, update_id="u1")
    assert s.pending["count"] == 0


def test_chunk_other_update_id_refused_without_disturbing():
    s = ChunkStager()
    s.add({"a": np.ones(2)}, finished=False, update_id="u1")
    with pytest.raises(PayloadError, match="in progress"):
        s.add({"b": np.ones(2)}, finished=True, update_id="u2")
    with pytest.raises(PayloadError, match="in progress"):
        s.add({"b": np.ones(2)}, finished=True)  # no id is not the same sequence either
    assert s.add({"c": np.ones(2)}, finished=True, update_id="u1").keys() == {"a", "c"}


def test_chunk_stale_sequence_is_replaced():
    now = [0.0]
    s = ChunkStager(stale_after_s=30, clock=lambda: now[0])
    s.add({"a": np.ones(2)}, finished=False, update_id="dead")
    now[0] = 10.0
    with pytest.raises(PayloadError, match="in progress"):
        s.add({"b": np.ones(2)}, finished=False, update_id="new")
    now[0] = 41.0  # 31 s since the dead client's last chunk
    assert s.add({"b": np.ones(2)}, finished=True, update_id="new").keys() == {"b"}


def test_chunk_size_limit():
    s = ChunkStager(max_bytes=16)
    s.add({"a": np.ones(2, np.float32)}, finished=False)
    with pytest.raises(PayloadError, match="staging limit"):
        s.add({"b": np.ones(3, np.float32)}, finished=False)
    assert s.pending["count"] == 0


def test_chunk_stager_threads():
    s = ChunkStager()
    n = 64

    def send(i):
        s.add({f"t{i}": np.full(1, i, np.float32)}, finished=False, update_id="u")

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    merged = s.add({}, finished=True, update_id="u")
    assert len(merged) == n and all(merged[f"t{i}"][0] == i for i in range(n))
