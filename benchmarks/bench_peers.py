"""Peer engines for `hotswap bench` (llama.cpp, vLLM), each in its own venv, run as a subprocess.

A peer cannot share hotswap's environment: llama.cpp is a from-source native build and vLLM
pins its own torch. So each peer lives in `<peers_dir>/.venv-<name>`, made by the setup
script named in PEERS, and is driven by `<peers_dir>/<name>_peer.py` run with that venv's
python. Peers are optional and never run in CI: a missing venv is `PeerNotInstalled`, which
says how to install it.

The protocol is one `PeerRequest` as JSON on the driver's stdin and one result line on its
stdout, prefixed with RESULT_PREFIX so library chatter on stdout cannot be taken for it.
This module is both sides of it: the host half (`run_peer`) and the driver half
(`read_request`, `emit_result`, the timing helpers). It imports only the standard library,
so the drivers import it from the peer venvs (the runner puts the repository root, which
holds `benchmarks/` and `hotswap/`, on PYTHONPATH).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from hotswap.errors import HotswapError

# peer name -> its setup script in the peers dir
PEERS = {"llama_cpp": "setup_llama_cpp.sh", "vllm": "setup_vllm_cpu.sh"}
RESULT_PREFIX = "HOTSWAP_PEER_RESULT "
TIE_MARGIN = 1e-3  # logits closer than this are a tie that float32 rounding may decide either way
TIMEOUT_S = 3600.0  # vLLM alone takes ~80 s to start; a whole peer run is minutes on 2 cores


class PeerError(HotswapError):
    """A peer driver failed, timed out, or printed no result line (its output tail is attached)."""

    code = "peer_failed"


class PeerNotInstalled(PeerError):
    """A peer's venv is missing; the message names the setup script that makes it."""

    code = "peer_not_installed"


PEER_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class PeerRequest:
    """What a peer measures; every list holds token ids, so no tokenizer is involved."""

    model_dir: str  # HF-format checkpoint dir
    work_dir: str  # where a peer may cache derived files (llama.cpp's GGUF)
    threads: int
    new_tokens: int  # per sequence in the decode rows
    repeats: int  # timed repeats after one warm-up; the median is reported
    max_num_seqs: int  # sequences in flight at once, as hotswap is given
    decode: list[list[list[int]]]  # one prompt list per decode batch size: [batch][seq][token]
    serving_prompts: list[list[int]] = dataclasses.field(default_factory=list)  # all submitted at once
    serving_outputs: list[int] = dataclasses.field(default_factory=list)  # max_tokens per serving prompt
    # a GRPO rollout (benchmarks/rollout.py `spec`, plus "prompts"): the peer runs only that
    rollout: dict | None = None
    dtype: str = "float32"  # the weights and KV cache of the decode rows and serving, as hotswap's
    # A GGUF file served as it is (llama.cpp only): `model_dir` is then unused, the weights are the
    # file's blocks, and the KV cache is `kv_dtype` (None: `dtype`).
    gguf: str | None = None
    kv_dtype: str | None = None  # float32, bfloat16 or float16 (llama.cpp's default)
    context_tokens: int = 0  # each sequence's context (0: its prompt plus new_tokens)

    def __post_init__(self) -> None:
        if len(self.serving_prompts) != len(self.serving_outputs):
            raise PeerError(
                f"serving_prompts has {len(self.serving_prompts)} prompts but serving_outputs "
                f"{len(self.serving_outputs)} lengths; give one output length per prompt"
            )
        if self.kv_dtype not in (None, *PEER_DTYPES, "float16"):
            raise PeerError(
                f"kv_dtype {self.kv_dtype!r}: the peers keep KV in one of {PEER_DTYPES} or float16"
            )
        if self.dtype not in PEER_DTYPES:
            raise PeerError(f"dtype {self.dtype!r}: the peers run one of {PEER_DTYPES}")
        if self.rollout is None and self.new_tokens < 2:
            raise PeerError(f"new_tokens={self.new_tokens}: decode timing needs at least 2 tokens")


# --------------------------------------------------------------------------- host side


def venv_python(name: str, peers_dir: Path) -> Path:
    """The peer venv's python, or PeerNotInstalled saying which script makes it."""
    if name not in PEERS:
        raise PeerError(f"unknown peer {name!r}; known peers: {', '.join(PEERS)}")
    python = peers_dir / f".venv-{name}" / "bin" / "python"
    if not python.exists():
        raise PeerNotInstalled(
            f"peer {name} is not installed (no {python}); install it with: bash {peers_dir / PEERS[name]}"
        )
    return python


def installed_peers(peers_dir: Path) -> list[str]:
    return [name for name in PEERS if (peers_dir / f".venv-{name}" / "bin" / "python").exists()]


