"""Chunked weight updates: the staging area that commits chunks all-or-nothing.

An update sent in chunks (REST `/update_weights` with `finished=false` until the
last, or `Engine.update_weights_chunk`) accumulates here as decoded HF-named
tensors; on `finished=True` the merged set goes through `Engine.update_weights`
as one source, so it is validated and swapped like any other. The Engine holds
the stager (the REST routes and the multihost Driver both reach it there), so
one engine has one chunk sequence whatever path the chunks came by.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from hotswap.errors import PayloadError


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
