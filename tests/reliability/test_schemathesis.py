"""Schemathesis against the server's own OpenAPI schema: generated calls (valid and invalid by
the schema) to every route, zero server errors (5xx), errors come back as JSON bodies.

Driven through hypothesis directly: schemathesis' pytest plugin (`from_fixture`) reads a
private pytest attribute that pytest 9 removed. The fuzzer may put the shared server to
sleep (even level 2) or leave chunks staged; the test restores it at the end.
"""

from __future__ import annotations

import collections

import httpx
import schemathesis  # noqa: E402  (a test dependency: a missing install must fail, not skip)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from .relkit import ADMIN, metrics, outcomes, scale

EXAMPLES = scale(25, 100)  # per operation and generation mode
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # no .hypothesis directory in the checkout
    derandomize=True,  # the same examples every run: a failure reproduces
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


def _fuzz(base: str, op, mode, calls: collections.Counter, failures: list) -> None:
    @SETTINGS
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        # Admin key: it also opens /v1/*, so generated bodies reach the handlers, not just the auth check.
        r = case.call(base_url=base, headers=ADMIN, timeout=60)
        calls[r.status_code // 100] += 1
        calls[(op.label, mode.value, r.status_code)] += 1
        if r.status_code >= 500 or (r.status_code >= 400 and "error" not in r.json()):
            failures.append((op.label, mode.value, case.query, case.body, r.status_code, r.text[:300]))

    try:
        run()
    except Unsatisfiable:  # nothing to make invalid (e.g. a route without parameters)
        pass


def test_schemathesis_no_server_errors(main_server):
    server = main_server
    server.restore("seed0")
    schema = schemathesis.openapi.from_url(f"{server.base}/openapi.json", timeout=30)
    ops = [result.ok() for result in schema.get_all_operations()]
    calls: collections.Counter = collections.Counter()
    failures: list = []
    for op in ops:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            _fuzz(server.base, op, mode, calls, failures)
    assert not failures, failures[:5]

    # Whatever the fuzzer did (sleep, level 2, staged chunks): restore, then it serves cleanly.
    httpx.delete(f"{server.base}/update_weights", headers=ADMIN, timeout=30)
    server.restore("seed0")
    m = metrics(server.base)
    assert m["hotswap_is_sleeping"] == 0 and outcomes(m)["errored"] == 0, outcomes(m)
    print(
        f"\nschemathesis: {sum(calls.values())} calls over {len(ops)} operations, by status class {dict(calls)}"
    )
