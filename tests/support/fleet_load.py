"""Streams through a router while a fleet commits updates: what the fleet tests and the soak
measure. Each of `streams` workers sends streaming `/v1/completions` back to back (a shared
prefix, so prefix hits happen) until told to stop; every response records the weights versions
its chunks carried, whether any chunk said its tokens mixed versions (`weights_version_spans`)
or were computed over older KV (`mixed_weights_kv`: a stale prefix or kept page), its cached
prompt tokens, and when it started."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

# Replica engine options of the fleet tests: the tiny model, no warm-up, room for the streams.
FLEET_KNOBS = {
    "max_model_len": 128,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "page_size": 16,
    "warmup": False,
}
SHARED = "You are a rollout worker. Answer briefly and stay on topic. "


@dataclasses.dataclass
class Response:
    started: float
    status: int
    versions: set[int]
    spans: bool
    mixed_kv: bool
    cached_tokens: int


class Load:
    def __init__(self, base: str, headers: dict[str, str], model: str, streams: int, max_tokens: int = 16):
        self.base, self.headers, self.model = base, headers, model
        self.streams, self.max_tokens = streams, max_tokens
        self.responses: list[Response] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(streams)
        self._futures = []

    def _one(self, client: httpx.Client, worker: int, turn: int) -> Response:
        body = {
            "model": self.model,
            "prompt": f"{SHARED}Question {worker}.{turn}:",
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.monotonic()
        versions, spans, mixed, cached = set(), False, False, 0
        with client.stream("POST", self.base + "/v1/completions", json=body, headers=self.headers) as r:
            if r.status_code != 200:
                r.read()
                return Response(started, r.status_code, versions, spans, mixed, cached)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                versions.add(chunk["weights_version"])
                for choice in chunk.get("choices", []):
                    spans |= "weights_version_spans" in choice
                    mixed |= bool(choice.get("mixed_weights_kv"))
                if chunk.get("usage"):
                    cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return Response(started, 200, versions, spans, mixed, cached)

    def _worker(self, worker: int) -> None:
        with httpx.Client(timeout=120) as client:
            turn = 0
            while not self._stop.is_set():
                out = self._one(client, worker, turn)
                with self._lock:
                    self.responses.append(out)
                turn += 1

    def start(self) -> None:
        self._futures = [self._pool.submit(self._worker, w) for w in range(self.streams)]

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.result()  # a worker's exception fails the test here
        self._pool.shutdown()

    def wait_for(self, count: int, timeout_s: float = 120.0) -> None:
        """Until `count` more responses have ended (the load is under way)."""
        target = len(self.responses) + count
        deadline = time.monotonic() + timeout_s
        while len(self.responses) < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.responses)} responses, wanted {target}")
            time.sleep(0.05)


def two_version_responses(responses: list[Response]) -> int:
    """Responses whose tokens carry more than one weights version."""
    return sum(1 for r in responses if len(r.versions) > 1 or r.spans)


def stale_kv_responses(responses: list[Response]) -> int:
    """Responses with a token computed over KV of another version (a stale prefix hit included)."""
    return sum(1 for r in responses if r.mixed_kv)


def older_than_committed(responses: list[Response], commits: list[tuple[float, int]]) -> int:
    """Responses that started after a fleet commit returned (monotonic time, version) and still
    carry an older version: a replica serving v behind the router after the fleet moved to v+1."""
    bad = 0
    for r in responses:
        floor = max((v for t, v in commits if t <= r.started), default=None)
        if floor is not None and r.versions and min(r.versions) < floor:
            bad += 1
    return bad
