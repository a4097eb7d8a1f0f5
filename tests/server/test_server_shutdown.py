"""SIGTERM on a real `hotswap serve` (a server of this file's own, since the test ends it):
in-flight streams run to completion, new work is refused, and the process exits 0."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from api_helpers import complete, start_server


@pytest.fixture(scope="module")
def api_server(weights_root, tmp_path_factory):
    """Overrides the shared server of tests/conftest.py: this file's test shuts its server down."""
    with start_server(weights_root, tmp_path_factory.mktemp("log") / "server.log") as server:
        server.wait_healthy(180)
        yield server


def test_sigterm_finishes_in_flight_then_exits_0(api_server, api_client):
    stream = complete(api_client, "Hello", max_tokens=100, stream=True, extra_body={"ignore_eos": True})
    chunks = [next(stream)]  # the request is in flight now
    api_server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:  # new work is refused: 503 while the listener closes, then no connection at all
        assert httpx.get(api_server.base + "/health", timeout=5).status_code == 503
    except httpx.TransportError:
        pass
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"  # the in-flight stream ran to completion
    assert sum(len(c.choices[0].text) for c in chunks) > 0
    assert api_server.proc.wait(60) == 0
    assert "Traceback" not in api_server.log()
