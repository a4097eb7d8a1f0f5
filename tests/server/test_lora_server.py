"""LoRA adapters over REST, through a real `hotswap serve --enable-lora` on loopback: vLLM's
`/v1/load_lora_adapter` / `/v1/unload_lora_adapter`, SGLang's `/load_lora_adapter`, a request's
`model` naming the adapter (the official `openai` client), `/v1/models` listing it; bad adapters
are typed 4xx naming the problem and serving is unchanged."""

from __future__ import annotations

import json
import pickle

import httpx
import numpy as np
import openai
import pytest
from api_helpers import ADMIN_KEY, API_KEY, admin
from helpers import KNOBS
from lora_helpers import make_adapter, peft_logprobs
from server_process import ServerProcess, cli_flags

from hotswap.checkpoint.create import create_checkpoint

PROMPT = [1, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-root")
    base = create_checkpoint(root / "base", preset="tiny", seed=0)
    make_adapter(base, root / "a", seed=21)
    make_adapter(base, root / "b", seed=22, rank=4, alpha=8.0, targets=["v_proj", "up_proj"])
    make_adapter(base, root / "wide", seed=23, rank=16)
    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((root / "a" / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    config = json.loads((root / "a" / "adapter_config.json").read_text())
    (root / "module").mkdir()
    (root / "module" / "adapter_config.json").write_text(
        json.dumps({**config, "target_modules": ["lm_head"]})
    )
    (root / "module" / "adapter_model.safetensors").write_bytes(
        (root / "a" / "adapter_model.safetensors").read_bytes()
    )
    return root


@pytest.fixture(scope="module")
def server(root, tmp_path_factory):
    flags = [str(root / "base"), "--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--weights-root", str(root)]
    flags += ["--served-model-name", "tiny", "--enable-lora", "--no-warmup"]
    flags += cli_flags(max_loras=2, max_lora_rank=8, dtype="float32", **KNOBS)
    with ServerProcess(flags, tmp_path_factory.mktemp("lora-log") / "server.log") as s:
        s.wait_healthy(240)
        yield s


def _completion(client, model: str):
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.0,
        logprobs=1,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    return choice.token_ids, np.asarray(choice.logprobs.token_logprobs)


def test_load_serve_list_unload(server, root):
    http = httpx.Client(base_url=server.base, timeout=120)
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root / "a")}, headers=admin()
    )
    assert r.status_code == 200, r.text
    r = http.post(
        "/load_lora_adapter", json={"lora_name": "b", "lora_path": str(root / "b")}, headers=admin()
    )
    assert r.status_code == 200 and r.json()["success"] and set(r.json()["loaded_adapters"]) == {"a", "b"}
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a", "b"} and models["a"].model_extra["parent"] == "tiny"
    for name in ("a", "b"):
        ids, lps = _completion(client, name)
        want = peft_logprobs(root / "base", root / name, [(PROMPT, ids)])[0]
        assert float(np.max(np.abs(lps - want))) <= 1e-4, name
    base_ids, _ = _completion(client, "tiny")
    assert base_ids != _completion(client, "a")[0]

    # Bad adapters: typed 4xx naming the problem; what serves does not change.
    before = {n: _completion(client, n)[0] for n in ("tiny", "a", "b")}
    bad = {
        "wide": (400, "max_lora_rank"),
        "module": (400, "lm_head"),
        "pickled": (400, "never unpickled"),
        "../outside": (403, ""),
    }
    for path, (status, words) in bad.items():
        r = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root / path)}, headers=admin()
        )
        assert r.status_code == status and words in r.text, (path, r.status_code, r.text)
    r = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(root / "a")}, headers=admin()
    )
    assert r.status_code == 400 and "max_loras=2" in r.text
    r = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root / "a")}, headers=admin(API_KEY)
    )
    assert r.status_code == 403  # an admin route
    with pytest.raises(openai.NotFoundError):
        _completion(client, "nope")
    assert {n: _completion(client, n)[0] for n in ("tiny", "a", "b")} == before

    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=admin())
    assert r.status_code == 200
    assert {m.id for m in client.models.list().data} == {"tiny", "a"}
    with pytest.raises(openai.NotFoundError):
        _completion(client, "b")

    # The RL form over REST: PEFT-named safetensors bytes to /update_weights, merged into the base.
    body = (root / "a" / "adapter_model.safetensors").read_bytes()
    headers = {**admin(), "Content-Type": "application/octet-stream"}
    version = http.get("/weights_version", headers=admin()).json()["weights_version"]
    r = http.post("/update_weights", content=body, params={"lora_alpha": 16.0}, headers=headers)
    assert r.status_code == 200 and r.json()["weights_version"] == version + 1, r.text
    ids, lps = _completion(client, "tiny")
    want = peft_logprobs(root / "base", root / "a", [(PROMPT, ids)])[0]
    assert float(np.max(np.abs(lps - want))) <= 1e-4
