"""`hotswap fleet serve` as a user runs it: two replicas on a local Ray (started by the command),
the real sglang-router (`cache_aware`) in front, the fleet controller beside it.

Through the router, the official openai client answers; the controller refuses a non-admin
fleet update (403) and changes nothing; a fleet commit under load (24 streams through the router,
3 updates) leaves 0 responses with two versions, 0 tokens over stale KV (prefix hits of an older
version), 0 responses started after a commit that still carry the older version, and every
replica on the same version after each commit; a replica whose server is killed is restarted,
caught up and put back behind the router.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from fleet_load import FLEET_KNOBS, Load, older_than_committed, stale_kv_responses, two_version_responses
from server_process import cli_flags, free_port

ADMIN, API = "serve-admin", "serve-api"
# HOTSWAP_SOAK=1: the size, 3 replicas, 200 streams, 20 updates (run once, reported).
SOAK = os.environ.get("HOTSWAP_SOAK") == "1"
REPLICAS, STREAMS, UPDATES = (3, 200, 20) if SOAK else (2, 24, 3)


@pytest.fixture(scope="module")
def fleet_cli(fleet_root, tmp_path_factory):
    """The command's two URLs, read from its output."""
    logs = tmp_path_factory.mktemp("fleet-serve")
    knobs = {k: v for k, v in FLEET_KNOBS.items() if k != "warmup"}
    args = [sys.executable, "-m", "hotswap.cli", "fleet", "serve", str(fleet_root / "seed0")]
    args += ["--replicas", str(REPLICAS)]
    args += ["--port", str(free_port()), "--controller-port", str(free_port()), "--ray-num-cpus", "4"]
    args += ["--router-prometheus-port", str(free_port()), "--served-model-name", "tiny"]
    args += ["--weights-root", str(fleet_root), "--log-dir", str(logs), "--no-warmup", *cli_flags(**knobs)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HOTSWAP_ADMIN_KEY": ADMIN, "HOTSWAP_API_KEY": API}
    env["RAY_DISABLE_IMPORT_WARNING"] = "1"
    out = open(logs / "fleet.out", "w+")  # noqa: SIM115  (read back below, closed at the end)
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=out, text=True)
    try:
        urls = {}
        deadline = time.monotonic() + 300
        while len(urls) < 2:
            line = proc.stdout.readline()
            if not line:
                out.seek(0)
                pytest.fail(f"hotswap fleet serve ended (exit {proc.poll()}):\n{out.read()[-4000:]}")
            name, _, url = line.strip().partition(": ")
            if name in ("router", "controller"):
                urls[name] = url
            assert time.monotonic() < deadline
        yield urls
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()
    assert proc.returncode == 0, (logs / "fleet.out").read_text()[-4000:]
    for log in logs.glob("replica*.log"):
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def _fleet(controller: str, key: str = API) -> dict:
    r = httpx.get(controller + "/fleet", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _update(controller: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(
        controller + "/fleet/update_weights",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=600,
    )


def test_openai_client_through_the_router(fleet_cli):
    client = openai.OpenAI(base_url=fleet_cli["router"] + "/v1", api_key=API, max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0.0
    )
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0
    text = client.completions.create(model="tiny", prompt="The fleet", max_tokens=6, temperature=0.0)
    assert text.usage.completion_tokens > 0


def test_controller_refuses_a_non_admin(fleet_cli):
    before = _fleet(fleet_cli["controller"])
    as_api = _update(fleet_cli["controller"], {"path": "seed1"}, key=API)
    assert as_api.status_code == 403 and as_api.json()["error"]["code"] == "forbidden", as_api.text
    anonymous = httpx.post(
        fleet_cli["controller"] + "/fleet/update_weights", json={"path": "seed1"}, timeout=30
    )
    assert anonymous.status_code == 401, anonymous.text
    shape = _update(fleet_cli["controller"], {"path": "wide"})  # a replica's typed error, as it sent it
    assert shape.status_code == 400 and shape.json()["error"]["code"] == "weights_mismatch", shape.text
    after = _fleet(fleet_cli["controller"])
    assert after["weights_version"] == before["weights_version"]
    assert [r["weights_version"] for r in after["replicas"]] == [before["weights_version"]] * REPLICAS


def test_fleet_commit_under_load(fleet_cli):
    controller = fleet_cli["controller"]
    load = Load(fleet_cli["router"], {"Authorization": f"Bearer {API}"}, "tiny", STREAMS)
    commits, skews = [], []
    load.start()
    try:
        load.wait_for(STREAMS)
        for i in range(UPDATES):
            r = _update(controller, {"path": f"seed{(i + 1) % 2}", "policy": "drain"})
            assert r.status_code == 200, r.text
            done = r.json()
            commits.append((time.monotonic(), done["version"]))
            skews.append((done["swap_skew_s"], done["flip_skew_s"]))
            assert done["committed"] == list(range(REPLICAS)) and not done["lost"], done
            rows = _fleet(controller)["replicas"]
            assert [row["weights_version"] for row in rows] == [done["version"]] * REPLICAS, rows
            load.wait_for(STREAMS)
    finally:
        load.stop()
    responses = load.responses
    assert all(r.status == 200 for r in responses), {r.status for r in responses}
    assert two_version_responses(responses) == 0
    assert stale_kv_responses(responses) == 0
    assert older_than_committed(responses, commits) == 0
    hits = sum(1 for r in responses if r.cached_tokens > 0)
    assert hits > 0  # the shared prefix was hit (the fresh prefix of each version, never an older one)
    print(
        f"fleet commit under load: {len(responses)} responses, {STREAMS} streams, {UPDATES} updates, "
        f"swap skew max {max(s for s, _ in skews) * 1e3:.1f} ms (drains), flip skew max "
        f"{max(f for _, f in skews) * 1e3:.2f} ms, prefix hits {hits}, two-version 0, stale 0"
    )


def test_keep_update_under_load_is_labelled(fleet_cli):
    """Policy `keep`: requests in flight go on over their KV of v, so a response may carry two
    versions; each that does says so (its version spans and `mixed_weights_kv`)."""
    controller = fleet_cli["controller"]
    load = Load(fleet_cli["router"], {"Authorization": f"Bearer {API}"}, "tiny", STREAMS, max_tokens=32)
    load.start()
    try:
        load.wait_for(STREAMS)
        version = _fleet(controller)["weights_version"]
        r = _update(controller, {"path": f"seed{version % 2}", "policy": "keep"})
        assert r.status_code == 200, r.text
        load.wait_for(STREAMS)
    finally:
        load.stop()
    two = [x for x in load.responses if len(x.versions) > 1 or x.spans]
    assert all(x.spans and x.mixed_kv for x in two), two
    assert all(x.status == 200 for x in load.responses)
    print(f"keep under load: {len(two)} of {len(load.responses)} responses carry two versions, each labelled")


def test_killed_replica_rejoins_behind_the_router(fleet_cli):
    state = _fleet(fleet_cli["controller"])
    victim = state["replicas"][1]
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 180
    while True:
        rows = _fleet(fleet_cli["controller"])["replicas"]
        back = rows[1]
        if back["in_service"] and back["healthy"] and back["url"] != victim["url"]:
            break
        assert time.monotonic() < deadline, rows
        time.sleep(1)
    assert back["weights_version"] == state["weights_version"]  # caught up before it joined
    as_api = {"Authorization": f"Bearer {API}"}
    workers = httpx.get(fleet_cli["router"] + "/workers", headers=as_api, timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(r["url"] for r in rows)
