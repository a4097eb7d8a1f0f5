"""Backpressure and graceful shutdown, on a server of its own (a small queue; SIGTERM ends it).

A burst of 10x the queue capacity: the overflow gets 429 with Retry-After (and may retry),
everything admitted completes. Then SIGTERM with the queue full: in-flight streams run to
their end, new work is refused, the process exits 0 within the shutdown timeout.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from helpers import KNOBS

from .relkit import (
    AUTH,
    MODEL,
    TIMEOUT,
    ServerProc,
    assert_metrics_add_up,
    async_client,
    gather_bounded,
    outcomes,
    scale,
    stream_completion,
    wait_quiescent,
)

MAX_WAITING, MAX_SEQS, NUM_PAGES = 8, 2, 64
# KNOBS' 128-token context: long streams for the SIGTERM test; still one page-table bucket.
QUEUE_KNOBS = {
    **KNOBS,
    "max_num_seqs": MAX_SEQS,
    "num_pages": NUM_PAGES,
    "max_waiting": MAX_WAITING,
    "shutdown_timeout": 30,
}
BURST = 10 * MAX_WAITING
BURST_ROUNDS = scale(1, 5)
BODY = {"prompt": [11, 12, 13, 14], "max_tokens": 32, "ignore_eos": True}


@pytest.fixture(scope="module")
def small_server(rel_ckpts, tmp_path_factory):
    proc = ServerProc(rel_ckpts["seed0"], tmp_path_factory.mktemp("small-log") / "server.log", **QUEUE_KNOBS)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.kill()


async def _burst(base: str) -> list:
    go = asyncio.Event()

    async def one():
        async with async_client(base) as client:
            await go.wait()  # all at once
            return await stream_completion(client, BODY)

    tasks = [asyncio.create_task(one()) for _ in range(BURST)]
    await asyncio.sleep(0.2)
    go.set()
    return await gather_bounded(tasks, timeout_s=180)


def test_burst_over_capacity_gets_429_with_retry_after(small_server):
    base = small_server.base
    for _ in range(BURST_ROUNDS):
        before = outcomes(wait_quiescent(base))
        results = asyncio.run(_burst(base))
        refused = [s for s in results if s.status == 429]
        admitted = [s for s in results if s.status == 200]
        assert len(refused) + len(admitted) == BURST, sorted({s.status for s in results})
        for s in refused:
            assert int(s.headers["retry-after"]) >= 1
            assert (
                s.body["error"]["type"] == "rate_limit_error" and "max_waiting" in s.body["error"]["message"]
            )
        for s in admitted:
            c = s.choices[0]
            assert s.done and not s.errors and c.finish_reason == "length" and c.finish_count == 1, s
        # Admission: the queue, the running slots, plus whatever finished while the burst arrived.
        assert len(refused) >= BURST // 2, f"only {len(refused)} of {BURST} refused"
        after = wait_quiescent(base)
        assert_metrics_add_up(after, NUM_PAGES)
        o = outcomes(after)
        assert o["rejected"] - before["rejected"] == len(refused)
        assert o["completed"] - before["completed"] == len(admitted)
    # The overflow is retryable: after Retry-After the same request goes through.
    time.sleep(int(refused[0].headers["retry-after"]))
    body = {"model": MODEL, **BODY}
    r = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    print(
        f"\nbackpressure: burst {BURST} into queue {MAX_WAITING}: {len(admitted)} admitted, {len(refused)} x 429"
    )


async def _in_flight_then_sigterm(proc: ServerProc, n: int) -> tuple[list, list, float]:
    body = {**BODY, "max_tokens": 120}
    keep_alive = httpx.AsyncClient(base_url=proc.base, timeout=10)
    assert (await keep_alive.get("/health")).status_code == 200  # a connection open before SIGTERM
    accepted = [asyncio.Event() for _ in range(n)]

    async def one(event: asyncio.Event):
        async with async_client(proc.base) as client:
            return await stream_completion(client, body, accepted=event)

    tasks = [asyncio.create_task(one(a)) for a in accepted]
    await asyncio.wait_for(asyncio.gather(*(a.wait() for a in accepted)), 30)
    proc.terminate()  # at once: all n are queued or running, with ~n*120 tokens still to generate
    sigterm_at = time.monotonic()
    await asyncio.sleep(0.05)
    refusals = []
    for c in (keep_alive, httpx.AsyncClient(base_url=proc.base, timeout=10)):
        try:  # a kept-alive connection gets 503; a new one gets 503 or finds the listener closed
            r = await c.post("/v1/completions", json={"model": MODEL, **BODY}, headers=AUTH)
            refusals.append(r.status_code)
        except httpx.TransportError as e:
            refusals.append(type(e).__name__)
        finally:
            await c.aclose()
    return await gather_bounded(tasks, timeout_s=60), refusals, sigterm_at


def test_sigterm_drains_in_flight_refuses_new_exits_0(small_server):
    n = MAX_WAITING  # a full queue: every request arrives before any is scheduled
    t0 = time.monotonic()
    streams, refusals, sigterm_at = asyncio.run(_in_flight_then_sigterm(small_server, n))
    for s in streams:
        c = s.choices[0]
        assert s.status == 200 and s.done and not s.errors, s
        assert c.finish_reason == "length" and c.finish_count == 1, c
        assert s.usage["completion_tokens"] == 120
    still_running = sum(s.ended_at > sigterm_at for s in streams)
    assert still_running >= n // 2, "the streams ended before SIGTERM: nothing was in flight"
    assert all(r == 503 or isinstance(r, str) for r in refusals), refusals
    assert small_server.proc.wait(60) == 0
    took = time.monotonic() - t0
    assert took < QUEUE_KNOBS["shutdown_timeout"] + 30
    assert "Traceback" not in small_server.log()
    print(
        f"\nshutdown: {still_running}/{n} streams in flight at SIGTERM, all completed; "
        f"new work got {refusals}; exit 0 in {took:.1f}s"
    )