def select_peers(spec: str | None, peers_dir: Path) -> list[str]:
    """`--peers`: None means the installed ones, "none" none; a named peer that is missing says so."""
    if spec is None:
        missing = [n for n in PEERS if n not in installed_peers(peers_dir)]
        for name in missing:
            print(f"peer {name} not installed; to add it: bash {peers_dir / PEERS[name]}", flush=True)
        return installed_peers(peers_dir)
    names = [n.strip() for n in spec.split(",") if n.strip() and n.strip() != "none"]
    for name in names:
        venv_python(name, peers_dir)  # unknown or missing: fail now, not after the hotswap runs
    return names


def run_peer(name: str, request: PeerRequest, peers_dir: Path, timeout_s: float = TIMEOUT_S) -> dict:
    """Run `<peers_dir>/<name>_peer.py` on `request` in the peer's venv; its result dict."""
    python = venv_python(name, peers_dir)
    driver = peers_dir / f"{name}_peer.py"
    if not driver.exists():
        raise PeerError(f"peer {name}: driver {driver} is missing")
    root = str(Path(__file__).resolve().parents[1])  # the repository: the driver imports this module
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    # A session of its own: on a timeout the whole group goes, vLLM's engine-core workers too.
    proc = subprocess.Popen(
        [str(python), str(driver)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(json.dumps(dataclasses.asdict(request)), timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise PeerError(f"peer {name} timed out after {timeout_s:.0f} s") from e
    results = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not results:
        why = f"exited {proc.returncode}" + ("" if results else " without a result line")
        tail = (stdout[-2000:] + stderr[-4000:]).strip()
        raise PeerError(f"peer {name} {why}:\n{tail}")
    return json.loads(results[-1][len(RESULT_PREFIX) :])


def serving_prompts(lens: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    """Random prompts of the serving plan's lengths, drawn as `workloads.hf_static_batches` draws them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(10, min(vocab, 700), int(n)).tolist() for n in lens]


@dataclasses.dataclass(frozen=True)
class Reference:
    """HF transformers' greedy continuations, and how decisive each choice was."""

    tokens: list[list[int]]  # [seq][step]
    margins: list[list[float]]  # [seq][step]: top-1 minus top-2 logit


def hf_reference(model, prompts: list[list[int]], new_tokens: int) -> Reference:
    """HF's greedy continuations of equal-length prompts: what a peer's tokens must match."""
    import torch

    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    top2 = torch.stack(out.scores, dim=1).topk(2, dim=-1).values  # [seq, step, 2]
    margins = (top2[..., 0] - top2[..., 1]).tolist()
    return Reference(out.sequences[:, ids.shape[1] :].tolist(), margins)


def hf_agreement(tokens: list[list[int]], ref: Reference) -> float:
    """The fraction of sequences whose greedy tokens equal HF's up to HF's first near-tie.

    Random-weight checkpoints often have two top logits within float32 noise of each other
    (1e-4 apart); there any correct engine may pick either and continue differently, so
    a sequence is compared only up to the first step whose margin is below TIE_MARGIN.
    `tokens` may hold fewer sequences than `ref` (a smaller batch of the same prompts).
    """
    agree = 0
    for got, want, margin in zip(tokens, ref.tokens, ref.margins, strict=False):
        decisive = next((i for i, m in enumerate(margin) if m < TIE_MARGIN), len(margin))
        agree += got[:decisive] == want[:decisive]
    return agree / len(tokens)


def leading_matches(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy continuations share before they first differ."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------- driver side


def read_request() -> PeerRequest:
    return PeerRequest(**json.load(sys.stdin))


def emit_result(result: dict) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def median_of_repeats(once: Callable[[], float], repeats: int) -> float:
    """The median of `repeats` calls of once() (each returns seconds), after one warm-up call."""
    return statistics.median(timed_repeats(once, repeats))


def timed_repeats(once: Callable[[], float], repeats: int) -> list[float]:
    """The seconds of `repeats` calls of once(), after one warm-up call."""
    once()
    return [once() for _ in range(repeats)]


def peak_rss() -> dict:
    """This process's peak resident memory in bytes: getrusage's ru_maxrss and /proc's VmHWM."""
    import resource

    hwm = next(
        (int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")), None
    )
    return {"ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "vmhwm": hwm}


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), without needing numpy."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def serving_summary(outputs: list[int], first_s: list[float], total_s: float) -> dict:
    """Output-token throughput and TTFT percentiles of one serving run (times from submission)."""
    return {
        "requests": len(outputs),
        "output_tokens": sum(outputs),
        "throughput_tok_s": sum(outputs) / total_s,
        "ttft_p50_s": percentile(first_s, 50),
        "ttft_p99_s": percentile(first_s, 99),
    }
