"""Delta updates (`weights/delta.py`, `UpdateOptions.base_version`): only the tensors or rows
that changed, applied to the version they were computed against. The oracle is the full update
with the same final weights: the serving params must be bitwise equal. A delta against another
version is refused (409) with nothing changed. Over HTTP: a safetensors body with the rows'
index tensors and `base_version` as a query parameter."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient
from helpers import KNOBS

from hotswap import LLM
from hotswap.api.server import create_app
from hotswap.checkpoint import hf
from hotswap.checkpoint.payload import encode_safetensors
from hotswap.errors import BaseVersionMismatch, WeightsMismatch
from hotswap.weights import delta

EMBED = "model.embed_tokens.weight"
O_PROJ = "model.layers.0.self_attn.o_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def tensors_a(tiny_dir):
    return dict(hf.read_hf_tensors(tiny_dir))


@pytest.fixture(scope="module")
def stepped(tensors_a, tiny_dir_b):
    """An 'RL step' from seed 0: o_proj replaced whole, 3 embedding rows and 2 up_proj rows changed."""
    b = hf.read_hf_tensors(tiny_dir_b)
    new = dict(tensors_a)
    new[O_PROJ] = b[O_PROJ]
    for name, rows in ((EMBED, [0, 5, 17]), (UP, [2, 9])):
        t = np.array(tensors_a[name], copy=True)
        t[rows] = b[name][rows]
        new[name] = t
    return new


def _host(llm) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(llm.engine.state.params)]


def _bitwise_equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True)
    )


def test_changed_finds_exactly_the_changed_tensors_and_rows(tensors_a, stepped):
    d = delta.changed(tensors_a, stepped)
    assert set(d) == {EMBED, O_PROJ, UP}
    r = delta.changed(tensors_a, stepped, rows=True)
    assert isinstance(r[EMBED], delta.Rows) and r[EMBED].indices.tolist() == [0, 5, 17]
    assert isinstance(r[UP], delta.Rows) and r[UP].indices.tolist() == [2, 9]
    assert not isinstance(r[O_PROJ], delta.Rows)  # every row changed: sent whole
    assert delta.nbytes(r) < delta.nbytes(d) < sum(t.nbytes for t in stepped.values())
    assert delta.changed(tensors_a, dict(tensors_a)) == {}


@pytest.mark.parametrize("staging", ["copy", "in_place"])
@pytest.mark.parametrize("rows", [False, True], ids=["tensors", "rows"])
def test_a_delta_equals_the_full_update_bitwise(tiny_dir, tensors_a, stepped, staging, rows):
    llm = LLM(tiny_dir, weight_update_staging=staging, **KNOBS, warmup=False)
    base = llm.weights_version
    v = llm.update_weights(delta.changed(tensors_a, stepped, rows=rows), base_version=base)
    assert v == base + 1
    by_delta = _host(llm)
    llm.update_weights(stepped)  # the oracle: the same final weights, sent whole
    assert _bitwise_equal(by_delta, _host(llm))
    assert not _bitwise_equal(
        by_delta, [np.array(x) for x in jax.tree.leaves(hf.params_from_hf(llm.config, tensors_a))]
    )


def test_a_delta_against_another_version_is_refused_with_nothing_changed(tiny_dir, tensors_a, stepped):
    llm = LLM(tiny_dir, **KNOBS, warmup=False)
    base = llm.weights_version
    leaves = jax.tree.leaves(llm.engine.state.params)
    for d in (delta.changed(tensors_a, stepped), delta.changed(tensors_a, stepped, rows=True)):
        with pytest.raises(
            BaseVersionMismatch, match=rf"against weights version {base - 1}, but version {base}"
        ):
            llm.update_weights(d, base_version=base - 1)
    assert BaseVersionMismatch.status == 409
    assert llm.weights_version == base
    assert all(a is b for a, b in zip(leaves, jax.tree.leaves(llm.engine.state.params), strict=True))


@pytest.mark.parametrize(
    "entry, needle",
    [
        (delta.Rows(np.array([0, 999]), np.zeros((2, 64), np.float32)), r"row indices must lie in \[0, "),
        (delta.Rows(np.array([1, 1]), np.zeros((2, 64), np.float32)), "a row index is repeated"),
        (delta.Rows(np.array([1.0]), np.zeros((1, 64), np.float32)), "must be a 1-D int array"),
        (delta.Rows(np.array([1, 2]), np.zeros((2, 7), np.float32)), r"2 rows of .* must be \(2, "),
    ],
)
def test_bad_rows_are_refused_naming_the_tensor(tiny_dir, entry, needle):
    llm = LLM(tiny_dir, **KNOBS, warmup=False)
    hidden = llm.config.hidden_size
    if entry.values.shape[-1] == 64:
        entry = delta.Rows(entry.indices, np.zeros((len(entry.indices), hidden), np.float32))
    with pytest.raises(WeightsMismatch, match=needle):
        llm.update_weights({EMBED: entry}, base_version=llm.weights_version)
    with pytest.raises(WeightsMismatch, match="need the base_version"):
        llm.update_weights({EMBED: entry}, partial=True)
    assert llm.weights_version == 1


def test_a_delta_over_http_in_a_safetensors_body(tiny_dir, weights_root, tensors_a, stepped):
    """`POST /update_weights?base_version=v` with the rows' `NAME:rows` index tensors beside
    them: applied as on the engine; the wrong base is a 409 naming both versions."""
    llm = LLM(tiny_dir, **KNOBS, warmup=False)
    app = create_app(llm.engine, model_name="tiny", weights_root=str(weights_root))
    body = encode_safetensors(delta.wire(delta.changed(tensors_a, stepped, rows=True)))
    octet = {"content-type": "application/octet-stream"}
    with TestClient(app) as tc:
        r = tc.post("/update_weights?base_version=7", content=body, headers=octet)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "base_version_mismatch"
        assert "version 7, but version 1" in r.json()["error"]["message"]
        assert tc.get("/weights_version").json()["weights_version"] == 1
        r = tc.post("/update_weights?base_version=1", content=body, headers=octet)
        assert r.status_code == 200 and r.json()["weights_version"] == 2, r.text
    by_delta = _host(llm)
    llm.update_weights(stepped)
    assert _bitwise_equal(by_delta, _host(llm))
