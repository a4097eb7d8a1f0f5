"""What the tests/server/test_server_*.py files share: the server's flags and keys, and request helpers.

The server is `hotswap serve` on the seed-0 checkpoint of the suite's `weights_root`, with an
api key, an admin key, that weights root, a 4-request queue and the small `KNOBS`; it is
started without `--host` (tests/server/test_server_auth.py checks it listens on loopback only).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
from helpers import KNOBS
from server_process import ServerProcess, cli_flags

from hotswap.checkpoint.payload import encode_safetensors

API_KEY, ADMIN_KEY = "test-api-key", "test-admin-key"
MODEL = "tiny"
# Long enough to fill several 16-token pages, so a repeat hits the prefix cache.
LONG_PROMPT = (
    "Once upon a time there was a little robot who lived in a quiet town by the sea. Every morning the robot "
    "walked to the harbour, counted the boats, and wrote the number in a notebook."
)
GREEDY = {"max_tokens": 8, "temperature": 0.0}


def admin(token: str = ADMIN_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


AUTH = admin(API_KEY)


def start_server(weights_root: Path, log_path: Path) -> ServerProcess:
    """Serves `weights_root/seed0`; path updates resolve under `weights_root`. Not yet healthy."""
    flags = [str(weights_root / "seed0"), "--api-key", API_KEY, "--admin-key", ADMIN_KEY]
    flags += ["--weights-root", str(weights_root), "--served-model-name", MODEL]
    flags += cli_flags(max_waiting=4, shutdown_timeout=30, **KNOBS)
    return ServerProcess(flags, log_path)


SMOL = "smollm2"  # the served name of the default model in `start_smol_server`


def start_smol_server(gguf: Path, log_path: Path) -> ServerProcess:
    """Serves the default model (a real chat model, so constrained output is real output):
    16 sequences a step, so a batch of constrained requests runs together. No warm-up: of the
    30-layer model's buckets, only those the tests' requests take compile."""
    flags = [str(gguf), "--served-model-name", SMOL, "--no-warmup"]
    flags += cli_flags(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, page_size=16)
    return ServerProcess(flags, log_path)


def openai_client(server: ServerProcess) -> openai.OpenAI:
    # max_retries=0: by default the client retries 503s and 429s, which the tests must see.
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def metrics(http) -> dict[str, float]:
    lines = [ln.split() for ln in http.get("/metrics").text.splitlines() if ln and not ln.startswith("#")]
    return {name: float(value) for name, value in lines}


def complete(client, prompt=LONG_PROMPT, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, **{**GREEDY, **kw})


def chat(client, content: str, **kw):
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model=MODEL, messages=messages, **{**GREEDY, **kw})


def update_bytes(http, tensors: dict, **params) -> httpx.Response:
    headers = {**admin(), "Content-Type": "application/octet-stream"}
    return http.post("/update_weights", content=encode_safetensors(tensors), params=params, headers=headers)
