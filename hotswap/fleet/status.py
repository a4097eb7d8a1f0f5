"""One replica's row of `Fleet.versions()` / `GET /fleet`: read from its own routes (/health,
/get_load, /metrics), so it is what the replica says, not what the fleet believes."""

from __future__ import annotations

import re
from typing import Any

import httpx

STATUS_TIMEOUT_S = 15.0  # a replica under load answers its status routes between steps
_KV_PAGES = re.compile(r'^hotswap_kv_pages\{state="(\w+)"\} (\d+)$', re.M)


def kv_use(metrics_text: str) -> float | None:
    """Pages owned by sequences or cached for prefixes, over all pages (the null page excluded)."""
    pages = {k: int(v) for k, v in _KV_PAGES.findall(metrics_text)}
    total = sum(pages.values())
    return None if not total else (pages.get("owned", 0) + pages.get("cached", 0)) / total


def read(client: httpx.Client, url: str, headers: dict[str, str]) -> dict[str, Any]:
    """{healthy, weights_version, num_reqs, num_waiting_reqs, kv_tokens, kv_use}; healthy False
    (and the rest None) when the replica does not answer."""
    row: dict[str, Any] = dict.fromkeys(
        ("weights_version", "num_reqs", "num_waiting_reqs", "kv_tokens", "kv_use")
    )
    try:
        health = client.get(url + "/health", timeout=STATUS_TIMEOUT_S)
        row["healthy"] = health.status_code == 200
        if not row["healthy"]:
            return row
        row["weights_version"] = health.json()["weights_version"]
        (load,) = client.get(url + "/get_load", headers=headers, timeout=STATUS_TIMEOUT_S).json()
        row.update(
            num_reqs=load["num_reqs"], num_waiting_reqs=load["num_waiting_reqs"], kv_tokens=load["num_tokens"]
        )
        row["kv_use"] = kv_use(client.get(url + "/metrics", timeout=STATUS_TIMEOUT_S).text)
    except (httpx.TransportError, ValueError, KeyError):
        row["healthy"] = False
    return row
