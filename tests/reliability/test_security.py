"""Security: every route is behind an auth dependency, and nothing in `hotswap/` can unpickle or
evaluate request data.

The route walk runs on `create_app(...)` in-process against a tiny engine (no warm-up,
no server), so a route added later without `Depends(require_*)` fails here at once.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from hotswap.api.engine_loop import require_admin, require_api_key
from hotswap.api.server import create_app

from .relkit import ADMIN_KEY, API_KEY

# Open on purpose: liveness and Prometheus scraping (as in vLLM), and FastAPI's schema and docs pages,
# which describe the API but reach no engine state.
OPEN = {"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
# Inference routes outside /v1/ (vLLM's, at the root): the api key, as the OpenAI routes. And what
# a router reads of a replica, SGLang's (api/routes_sglang_info.py): the api key, as /v1/models.
INFERENCE = {"/tokenize", "/detokenize"}
INFERENCE |= {
    "/server_info",
    "/get_server_info",
    "/model_info",
    "/get_model_info",
    "/get_load",
    "/health_generate",
}


def _inference(path: str) -> bool:
    return path.startswith("/v1/") or path in INFERENCE


PACKAGE = Path(__file__).resolve().parents[2] / "hotswap"
BANNED_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
BANNED_MODULES |= {"multiprocessing.reduction"}  # ForkingPickler
BANNED_BUILTINS = {"eval", "exec"}


@pytest.fixture(scope="module")
def app(rel_ckpts):
    from hotswap.engine.llm import LLM

    engine = LLM(rel_ckpts["seed0"], max_model_len=64, num_pages=8, warmup=False).engine
    return create_app(engine, api_key=API_KEY, admin_key=ADMIN_KEY)


def _routes(app) -> list:
    """Every route as served: (path, methods, dependant or None for a plain Starlette route).

    FastAPI before 0.16x copies included routers' routes into `app.routes` as APIRoutes with the
    router's dependencies merged in; later versions keep an `_IncludedRouter` whose
    `effective_route_contexts()` yields the same merged view. Anything else is reported as is.
    """
    out, todo = [], list(app.routes)
    while todo:
        r = todo.pop(0)
        if hasattr(r, "effective_route_contexts"):
            out += [(c.path, set(c.methods), c.dependant) for c in r.effective_route_contexts()]
        elif isinstance(r, APIRoute):
            out.append((r.path, set(r.methods), r.dependant))
        else:
            out.append((getattr(r, "path", repr(r)), set(getattr(r, "methods", None) or ()), None))
    return out


def _guards(dependant) -> set:
    """Every dependency callable of a route, transitively (router-level ones included)."""
    found, todo = set(), list(dependant.dependencies)
    while todo:
        dep = todo.pop()
        found.add(dep.call)
        todo += dep.dependencies
    return found


def _unguarded(app) -> list[str]:
    """Routes (outside OPEN) without an auth dependency, and lifecycle routes without the admin one."""
    problems = []
    for path, methods, dependant in _routes(app):
        if path in OPEN:
            continue
        guards = _guards(dependant) if dependant is not None else set()
        if not guards & {require_api_key, require_admin}:
            problems.append(f"{sorted(methods)} {path}: no auth dependency")
        elif not _inference(path) and require_admin not in guards:
            # Lifecycle routes swap weights or free memory: the api key must not be enough.
            problems.append(f"{sorted(methods)} {path}: lifecycle route without require_admin")
    return problems


def test_every_route_has_an_auth_dependency(app):
    assert {"/v1/completions", "/update_weights", "/sleep"} <= {p for p, _, _ in _routes(app)}
    assert _unguarded(app) == []


def test_the_walk_catches_an_unguarded_route(app):
    probe = create_app(app.state.ctx.engine, api_key=API_KEY, admin_key=ADMIN_KEY)
    probe.get("/debug/state")(lambda: {"leak": True})
    assert _unguarded(probe) == ["['GET'] /debug/state: no auth dependency"]


def test_unauthenticated_calls_get_401(app):
    """The dependencies really run: no key is a 401; the api key on a lifecycle route is a 403."""
    client = TestClient(app)  # no `with`: no lifespan, so no engine loop; auth answers first
    checked = 0
    for path, methods, _ in _routes(app):
        if path in OPEN:
            continue
        for method in methods:
            r = client.request(method, path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (method, path)
            assert r.json()["error"]["type"] == "authentication_error"
            if not _inference(path):
                r = client.request(method, path, headers={"Authorization": f"Bearer {API_KEY}"})
                assert r.status_code == 403, f"{method} {path} accepts the api key as admin"
                assert r.json()["error"]["type"] == "permission_error"
            checked += 1
    assert checked >= 10


def _violations(source: str, filename: str) -> list[str]:
    """Imports of pickle-like modules; calls of eval/exec, torch.load, np.load(allow_pickle=True)."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where} import {a.name}" for a in node.names if a.name in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod in BANNED_MODULES or any(f"{mod}.{a.name}" in BANNED_MODULES for a in node.names):
                out.append(f"{where} from {mod} import ...")
            if mod == "torch" and any(a.name == "load" for a in node.names):
                out.append(f"{where} from torch import load")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in BANNED_BUILTINS:
                out.append(f"{where} {f.id}()")
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                if (f.value.id, f.attr) == ("torch", "load"):
                    out.append(f"{where} torch.load()")
                pickles = any(k.arg == "allow_pickle" and not _is_false(k.value) for k in node.keywords)
                if f.value.id in ("np", "numpy") and f.attr == "load" and pickles:
                    out.append(f"{where} np.load(allow_pickle=...)")
    return out


def _is_false(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def test_checker_catches_what_it_should():
    bad = (
        "import pickle\nfrom dill import loads\nimport torch\nfrom torch import load\n"
        "eval('1')\nexec('x=1')\ntorch.load('f')\nimport numpy as np\nnp.load('f', allow_pickle=True)\n"
        "import marshal\nfrom multiprocessing.reduction import ForkingPickler\n"
    )
    assert len(_violations(bad, "bad.py")) == 9
    ok = "model.eval()\nnp.load('f', allow_pickle=False)\nimport json\nre.compile('x')\n"
    assert _violations(ok, "ok.py") == []


def test_no_pickle_or_eval_anywhere_in_the_package():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20, PACKAGE
    found = [v for f in files for v in _violations(f.read_text(), str(f.relative_to(PACKAGE.parent)))]
    assert not found, "unsafe deserialisation / evaluation:\n" + "\n".join(found)
