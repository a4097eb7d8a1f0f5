"""Load with weight updates: many concurrent streams while the weights change, under each policy.

Checks, for every accepted request: exactly one outcome per choice, `[DONE]` last, no 5xx
and no in-band error, token counts equal `usage`, every token's weights version reported
(spans, or the one version every chunk names) and consistent with the per-chunk
`weights_version`; single-version responses where the policy promises them; and the
returned log-probs equal a fresh re-score under the checkpoint of each token's version,
which is what would break if stale KV from other weights were ever reused.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import numpy as np
import pytest

from .relkit import (
    ADMIN,
    assert_metrics_add_up,
    async_client,
    gather_bounded,
    outcomes,
    scale,
    stream_completion,
    wait_quiescent,
)

N_SLOTS = scale(200, 400)  # concurrent clients, each streaming request after request until the updates end
N_UPDATES = scale(10, 40)
N_SCORED = scale(32, 300)  # responses re-scored per policy (a sample: scoring is in-process work)
ARRIVAL_S = 0.3  # clients start at random moments within this window: all at once, nearly
UPDATE_GAP_S = scale(0.1, 0.25)  # between one update's answer and the next (a drain also waits)
# Shared 16-token first pages: repeats hit the prefix cache, the place stale KV would hide.
PREFIXES = [[(7 * i + 3 * k) % 500 + 5 for k in range(16)] for i in range(4)]
FINISH = {
    "drain": {"stop", "length"},
    "abort": {"stop", "length", "abort"},
    "recompute": {"stop", "length"},
    "keep": {"stop", "length"},
    "reject": {"stop", "length"},
}
SINGLE_VERSION = {"drain", "abort", "reject"}  # policies under which no response mixes versions
LOGPROB_ATOL = 2e-3  # paged f32 serving vs one dense forward


def _request(rng: random.Random) -> dict:
    prompt = rng.choice(PREFIXES) if rng.random() < 0.6 else []
    prompt = prompt + [rng.randrange(5, 500) for _ in range(rng.randint(1, 12))]
    return {
        "prompt": prompt,
        "max_tokens": rng.randint(4, 64 - len(prompt) - 1),
        "ignore_eos": rng.random() < 0.7,  # long streams keep the server busy; some stop on EOS
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randrange(1 << 20),
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }


async def _updater(client: httpx.AsyncClient, server, policy: str, log: list[dict]) -> None:
    """N_UPDATES updates one after another while the streams run, alternating the two checkpoints."""
    for i in range(N_UPDATES):
        await asyncio.sleep(UPDATE_GAP_S if i else ARRIVAL_S + 0.2)
        name = "seed1" if i % 2 == 0 else "seed0"
        t0 = time.monotonic()
        r = await client.post("/update_weights", json={"path": name, "policy": policy}, headers=ADMIN)
        entry = {"status": r.status_code, "body": r.json(), "t0": t0, "t1": time.monotonic(), "name": name}
        if r.status_code == 200:
            server.versions[r.json()["weights_version"]] = name
        log.append(entry)


async def _run(server, policy: str) -> tuple[list[tuple[dict, object]], list[dict]]:
    """N_SLOTS clients stream request after request (at least one each) until the updates are done."""
    finished = asyncio.Event()
    updates: list[dict] = []

    async def updater():
        try:
            async with async_client(server.base) as client:
                await _updater(client, server, policy, updates)
        finally:
            finished.set()

    async def slot(k: int) -> list:
        rng = random.Random(f"load-{policy}-{k}")
        await asyncio.sleep(rng.uniform(0, ARRIVAL_S))
        done = []
        async with async_client(server.base) as client:
            while not done or not finished.is_set():
                body = _request(rng)
                done.append((body, await stream_completion(client, body)))
            if k % 8 == 0:  # a tail after the last update: requests that never saw a swap
                body = _request(rng)
                done.append((body, await stream_completion(client, body)))
        return done

    per_slot = await gather_bounded([updater(), *(slot(k) for k in range(N_SLOTS))], timeout_s=300)
    return [pair for slot_results in per_slot[1:] for pair in slot_results], updates


def _check_stream(s, body: dict, policy: str, known: dict[int, str]) -> None:
    assert s.status == 200, (s.status, s.body)
    assert s.done and s.after_done == 0 and not s.errors, s
    assert list(s.choices) == [0]
    c = s.choices[0]
    assert c.finish_count == 1 and c.finish_reason in FINISH[policy], c
    assert len(c.token_ids) == len(c.logprobs) <= body["max_tokens"]
    if c.finish_reason == "length":
        assert len(c.token_ids) == body["max_tokens"]
    assert s.usage["completion_tokens"] == len(c.token_ids)
    assert s.usage["prompt_tokens"] == len(body["prompt"])
    versions = c.versions
    assert len(versions) == len(c.token_ids) and all(v in known for v in versions), (versions, known)
    assert versions == sorted(versions)  # a sequence never goes back to older weights
    for n_tokens, v in c.chunk_versions:  # each chunk names the version of its newest token
        assert versions[n_tokens - 1] == v
    if c.spans:
        assert len(c.spans) > 1 and c.spans[0]["start"] == 0 and c.spans[-1]["end"] == len(c.token_ids)
    if policy in SINGLE_VERSION:
        assert len(set(versions)) <= 1 and not c.spans, c.spans


def _clean(s, updates: list[dict]) -> bool:
    """No update was in progress while this request lived (so its KV has one version)."""
    return not any(u["t0"] < s.ended_at and u["t1"] > s.sent_at for u in updates)


def _check_logprobs(oracles, known, pairs) -> int:
    """Re-score sampled responses under each token's reported version; returns tokens compared."""
    by_ckpt: dict[str, list] = {}
    for body, c in pairs:
        for name in {known[v] for v in c.versions}:
            by_ckpt.setdefault(name, []).append((body, c))
    compared = 0
    for name, items in by_ckpt.items():
        scores = oracles(name).score([(b["prompt"], c.token_ids) for b, c in items])
        for (b, c), want in zip(items, scores, strict=True):
            mine = [i for i, v in enumerate(c.versions) if known[v] == name]
            got = np.asarray(c.logprobs)[mine]
            np.testing.assert_allclose(got, want[mine], atol=LOGPROB_ATOL, err_msg=f"{name} {b}")
            compared += len(mine)
    return compared


