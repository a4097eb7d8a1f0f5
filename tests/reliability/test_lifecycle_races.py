"""Lifecycle races: sleep / wakeup / update / reset against each other and against traffic.

Every call has a timeout (a deadlock fails the test instead of hanging it), every answer
is 200 or a refusal that names the conflict (409 for a conflicting call; 503 with
Retry-After for work asked of a sleeping engine, which will serve again after a wakeup),
no stream ends without `[DONE]`, and each committed update raises the version by
exactly one (no update lost or applied twice).
Then many sleep/wakeup cycles: outputs stay identical and the server's memory stays flat.
"""

from __future__ import annotations

import asyncio
import random

import httpx

from .relkit import (
    ADMIN,
    AUTH,
    MODEL,
    TIMEOUT,
    assert_metrics_add_up,
    async_client,
    gather_bounded,
    metrics,
    scale,
    stream_completion,
    wait_quiescent,
)

ROUNDS = scale(4, 20)
STREAMS_PER_ROUND = scale(32, 64)
CYCLES = scale(100, 400)
RSS_TOLERANCE_KIB = 48 * 1024  # allocator noise; a leaked KV cache (2 MiB) per cycle is 200 MiB
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 40)), [300, 11, 250, 42]]


def _greedy(base: str) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        body = {"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0.0, "logprobs": 0}
        body["return_tokens_as_token_ids"] = True
        r = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["logprobs"]["tokens"])
    return out


def _ops(rng: random.Random) -> list[tuple[str, str, dict]]:
    """One round's lifecycle calls: (method, path, request kwargs)."""
    ops = [
        ("POST", "/sleep", {"params": {"level": 1}}),
        ("POST", "/sleep", {"params": {"level": 1, "mode": "wait"}}),
        ("POST", "/wakeup", {}),
        ("POST", "/wakeup", {"params": {"tags": "weights"}}),
        ("POST", "/reset_prefix_cache", {}),
        ("POST", "/reset_prefix_cache", {}),
        ("GET", "/is_sleeping", {}),
    ]
    for policy in rng.sample(["drain", "abort", "recompute", "keep"], 3):
        ops.append(
            ("POST", "/update_weights", {"json": {"path": rng.choice(["seed0", "seed1"]), "policy": policy}})
        )
    if rng.random() < 0.5:
        ops.append(("POST", "/sleep", {"params": {"level": 2}}))
    rng.shuffle(ops)
    return ops


async def _round(server, rng: random.Random) -> tuple[list, list]:
    async def call(method, path, kw):
        await asyncio.sleep(rng.uniform(0, 1.0))
        async with async_client(server.base) as client:
            r = await client.request(method, path, headers=ADMIN, **kw)
        return path, kw, r.status_code, r.json()

    async def gen(i):
        await asyncio.sleep(rng.uniform(0, 1.2))
        body = {"prompt": [10 + i % 7] * (3 + i % 9), "max_tokens": 40, "ignore_eos": True, "logprobs": 0}
        body["return_tokens_as_token_ids"] = True
        async with async_client(server.base) as client:
            return await stream_completion(client, body)

    ops = [call(*op) for op in _ops(rng)]
    gens = [gen(i) for i in range(STREAMS_PER_ROUND)]
    results = await gather_bounded([*ops, *gens], timeout_s=120)
    return results[: len(ops)], results[len(ops) :]


def _assert_refusal(status: int, body: dict) -> None:
    """A refused lifecycle call or request says why: a conflict (409) or a sleeping engine (503)."""
    err = body["error"]
    want = {409: "conflict_error", 503: "service_unavailable_error"}[status]
    assert err["type"] == want and err["message"], body
    if status == 503:
        assert err["code"] == "engine_asleep", body


def _recover(server) -> None:
    """Awake and serving after a round (a level-2 sleep may have dropped the weights)."""
    assert httpx.post(f"{server.base}/wakeup", headers=ADMIN, timeout=60).status_code == 200
    probe = {"model": MODEL, "prompt": [5], "max_tokens": 1}
    r = httpx.post(f"{server.base}/v1/completions", json=probe, headers=AUTH, timeout=TIMEOUT)
    if r.status_code == 503:  # level 2: asleep (no weights) until an update
        assert server.update("seed0").status_code == 200
    else:
        assert r.status_code == 200, r.text


