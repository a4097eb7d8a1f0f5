"""A quantized engine behind a real `hotswap serve --quantization int8`, driven by the official
`openai` client and plain HTTP, as an RL controller drives it: each choice names the
quantization that produced its tokens, a full-precision update over HTTP is re-quantized (the
next choice names the new version, and its text is a fresh int8 engine's on those weights),
and an update carrying a NaN is a 400 naming the tensor while the old int8 weights keep serving.
The oracle is `LLM(..., quantization="int8")` in this process on the same checkpoints."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from api_helpers import ADMIN_KEY, API_KEY, admin, openai_client
from helpers import KNOBS
from server_process import ServerProcess, cli_flags

from hotswap import LLM, SamplingParams
from hotswap.checkpoint.hf import read_hf_tensors
from hotswap.checkpoint.payload import encode_safetensors

PROMPT = "The orchard keeper counted the pears that fell in the night and"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def int8_server(weights_root, tmp_path_factory):
    flags = [str(weights_root / "seed0"), "--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--no-warmup"]
    flags += ["--weights-root", str(weights_root), "--served-model-name", "tiny-int8"]
    flags += cli_flags(quantization="int8", **KNOBS)
    with ServerProcess(flags, tmp_path_factory.mktemp("int8-log") / "server.log") as server:
        server.wait_healthy(180)
        yield server


def _oracle_text(checkpoint) -> str:
    """A fresh int8 engine on `checkpoint`, in this process: the greedy text the server must send."""
    llm = LLM(str(checkpoint), quantization="int8", warmup=False, **KNOBS)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return out[0].outputs[0].text


def _complete(client):
    """(the response's weights version, its one choice)."""
    c = client.completions.create(model="tiny-int8", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    return c.model_extra["weights_version"], c.choices[0]


def test_each_choice_names_its_quantization_and_updates_are_requantized(int8_server, weights_root):
    client = openai_client(int8_server)
    version, first = _complete(client)
    assert version == 1 and first.text == _oracle_text(weights_root / "seed0")
    assert first.model_extra["quantization"] == "int8"
    chat = client.chat.completions.create(
        model="tiny-int8", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].model_extra["quantization"] == "int8"

    with httpx.Client(base_url=int8_server.base, timeout=120) as http:
        r = http.post("/update_weights", json={"path": "seed1", "policy": "abort"}, headers=admin())
        assert r.status_code == 200, r.text
        version, after = _complete(client)
        assert version == 2 and after.model_extra["quantization"] == "int8"
        assert after.text == _oracle_text(weights_root / "seed1") != first.text  # re-quantized, fresh

        # A NaN in the full-precision update: refused before anything is quantized or swapped.
        tensors = {k: np.asarray(v, np.float32) for k, v in read_hf_tensors(weights_root / "seed0").items()}
        bad = "model.layers.0.self_attn.q_proj.weight"
        tensors[bad] = tensors[bad].copy()
        tensors[bad][0, 0] = np.nan
        headers = {**admin(), "Content-Type": "application/octet-stream"}
        r = http.post("/update_weights", content=encode_safetensors(tensors), headers=headers)
        assert r.status_code == 400 and bad in r.json()["error"]["message"], r.text
        assert http.get("/weights_version", headers=admin()).json()["weights_version"] == 2
    version, still = _complete(client)
    assert version == 2 and still.text == after.text and still.model_extra["quantization"] == "int8"
