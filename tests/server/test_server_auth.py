"""The served API's front door on a real `hotswap serve` (the shared `api_server`): health, the
model list, api and admin keys on every route, the loopback-only default bind, and 2 MB pages."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest
from api_helpers import API_KEY, AUTH, MODEL, admin, chat


def test_the_server_runs_on_2mb_pages_where_the_kernel_gives_them_on_request(api_server):
    """`hotswap serve` restarts itself (same pid) with glibc's huge-page tunable when THP is in
    `madvise` mode, so XLA's large buffers (the weights it streams every step) sit on 2 MB
    pages; elsewhere it runs as started."""
    from hotswap import host_memory

    pid = api_server.proc.pid
    environ = dict(
        kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv
    )
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    huge_kb = int(next(ln.split()[1] for ln in rollup.splitlines() if ln.startswith("AnonHugePages")))
    started = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if host_memory.reexec_env(started) is None:
        assert host_memory.TUNABLE not in environ.get("GLIBC_TUNABLES", "")
    else:
        assert host_memory.TUNABLE in environ["GLIBC_TUNABLES"]
        assert huge_kb > 0, rollup


def test_health_models_and_auth(api_server, api_client, api_http):
    assert api_http.get("/health").json()["status"] == "ok"
    assert [m.id for m in api_client.models.list().data] == [MODEL]
    assert api_http.get("/v1/models").status_code == 401
    bad = openai.OpenAI(base_url=api_server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        chat(bad, "x", max_tokens=1)
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": []})]:
        for headers in ({}, admin("wrong"), {"Authorization": API_KEY}):  # none, wrong, not Bearer
            r = api_http.post(path, json={"model": MODEL, "max_tokens": 1, **body}, headers=headers)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", (path, headers)
    # Lifecycle routes: no or an unknown key is 401; the api key is known but not allowed: 403.
    posts = ["/sleep", "/wakeup", "/reset_prefix_cache", "/update_weights"]
    for method, route in [("POST", r) for r in posts] + [
        ("GET", "/is_sleeping"),
        ("GET", "/weights_version"),
    ]:
        assert api_http.request(method, route).status_code == 401, route
        assert api_http.request(method, route, headers=admin("wrong")).status_code == 401, route
        r = api_http.request(method, route, headers=AUTH)
        assert r.status_code == 403, (route, r.text)
        assert r.json()["error"]["type"] == "permission_error" and "admin key" in r.json()["error"]["message"]
    assert api_http.get("/is_sleeping", headers=admin()).json()["is_sleeping"] is False  # nothing happened
    r = api_http.get("/weights_version", headers=admin())
    assert r.status_code == 200 and r.json() == {"weights_version": 1}


def test_binds_loopback_by_default(api_server, monkeypatch):
    from hotswap import cli
    from hotswap.cli import serve as cli_serve

    parsed = []
    monkeypatch.setattr(cli_serve, "serve", parsed.append)  # parse only; do not start a server
    assert cli.main(["serve"]) == 0 and parsed[0].host == "127.0.0.1"
    # The module's server was started without --host: it listens on 127.0.0.1 and nothing else.
    assert "--host" not in api_server.proc.args
    port = int(api_server.base.rsplit(":", 1)[1])

    def listening(table: str) -> list[str]:
        path = Path("/proc/net") / table
        rows = [row.split() for row in path.read_text().splitlines()[1:]] if path.exists() else []
        # columns: sl local_address rem_address st ...; st 0A = LISTEN; addresses as hex ip:port
        return [r[1] for r in rows if r[3] == "0A" and int(r[1].rsplit(":", 1)[1], 16) == port]

    assert listening("tcp") == [f"0100007F:{port:04X}"]  # 127.0.0.1, little-endian hex
    assert listening("tcp6") == []
