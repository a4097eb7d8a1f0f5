"""`hotswap.fleet.Fleet` on a local Ray: two real `hotswap serve` replicas (tiny seeded
checkpoints, JAX on the CPU), each a Ray actor's child process in its own placement group.

The fleet-wide commit: every replica flips together; a bad update (a shape error on every
replica) changes none; a replica killed while the fleet stages an update makes none commit; a
replica restarted after missing a commit rejoins at the fleet's version (it loads the fleet's
last committed weights first). Bad input: the replicas' fleet routes refuse a non-admin (403);
a fleet that does not fit the cluster is refused before anything starts.

Simulated: "killed during staging" kills the replica's server (SIGKILL) when the fleet's
prepare request for it is about to go out, after the fleet saw it healthy and while the other
replica stages: the moment a real crash would have to hit, made deterministic.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import ray
from fleet_load import FLEET_KNOBS

from hotswap.checkpoint import hf
from hotswap.checkpoint.payload import encode_safetensors
from hotswap.errors import BaseVersionMismatch, RequestError, WeightsMismatch
from hotswap.fleet import Fleet, FleetDoesNotFit, ReplicaLost, commit
from hotswap.weights import delta

ADMIN, API = "fleet-admin", "fleet-api"
GREEDY = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def fleet(ray_local, fleet_root, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet-logs")
    f = Fleet(
        str(fleet_root / "seed0"),
        replicas=2,
        weights_root=str(fleet_root),
        admin_key=ADMIN,
        api_key=API,
        served_model_name="tiny",
        log_dir=str(logs),
        **FLEET_KNOBS,
    )
    try:
        yield f
    finally:
        f.shutdown()
    for log in logs.glob("replica*.log"):
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def _complete(url: str, prompt: str = "The fleet") -> dict:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, **GREEDY},
        headers={"Authorization": f"Bearer {API}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _versions(fleet: Fleet) -> list[int | None]:
    return [row["weights_version"] for row in fleet.versions()]


def test_versions_one_row_per_replica(fleet):
    rows = fleet.versions()
    assert [r["replica"] for r in rows] == [0, 1]
    for r in rows:
        assert r["healthy"] and r["in_service"], r
        assert r["weights_version"] == fleet.version
        assert r["num_reqs"] == 0 and r["num_waiting_reqs"] == 0
        assert 0.0 <= r["kv_use"] <= 1.0 and r["kv_tokens"] >= 0
    assert sorted(fleet.urls()) == sorted(r["url"] for r in rows)


def test_fleet_routes_refuse_a_non_admin(fleet):
    url = fleet.urls()[0]
    for path in ("/fleet/prepare", "/fleet/commit", "/fleet/resume", "/fleet/abort"):
        body = {"update_id": "x", "path": "seed1"}
        as_api = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {API}"}, timeout=30)
        assert as_api.status_code == 403, (path, as_api.text)
        assert as_api.json()["error"]["code"] == "forbidden"
        anonymous = httpx.post(url + path, json=body, timeout=30)
        assert anonymous.status_code == 401, (path, anonymous.text)
    assert _versions(fleet) == [fleet.version] * 2  # nothing was staged, nothing changed
    held = httpx.post(url + "/fleet/abort", json={}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert held.json()["dropped"] is False


def _admin_post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)


def test_one_update_staged_at_a_time(fleet):
    """The replica side: a second prepare under another id, or a commit of an id not staged, is
    a 409 naming what is staged; an abort drops it and nothing changed."""
    url, before = fleet.urls()[0], fleet.version
    staged = _admin_post(url, "/fleet/prepare", {"update_id": "a", "path": "seed1", "version": before + 1})
    assert staged.status_code == 200 and staged.json()["prepared"] == "a", staged.text
    other = _admin_post(url, "/fleet/prepare", {"update_id": "b", "path": "seed1", "version": before + 1})
    assert other.status_code == 409 and "'a' is staged" in other.json()["error"]["message"], other.text
    wrong = _admin_post(url, "/fleet/commit", {"update_id": "b"})
    assert wrong.status_code == 409, wrong.text
    no_source = _admin_post(url, "/fleet/prepare", {"update_id": "a"})
    assert no_source.status_code == 400 and no_source.json()["error"]["code"] == "bad_payload"
    assert _admin_post(url, "/fleet/abort", {"update_id": "a"}).json()["dropped"] is True
    assert (
        _admin_post(url, "/fleet/commit", {"update_id": "a"}).status_code == 409
    )  # dropped: nothing to commit
    assert _versions(fleet) == [before] * 2


def test_update_flips_every_replica(fleet):
    before = fleet.version
    old = [_complete(u)["choices"][0]["text"] for u in fleet.urls()]
    done = fleet.update_weights("seed1", policy="drain")
    assert done.version == before + 1 == fleet.version
    assert done.committed == [0, 1] and not done.lost
    assert _versions(fleet) == [before + 1] * 2
    answers = [_complete(u) for u in fleet.urls()]
    assert {a["weights_version"] for a in answers} == {before + 1}
    new = [a["choices"][0]["text"] for a in answers]
    assert new[0] == new[1] and new != old  # the same new weights on both (greedy)
    print(
        f"fleet commit: prepare {done.prepare_s * 1e3:.1f} ms, swap skew {done.swap_skew_s * 1e3:.2f} ms, "
        f"flip skew {done.flip_skew_s * 1e3:.2f} ms"
    )


def test_shape_error_changes_no_replica(fleet):
    before = fleet.version
    texts = [_complete(u)["choices"][0]["text"] for u in fleet.urls()]
    with pytest.raises(WeightsMismatch, match=r"replica \d") as err:
        fleet.update_weights("wide")
    assert "intermediate" in str(err.value) or "shape" in str(err.value), err.value
    assert fleet.version == before and _versions(fleet) == [before] * 2
    for url, text in zip(fleet.urls(), texts, strict=True):  # still serving, the same weights
        assert _complete(url)["choices"][0]["text"] == text
        held = httpx.post(
            url + "/fleet/abort", json={}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
        )
        assert held.json()["dropped"] is False  # nothing left staged


def test_reject_policy_and_explicit_version_refused(fleet):
    before = fleet.version
    with pytest.raises(RequestError, match="cannot be committed fleet-wide"):
        fleet.update_weights("seed0", policy="reject")
    with pytest.raises(RequestError, match="version"):
        fleet.update_weights("seed0", version=99)
    assert _versions(fleet) == [before] * 2


def test_replica_killed_during_staging_commits_none(fleet, monkeypatch):
    before = fleet.version
    text = _complete(fleet.urls()[0])["choices"][0]["text"]
    real_post = commit._post

    def post(client, member, path, body, timeout_s):
        if path == "/fleet/prepare" and member.index == 1:
            ray.get(fleet.replicas[1].actor.kill.remote(), timeout=30)  # SIGKILL, as a lost node
        return real_post(client, member, path, body, timeout_s)

    monkeypatch.setattr(commit, "_post", post)
    with pytest.raises(ReplicaLost, match="replica 1"):
        fleet.update_weights("seed0")
    monkeypatch.undo()
    assert fleet.version == before
    rows = fleet.versions()
    assert rows[0]["weights_version"] == before and rows[0]["in_service"]
    assert not rows[1]["healthy"] and not rows[1]["in_service"]
    assert fleet.urls() == [fleet.replicas[0].url]
    assert _complete(fleet.urls()[0])["choices"][0]["text"] == text  # replica 0 still serves v
    held = httpx.post(
        fleet.urls()[0] + "/fleet/abort", json={}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
    )
    assert held.json()["dropped"] is False  # its staged copy was dropped by the fleet's abort


def test_restarted_replica_rejoins_at_fleet_version(fleet):
    assert not fleet.replicas[1].in_service  # left down by the test above
    done = fleet.update_weights("seed0")  # a commit replica 1 misses
    assert done.committed == [0]
    assert fleet.restart(1) == fleet.version == done.version
    assert _versions(fleet) == [fleet.version] * 2
    a, b = (_complete(u) for u in fleet.urls())
    assert a["weights_version"] == b["weights_version"] == fleet.version
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # the fleet's weights, not its start's


def _stepped_dirs(root) -> tuple[str, str]:
    """An 'RL step' from seed0 (one tensor from seed1, 3 embedding rows changed): written whole
    (with seed0's config) and as a delta (changed tensors and rows only); their names under root."""
    import shutil

    a, b = hf.read_hf_tensors(root / "seed0"), hf.read_hf_tensors(root / "seed1")
    new = dict(a)
    new["model.layers.0.self_attn.o_proj.weight"] = b["model.layers.0.self_attn.o_proj.weight"]
    embed = np.array(a["model.embed_tokens.weight"], copy=True)
    embed[[1, 4, 9]] = b["model.embed_tokens.weight"][[1, 4, 9]]
    new["model.embed_tokens.weight"] = embed
    for name, tensors in (("stepped", new), ("stepped-delta", delta.wire(delta.changed(a, new, rows=True)))):
        (root / name).mkdir(exist_ok=True)
        (root / name / "model.safetensors").write_bytes(encode_safetensors(tensors))
    shutil.copy(root / "seed0" / "config.json", root / "stepped" / "config.json")
    return "stepped", "stepped-delta"


def _answer(url: str) -> tuple[str, list]:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": "The fleet", "logprobs": 1, **GREEDY},
        headers={"Authorization": f"Bearer {API}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def test_a_delta_update_commits_on_every_replica_and_equals_the_full_one(fleet, fleet_root):
    """A delta is refused on every replica against the wrong base (none commits); on the right
    one every replica flips; a replica restarted after it replays the full update and the
    delta; and the answers (text, log-probs) equal those of the full stepped weights."""
    full, part = _stepped_dirs(fleet_root)
    v = fleet.update_weights("seed0").version  # the delta's base
    with pytest.raises(BaseVersionMismatch, match=rf"replica \d.*version {v - 1}, but version {v}"):
        fleet.update_weights(part, base_version=v - 1)
    assert fleet.version == v and _versions(fleet) == [v] * 2
    done = fleet.update_weights(part, base_version=v)
    assert done.version == v + 1 and done.committed == [0, 1] and _versions(fleet) == [v + 1] * 2
    by_delta = [_answer(u) for u in fleet.urls()]
    assert by_delta[0] == by_delta[1]
    assert fleet.restart(1) == v + 1  # rejoins by replaying seed0, then the delta on it
    assert _answer(fleet.urls()[1]) == by_delta[0]
    fleet.update_weights(full)
    assert [_answer(u) for u in fleet.urls()] == by_delta  # bitwise the same weights: the same log-probs


def test_fleet_that_does_not_fit_starts_nothing(ray_local, fleet, fleet_root):
    free = ray_local.available_resources().get("CPU", 0)
    with pytest.raises(FleetDoesNotFit, match=r"3 replicas x tensor_parallel_size 2 need 6 CPU"):
        Fleet(str(fleet_root / "seed0"), replicas=3, tensor_parallel_size=2, **FLEET_KNOBS)
    with pytest.raises(TypeError, match="max_model_lenn"):
        Fleet(str(fleet_root / "seed0"), replicas=1, max_model_lenn=128)
    assert ray_local.available_resources().get("CPU", 0) == free  # no group, no actor was made
    assert _versions(fleet) == [fleet.version] * 2
