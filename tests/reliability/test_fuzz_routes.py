"""Bad input against every route: a hand-written table of malformed bodies, sent to each
route in the server's own OpenAPI schema. Zero server errors (5xx) allowed; errors come
back as OpenAI-style JSON bodies. (test_schemathesis.py generates bodies from the schema.)
"""

from __future__ import annotations

import httpx

from .relkit import ADMIN, TIMEOUT, assert_metrics_add_up, outcomes, wait_quiescent


def _raw_bodies() -> list[tuple[str, bytes, str]]:
    """(name, body, content type) that no route should answer with a 5xx."""
    return [
        ("empty", b"", "application/json"),
        ("not json", b"{not json", "application/json"),
        ("truncated json", b'{"prompt": "hi", "max_tokens": ', "application/json"),
        ("json array", b"[1, 2, 3]", "application/json"),
        ("json string", b'"hello"', "application/json"),
        ("json null", b"null", "application/json"),
        ("invalid utf-8", b'{"prompt": "\xff\xfe"}', "application/json"),
        ("deep nesting", b"[" * 5000 + b"]" * 5000, "application/json"),
        ("huge int", b'{"prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}", "application/json"),
        ("NaN literal", b'{"prompt": "x", "temperature": NaN}', "application/json"),
        ("negative n", b'{"prompt": "x", "n": -1}', "application/json"),
        ("zero n", b'{"prompt": "x", "n": 0}', "application/json"),
        ("huge n", b'{"prompt": "x", "n": 100000}', "application/json"),
        ("negative max_tokens", b'{"prompt": "x", "max_tokens": -5}', "application/json"),
        ("wrong types", b'{"prompt": 5, "messages": "x", "stream": "yes"}', "application/json"),
        ("token id out of vocab", b'{"prompt": [999999, -1]}', "application/json"),
        ("empty prompt list", b'{"prompt": []}', "application/json"),
        ("empty token prompt", b'{"prompt": [[]]}', "application/json"),
        (
            "bad role content",
            b'{"messages": [{"role": "user", "content": [{"type": "image"}]}]}',
            "application/json",
        ),
        ("empty messages", b'{"messages": []}', "application/json"),
        (
            "tools not a list",
            b'{"messages": [{"role": "user", "content": "x"}], "tools": "x"}',
            "application/json",
        ),
        (
            "nameless tool, named choice",
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}],'
            b' "tool_choice": {"type": "function", "function": {"name": 7}}}',
            "application/json",
        ),
        (
            "required, bad schema",
            b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [{"type":'
            b' "function", "function": {"name": "f", "parameters": {"type": "bogus", "$ref": "#/x"}}}]}',
            "application/json",
        ),
        (
            "bad tool_calls",
            b'{"messages": [{"role": "user", "tool_calls": 5}, {"role": "assistant", "tool_calls": [{"function":'
            b' {"name": "f", "arguments": "{x"}}]}, {"role": "tool", "tool_call_id": 3}]}',
            "application/json",
        ),
        (
            "bad structured outputs",
            b'{"prompt": "x", "structured_outputs": {"regex": "(", "json": 5, "choice": "a"}}',
            "application/json",
        ),
        ("structured outputs not a dict", b'{"prompt": "x", "structured_outputs": [1]}', "application/json"),
        (
            "schema of the wrong type",
            b'{"prompt": "x", "structured_outputs": {"json": [1, 2]}}',
            "application/json",
        ),
        (
            "grammar garbage",
            b'{"prompt": "x", "structured_outputs": {"grammar": "\\x00:::"}}',
            "application/json",
        ),
        (
            "self-referencing schema",
            b'{"prompt": "x", "structured_outputs": {"json": {"$ref": "#"}}, "max_tokens": 3}',
            "application/json",
        ),
        ("response_format garbage", b'{"prompt": "x", "response_format": {"type": 7}}', "application/json"),
        ("removed guided field", b'{"prompt": "x", "guided_json": {"type": "object"}}', "application/json"),
        (
            "sglang constraints",
            b'{"text": "x", "sampling_params": {"regex": "[", "json_schema": "{"}}',
            "application/json",
        ),
        ("token ids flag not bool", b'{"prompt": "x", "return_token_ids": "maybe"}', "application/json"),
        ("top_p out of range", b'{"prompt": "x", "top_p": 7, "temperature": -3}', "application/json"),
        ("stop list of ints", b'{"prompt": "x", "stop": [1, 2]}', "application/json"),
        ("form body", b"a=1&b=2", "application/x-www-form-urlencoded"),
        ("binary", bytes(range(256)), "application/octet-stream"),
        ("text", b"hello", "text/plain"),
    ]


def test_malformed_bodies_on_every_route(main_server):
    server = main_server
    server.restore("seed0")
    spec = httpx.get(f"{server.base}/openapi.json", timeout=30).json()
    routes = [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops]
    before = outcomes(wait_quiescent(server.base))
    tried = 0
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as http:
        for method, path in routes:
            if path == "/sleep":  # it ignores bodies and would only make the routes after it answer 409
                continue
            for name, body, ctype in _raw_bodies():
                r = http.request(method, path, content=body, headers={**ADMIN, "Content-Type": ctype})
                tried += 1
                assert r.status_code < 500, (method, path, name, r.status_code, r.text[:300])
                if r.status_code >= 400:
                    assert r.json()["error"]["message"], (method, path, name, r.text[:300])
            http.delete("/update_weights", headers=ADMIN)
    after = wait_quiescent(server.base)
    assert outcomes(after)["errored"] == before["errored"]
    assert_metrics_add_up(after, server.num_pages)
    print(f"\nfuzz: {tried} malformed bodies over {len(routes)} routes, 0 server errors")