@pytest.mark.parametrize("policy", ["drain", "abort", "recompute", "keep", "reject"])
def test_streams_under_updates(main_server, oracles, policy):
    server = main_server
    server.restore("seed0")
    before = outcomes(wait_quiescent(server.base))
    t0 = time.monotonic()
    pairs, updates = asyncio.run(_run(server, policy))
    elapsed = time.monotonic() - t0
    results = [s for _, s in pairs]

    known = dict(server.versions)
    for body, s in pairs:
        _check_stream(s, body, policy, known)
    statuses = [u["status"] for u in updates]
    assert len(updates) == N_UPDATES
    if policy == "reject":
        # With requests in flight (or cached pages), a strict controller's update is refused.
        assert statuses == [409] * N_UPDATES, updates
        assert all("reject" in u["body"]["error"]["message"] for u in updates)
    else:
        assert statuses == [200] * N_UPDATES, updates
    # Every update (or refusal) happened with streams open: the scenario really ran under load.
    open_at = [sum(s.sent_at < u["t0"] < s.ended_at for s in results) for u in updates]
    assert min(open_at) > 0, open_at
    finals = [s.choices[0] for s in results]
    mixed = sum(len(set(c.versions)) > 1 for c in finals)
    aborted = sum(c.finish_reason == "abort" for c in finals)
    if policy in ("recompute", "keep"):
        assert mixed > 0, "no response spanned an update: the scenario did not happen"
    if policy == "abort":
        assert aborted > 0, "no request was in flight at an update: the scenario did not happen"

    # Log-probs under the reported versions. Under `keep` a sequence carried across an update
    # computes new tokens on old KV (labelled, by design), so only requests that lived
    # entirely between updates are re-scored there.
    eligible = [
        (body, s.choices[0])
        for body, s in pairs
        if s.choices[0].token_ids and (policy != "keep" or _clean(s, updates))
    ]
    sample = random.Random(policy).sample(eligible, min(N_SCORED, len(eligible)))
    compared = _check_logprobs(oracles, known, sample)
    assert compared > 0

    if policy == "reject":  # idle with an empty cache, a strict update goes through
        assert httpx.post(f"{server.base}/reset_prefix_cache", headers=ADMIN, timeout=30).status_code == 200
        r = server.update("seed1", policy="reject")
        assert r.status_code == 200, r.text
    m = wait_quiescent(server.base)
    assert_metrics_add_up(m, server.num_pages)
    assert m['hotswap_kv_pages{state="owned"}'] == 0
    # The server's outcome counters agree with what the clients saw, request for request.
    delta = {k: v - before[k] for k, v in outcomes(m).items()}
    assert delta == {"completed": len(results) - aborted, "aborted": aborted, "rejected": 0, "errored": 0}
    print(
        f"\n{policy}: {len(results)} streams from {N_SLOTS} clients (peak {_peak(results)} open), "
        f"updates {statuses.count(200)} applied / {statuses.count(409)} refused with {min(open_at)}-"
        f"{max(open_at)} streams open, {mixed} mixed, {aborted} aborted, {compared} tokens re-scored "
        f"({len(sample)} responses), {elapsed:.1f}s"
    )


def _peak(results) -> int:
    """Most streams open at once (client side)."""
    edges = sorted([(s.sent_at, 1) for s in results] + [(s.ended_at, -1) for s in results])
    peak = cur = 0
    for _, d in edges:
        cur += d
        peak = max(peak, cur)
    return peak
