"""`hotswap serve --speculative-config` as a client meets it: a real server process on loopback,
the official `openai` client and plain HTTP. The tokens are those of the same server without
speculation (the suite's shared one); each response's `usage.spec_decode` and SGLang's
`meta_info` carry its acceptance figures, /metrics the engine's (vLLM's names); a bad config is
a usage error naming the flag.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from api_helpers import ADMIN_KEY, API_KEY, MODEL, admin, openai_client
from helpers import KNOBS
from server_process import ServerProcess, cli_flags

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# A prompt that repeats itself: prompt lookup finds something to draft at once.
LOOPING = "one two three four one two three four one two three four one two three"


@pytest.fixture(scope="module")
def spec_server(weights_root, tmp_path_factory):
    flags = [str(weights_root / "seed0"), "--api-key", API_KEY, "--admin-key", ADMIN_KEY]
    flags += ["--served-model-name", MODEL, "--speculative-config", json.dumps(NGRAM)]
    flags += cli_flags(**KNOBS)
    with ServerProcess(flags, tmp_path_factory.mktemp("log") / "server.log") as server:
        server.wait_healthy(240)
        yield server


def _completion(client, **kw):
    body = dict(model=MODEL, prompt=LOOPING, max_tokens=48, temperature=0.0, extra_body={"ignore_eos": True})
    return client.completions.create(**{**body, **kw})


def test_tokens_and_usage_through_the_openai_client(spec_server, api_server):
    """Greedy and seeded: the same text as the server without speculation; usage says what the
    drafts did (vLLM's mean acceptance length: tokens a verification yields)."""
    plain, spec = openai_client(api_server), openai_client(spec_server)
    for kw in ({}, {"temperature": 0.8, "seed": 7}):
        want, got = _completion(plain, **kw), _completion(spec, **kw)
        assert got.choices[0].text == want.choices[0].text
    figures = got.usage.model_extra["spec_decode"]
    assert figures["num_drafts"] > 0 and figures["num_draft_tokens"] >= figures["num_accepted_tokens"]
    assert figures["mean_acceptance_length"] == pytest.approx(
        1 + figures["num_accepted_tokens"] / figures["num_drafts"]
    )
    assert "spec_decode" not in (want.usage.model_extra or {})  # no speculation, no figures
    messages = [{"role": "user", "content": LOOPING}]
    chat = spec.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0.0)
    plain_chat = plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0.0)
    assert chat.choices[0].message.content == plain_chat.choices[0].message.content


def test_sglang_meta_info_and_metrics(spec_server):
    with httpx.Client(base_url=spec_server.base, timeout=60) as http:
        body = {
            "text": LOOPING,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
        }
        meta = http.post("/generate", json=body, headers=admin()).json()["meta_info"]
        assert meta["spec_verify_ct"] == meta["spec_decode"]["num_drafts"] > 0
        text = http.get("/metrics").text
        m = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
        assert m["hotswap_spec_decode_num_drafts_total"] >= meta["spec_verify_ct"]
        assert (
            0
            < m["hotswap_spec_decode_num_accepted_tokens_total"]
            <= m["hotswap_spec_decode_num_draft_tokens_total"]
        )


@pytest.mark.parametrize(
    "config, says",
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method='medusa'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in [1, 15]"),
        ('{"method": "draft_model", "model": "self", "draft_layers": 9, "num_speculative_tokens": 2}', None),
    ],
)
def test_a_bad_config_is_refused_before_serving(weights_root, config, says):
    """A usage error (exit 2) naming the flag, or (draft layers past the model's) a config error
    naming the key, before anything is served."""
    cmd = [sys.executable, "-m", "hotswap.cli", "serve", str(weights_root / "seed0"), "--no-warmup"]
    r = subprocess.run([*cmd, "--speculative-config", config], capture_output=True, text=True, timeout=240)
    assert r.returncode != 0
    if says is None:
        assert "draft_layers must be in [1, 1]" in r.stderr, r.stderr[-2000:]
    else:
        assert r.returncode == 2 and "--speculative-config" in r.stderr and says in r.stderr, r.stderr[-2000:]