def test_lifecycle_calls_race_each_other_and_traffic(main_server):
    server = main_server
    server.restore("seed1")
    expected = {"seed1": _greedy(server.base)}
    server.restore("seed0")
    expected["seed0"] = _greedy(server.base)
    rng = random.Random("races")
    conflicts, statuses, aborted_streams = 0, [], 0
    for _ in range(ROUNDS):
        before = server.version()
        calls, streams = asyncio.run(_round(server, rng))
        committed = 0
        for path, kw, status, body in calls:
            statuses.append(status)
            assert status in (200, 409, 503), (path, kw, status, body)
            if status != 200:
                conflicts += 1
                _assert_refusal(status, body)
            elif path == "/update_weights":
                committed += 1
                server.versions[body["weights_version"]] = kw["json"]["path"]
        for s in streams:
            assert s.status in (200, 503), (s.status, s.body)
            if s.status == 503:
                _assert_refusal(s.status, s.body)
                assert int(s.headers["retry-after"]) >= 1
                continue
            c = s.choices[0]
            assert s.done and not s.errors and c.finish_count == 1, s
            assert c.finish_reason in ("length", "abort"), c  # ignore_eos: only a sleep or update cuts
            aborted_streams += c.finish_reason == "abort"
            assert s.usage["completion_tokens"] == len(c.token_ids)
        assert server.version() == before + committed  # updates serialise: each adds exactly one
        _recover(server)
        assert _greedy(server.base) == expected[server.versions[server.version()]]
        m = wait_quiescent(server.base)
        assert m['hotswap_kv_pages{state="owned"}'] == 0 and m["hotswap_is_sleeping"] == 0
        assert_metrics_add_up(m, server.num_pages)

    # Conflicts on purpose, nothing changes: an update that does not raise the version (409);
    # while asleep, an update and a request (503, retry after a wakeup).
    v = server.version()
    r = server.update("seed1", version=v)
    assert r.status_code == 409 and "greater" in r.json()["error"]["message"], r.text
    assert httpx.post(f"{server.base}/sleep", headers=ADMIN, timeout=60).status_code == 200
    r = server.update("seed1")
    assert r.status_code == 503 and "wakeup" in r.json()["error"]["message"], r.text
    probe = {"model": MODEL, "prompt": [5], "max_tokens": 1}
    r = httpx.post(f"{server.base}/v1/completions", json=probe, headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 503 and "asleep" in r.json()["error"]["message"] and r.headers["retry-after"]
    assert httpx.post(f"{server.base}/wakeup", headers=ADMIN, timeout=60).status_code == 200
    assert server.version() == v and _greedy(server.base) == expected[server.versions[v]]
    print(
        f"\nraces: {ROUNDS} rounds, {len(statuses)} lifecycle calls, {conflicts} refused (409/503), "
        f"{aborted_streams} streams cut by sleep/update"
    )


def test_sleep_wakeup_cycles_keep_outputs_and_memory_flat(main_server):
    server = main_server
    server.restore("seed0")
    expected = _greedy(server.base)

    def cycle(i: int) -> None:
        if i % 10 == 9:  # the documented level-2 sequence: weights back, new weights, then KV
            steps = [("/sleep", {"level": 2}), ("/wakeup", {"tags": "weights"})]
            for path, params in steps:
                assert httpx.post(f"{server.base}{path}", params=params, headers=ADMIN, timeout=60).is_success
            assert server.update("seed0").status_code == 200
            r = httpx.post(f"{server.base}/wakeup", params={"tags": "kv_cache"}, headers=ADMIN, timeout=60)
        else:
            r = httpx.post(f"{server.base}/sleep", params={"level": 1}, headers=ADMIN, timeout=60)
            assert r.status_code == 200 and r.json()["is_sleeping"]
            r = httpx.post(f"{server.base}/wakeup", headers=ADMIN, timeout=60)
        assert r.status_code == 200 and not r.json()["is_sleeping"], r.text

    for i in range(10):  # warm-up: allocator pools and host copies reach their steady size
        cycle(i)
    rss0 = server.proc.rss_kib()
    for i in range(CYCLES):
        cycle(i)
        if i % 25 == 24:
            assert _greedy(server.base) == expected, f"outputs changed after {i + 1} cycles"
    rss1 = server.proc.rss_kib()
    assert _greedy(server.base) == expected
    m = metrics(server.base)
    assert m["hotswap_is_sleeping"] == 0 and m['hotswap_kv_pages{state="owned"}'] == 0
    assert rss1 - rss0 < RSS_TOLERANCE_KIB, f"RSS grew {(rss1 - rss0) / 1024:.1f} MiB over {CYCLES} cycles"
    print(f"\ncycles: {CYCLES} sleep/wakeup cycles, RSS {rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MiB")
