"""Shared pieces of the reliability suite: a server subprocess, an SSE client, metrics parsing.

Every request here goes to 127.0.0.1 and carries a timeout; every loop is bounded in
count and time. `HOTSWAP_SOAK=1` scales the counts up (`scale(fast, soak)`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import ssl
import time
from pathlib import Path
from typing import Any

import httpx
from server_process import ServerProcess, cli_flags

SOAK = os.environ.get("HOTSWAP_SOAK") == "1"
API_KEY, ADMIN_KEY = "rel-api-key", "rel-admin-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODEL = "tiny"
TIMEOUT = httpx.Timeout(90.0, connect=10.0)  # generous: 2 shared cores; a hang still fails


# Plain http on loopback never uses it, but each httpx client builds an SSL context unless given
# one, loading the CA bundle: ~20 ms of event-loop time per client, which starved connects
# (ConnectTimeout) once a thousand simulated users started within seconds.
_SSL = ssl.create_default_context()


def async_client(base: str, connections: int = 1) -> httpx.AsyncClient:
    """One client per simulated user: httpx's shared pool slows down badly with hundreds of open
    streams (it held an update back for seconds). Idle connections expire before uvicorn's 5 s
    keep-alive timeout, so a request never goes out on a socket the server is closing."""
    limits = httpx.Limits(max_connections=connections, keepalive_expiry=2.0)
    return httpx.AsyncClient(base_url=base, timeout=TIMEOUT, limits=limits, verify=_SSL)


def scale(fast: int, soak: int) -> int:
    return soak if SOAK else fast


class ServerProc(ServerProcess):
    """The reliability suite's server: its keys and model name, quiet logs, the given knobs."""

    def __init__(self, model_dir: Path, log_path: Path, *, weights_root: Path | None = None, **knobs):
        flags = [str(model_dir), "--host", "127.0.0.1", "--api-key", API_KEY, "--admin-key", ADMIN_KEY]
        flags += ["--served-model-name", MODEL, "--log-level", "warning"]
        if weights_root is not None:
            flags += ["--weights-root", str(weights_root)]
        super().__init__(flags + cli_flags(**knobs), log_path)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name' or 'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metrics(base: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{base}/metrics", timeout=30).text)


def outcomes(m: dict[str, float]) -> dict[str, float]:
    kinds = ("completed", "aborted", "rejected", "errored")
    return {k: m[f'hotswap_request_outcomes_total{{outcome="{k}"}}'] for k in kinds}


def pages(m: dict[str, float]) -> dict[str, float]:
    return {k: m[f'hotswap_kv_pages{{state="{k}"}}'] for k in ("owned", "cached", "free")}


def assert_metrics_add_up(m: dict[str, float], num_pages: int) -> None:
    """Totals = sum of outcomes + in flight; every page (null page excluded) is in one state."""
    assert m["hotswap_requests_total"] == sum(outcomes(m).values()) + m["hotswap_requests_in_flight"], m
    assert sum(pages(m).values()) == num_pages - 1, pages(m)


def wait_quiescent(base: str, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or is in flight; returns the last metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base)
        busy = (
            m["hotswap_num_requests_running"]
            + m["hotswap_num_requests_waiting"]
            + m["hotswap_requests_in_flight"]
        )
        if busy == 0:
            return m
        assert time.monotonic() < deadline, f"server still busy after {timeout_s}s: {m}"
        time.sleep(0.1)


# --------------------------------------------------------------------------- SSE streams


@dataclasses.dataclass
class Choice:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    finish_count: int = 0
    spans: list[dict] | None = None
    final_version: int | None = None  # the top-level weights_version of the finishing chunk
    chunk_versions: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (tokens so far, v)

    @property
    def versions(self) -> list[int]:
        """Per-token versions: spans when several, else the one version every chunk reports."""
        if self.spans:
            return [s["version"] for s in self.spans for _ in range(s["start"], s["end"])]
        return [self.final_version] * len(self.token_ids)


@dataclasses.dataclass
class Stream:
    status: int
    body: Any = None  # the JSON error body of a refused request
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    choices: dict[int, Choice] = dataclasses.field(default_factory=dict)
    usage: dict | None = None
    errors: list[dict] = dataclasses.field(default_factory=list)  # in-band error events
    done: bool = False  # `data: [DONE]` arrived
    after_done: int = 0  # events after [DONE] (must be none)
    disconnected: bool = False  # we hung up on purpose
    sent_at: float = 0.0
    ended_at: float = 0.0


def _token_id(tok: str) -> int:
    assert tok.startswith("token_id:"), tok
    return int(tok.removeprefix("token_id:"))


def _absorb(s: Stream, event: dict) -> None:
    if "error" in event:
        s.errors.append(event["error"])
        return
    if event.get("usage"):
        s.usage = event["usage"]
    for c in event.get("choices", []):
        ch = s.choices.setdefault(c["index"], Choice())
        lp = c.get("logprobs")
        if lp:
            ch.token_ids += [_token_id(t) for t in lp["tokens"]]
            ch.logprobs += lp["token_logprobs"]
            if lp["tokens"]:
                ch.chunk_versions.append((len(ch.token_ids), event["weights_version"]))
        ch.text += c.get("text", "")
        if c.get("finish_reason") is not None:
            ch.finish_reason = c["finish_reason"]
            ch.finish_count += 1
            ch.spans = c.get("weights_version_spans")
            ch.final_version = event["weights_version"]


async def stream_completion(
    client: httpx.AsyncClient,
    body: dict,
    *,
    stop_after_events: int | None = None,
    headers=None,
    accepted: asyncio.Event | None = None,
) -> Stream:
    """POST a streaming /v1/completions and parse every event; optionally hang up early.
    `accepted` is set once the response headers arrive (the server took the request)."""
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **body}
    s = Stream(status=0, sent_at=time.monotonic())
    async with client.stream("POST", "/v1/completions", json=body, headers=headers or AUTH) as r:
        s.status, s.headers = r.status_code, dict(r.headers)
        if accepted is not None:
            accepted.set()
        if r.status_code != 200:
            raw = await r.aread()
            s.body = json.loads(raw) if raw else None
            s.ended_at = time.monotonic()
            return s
        if stop_after_events == 0:  # hang up as soon as the headers arrive
            s.disconnected, s.ended_at = True, time.monotonic()
            return s
        events = 0
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if s.done:
                s.after_done += 1
                continue
            if line == "data: [DONE]":
                s.done = True
                continue
            _absorb(s, json.loads(line[6:]))
            events += 1
            if stop_after_events is not None and events >= stop_after_events:
                s.disconnected = True
                break  # leaving the block closes the connection mid-stream
    s.ended_at = time.monotonic()
    return s


async def gather_bounded(coros, timeout_s: float) -> list[Any]:
    """All of them, or fail after `timeout_s` (a hang is a failure, not a stuck suite)."""
    return await asyncio.wait_for(asyncio.gather(*coros), timeout_s)
