"""A FastAPI app served by uvicorn on 127.0.0.1 in a thread of the test's own process, so the test
can look inside the engine behind it (pages, sequences, counters) while it drives real HTTP."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def serving(app, start_timeout_s: float = 60) -> Iterator[str]:
    """Yields the base URL of `app` on a free loopback port; the server stops on exit."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
