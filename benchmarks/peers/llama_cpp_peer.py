"""The llama.cpp peer of `hotswap bench`, run by `benchmarks/bench_peers.py` in .venv-llama_cpp.

Reads a `PeerRequest` (JSON) on stdin and prints one result line. The HF checkpoint is
converted once to a GGUF of the request's dtype (f32 or bf16) in its work_dir (hf_to_gguf.py). Everything runs on
llama.cpp's low-level API (llama_batch / llama_decode, as llama-server does), because the
high-level `Llama` object decodes one sequence at a time:

- decode rows: all prompts prefilled in one llama_decode, then one call per step with one
  token per sequence, timed from every sequence having its first token until all finish;
- serving: continuous batching over all requests at once, at most STEP_TOKENS tokens per
  call (hotswap's max_num_batched_tokens in `hotswap bench`), decode tokens first, then
  prompt chunks; a finished sequence's KV cells are freed for the next request.

Weights and KV cache are in the request's dtype, as hotswap's are. A request naming a GGUF file
(`gguf`) serves that file's blocks as they are, with the KV cache in `kv_dtype` (f16 is llama.cpp's
default), each sequence's context `context_tokens` long when given; the result then carries this
process's peak RSS (`peak_rss`), so one request per context size measures that context's memory.
Greedy sampling is an argmax over each step's logits rows, copied to host once per step.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import llama_cpp
import numpy as np
from hf_to_gguf import convert  # this script's directory is on sys.path
from llama_cpp import llama_cpp as lib

from benchmarks.bench_peers import (
    PeerRequest,
    emit_result,
    peak_rss,
    read_request,
    serving_summary,
    timed_repeats,
)

STEP_TOKENS = 512
# One KV buffer shared by all sequences. With f32 KV it was faster here than a stream per sequence: decode at batch 16/32 by ~15%, the
# serving workload by ~45% (a mixed batch of prefill chunks needs no splitting per stream).
KV_UNIFIED = True


class LlamaError(RuntimeError):
    """llama.cpp refused a model, a context or a batch (the message says which and why)."""


class Context:
    """A llama.cpp model and context: `n_seq` sequences of `seq_len` tokens, `step_max` tokens a call."""

    def __init__(
        self, gguf: Path, n_seq: int, seq_len: int, step_max: int, threads: int, kv_type: int
    ) -> None:
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise LlamaError(f"llama.cpp could not load {gguf} (its log on stderr says why)")
        seq_len = -(-seq_len // 256) * 256  # llama.cpp pads each sequence's context to 256
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_seq * seq_len
        cparams.n_seq_max = n_seq
        cparams.n_batch = step_max
        cparams.n_ubatch = min(step_max, STEP_TOKENS)
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = KV_UNIFIED
        cparams.type_k = cparams.type_v = kv_type  # the weights' dtype; llama.cpp's default is f16
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise LlamaError(f"llama.cpp could not make a context for {n_seq} x {seq_len} tokens")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.capacity = cparams.n_batch
        self.batch = lib.llama_batch_init(self.capacity, 0, 1)

    def clear(self) -> None:
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)

    def drop(self, seq: int) -> None:
        lib.llama_memory_seq_rm(lib.llama_get_memory(self.ctx), seq, -1, -1)

    def step(
        self, tokens: list[int], seqs: list[int], positions: list[int], logits: list[bool]
    ) -> np.ndarray:
        """One llama_decode over the given tokens; the argmax token of each row asked for logits."""
        n = len(tokens)
        if n > self.capacity:
            raise LlamaError(f"{n} tokens in one step; the batch holds {self.capacity}")
        b = self.batch
        b.n_tokens = n
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seqs[i]
            b.logits[i] = logits[i]
        rc = lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise LlamaError(f"llama_decode returned {rc} for {n} tokens (1: no KV slot; <0: error)")
        n_out = sum(logits)
        ptr = ctypes.cast(lib.llama_get_logits(self.ctx), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab)).argmax(-1)  # [n_out]

    def close(self) -> None:
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        lib.llama_model_free(self.model)


def decode_once(c: Context, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds from every sequence having its first token to all done; each sequence's tokens."""
    c.clear()
    toks, seqs, pos, want = [], [], [], []
    for s, p in enumerate(prompts):
        toks += p
        seqs += [s] * len(p)
        pos += range(len(p))
        want += [False] * (len(p) - 1) + [True]
    nxt = c.step(toks, seqs, pos, want).tolist()
    out = [[t] for t in nxt]
    b = len(prompts)
    t = time.perf_counter()
    for k in range(new_tokens - 1):
        pos = [len(p) + k for p in prompts]
        nxt = c.step(nxt, list(range(b)), pos, [True] * b).tolist()
        for seq, t_ in zip(out, nxt, strict=True):
            seq.append(t_)
    return time.perf_counter() - t, out


def serve(c: Context, prompts: list[list[int]], outputs: list[int], n_seq: int) -> dict:
    """All requests submitted at once, continuous batching; throughput and TTFT."""
    c.clear()
    t0 = time.perf_counter()
    waiting = deque(range(len(prompts)))
    free = list(range(n_seq))
    seq_of: dict[int, int] = {}  # request -> seq id
    fed = [0] * len(prompts)  # prompt tokens already in the KV cache
    made = [0] * len(prompts)  # output tokens sampled
    last = [0] * len(prompts)  # the newest sampled token, fed next step
    first_s = [0.0] * len(prompts)
    while waiting or seq_of:
        while waiting and free:
            seq_of[waiting.popleft()] = free.pop()
        toks, seqs, pos, want, rows = [], [], [], [], []
        for r, s in seq_of.items():  # decode tokens first: they never wait behind a prefill
            if fed[r] == len(prompts[r]):
                toks.append(last[r])
                seqs.append(s)
                pos.append(len(prompts[r]) + made[r] - 1)
                want.append(True)
                rows.append(r)
        for r, s in seq_of.items():
            room = STEP_TOKENS - len(toks)
            if fed[r] == len(prompts[r]) or room == 0:
                continue
            chunk = prompts[r][fed[r] : fed[r] + room]
            toks += chunk
            seqs += [s] * len(chunk)
            pos += range(fed[r], fed[r] + len(chunk))
            fed[r] += len(chunk)
            want += [False] * (len(chunk) - 1) + [fed[r] == len(prompts[r])]
            if fed[r] == len(prompts[r]):
                rows.append(r)
        sampled = c.step(toks, seqs, pos, want).tolist()
        now = time.perf_counter() - t0
        for r, tok in zip(rows, sampled, strict=True):
            last[r] = tok
            made[r] += 1
            if made[r] == 1:
                first_s[r] = now
            if made[r] == outputs[r]:
                c.drop(seq_of[r])
                free.append(seq_of.pop(r))
    return serving_summary(outputs, first_s, time.perf_counter() - t0)


GGML_TYPE_BF16 = 30  # ggml.h's enum; llama-cpp-python 0.3.36 exports no constant for it
KV_TYPES = {"float32": lib.GGML_TYPE_F32, "bfloat16": GGML_TYPE_BF16, "float16": lib.GGML_TYPE_F16}


def gguf_for(req: PeerRequest) -> Path:
    """The request's GGUF file, or its checkpoint as a GGUF of its dtype, converted once and reused
    while it is newer."""
    if req.gguf:
        return Path(req.gguf)
    model_dir = Path(req.model_dir)
    tag = {"float32": "f32", "bfloat16": "bf16"}[req.dtype]
    out = Path(req.work_dir) / f"{model_dir.resolve().name}-{tag}.gguf"
    newest = max(f.stat().st_mtime for f in model_dir.iterdir())
    if not out.exists() or out.stat().st_mtime < newest:
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(model_dir, out, req.dtype)
    return out


def main() -> None:
    req = read_request()
    gguf = gguf_for(req)
    kv_type = KV_TYPES[req.kv_dtype or req.dtype]
    result: dict = {"peer": "llama_cpp", "version": llama_cpp.__version__, "threads": req.threads}
    result["decode"] = []
    for prompts in req.decode:
        prefill = sum(map(len, prompts))  # a decode row prefills all its prompts in one call
        seq_len = req.context_tokens or max(map(len, prompts)) + req.new_tokens
        c = Context(gguf, len(prompts), seq_len, prefill, req.threads, kv_type)
        tokens: list[list[int]] = []  # each sequence's greedy tokens, for the check against HF

        def once(c=c, prompts=prompts, tokens=tokens) -> float:
            dt, tokens[:] = decode_once(c, prompts, req.new_tokens)
            return dt

        seconds = timed_repeats(once, req.repeats)
        c.close()
        tok_s = len(prompts) * (req.new_tokens - 1) / statistics.median(seconds)
        row = {"batch": len(prompts), "tok_s": tok_s, "tokens": tokens, "seconds": seconds}
        result["decode"].append(row)
        print(f"llama_cpp batch {len(prompts)}: {tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    if req.serving_prompts:
        n_seq = min(len(req.serving_prompts), req.max_num_seqs)
        seq_len = max(len(p) + o for p, o in zip(req.serving_prompts, req.serving_outputs, strict=True))
        c = Context(gguf, n_seq, seq_len, STEP_TOKENS, req.threads, kv_type)
        serve(c, req.serving_prompts[:1], [2], n_seq)  # warm-up: first-call setup stays out of the timing
        result["serving"] = serve(c, req.serving_prompts, req.serving_outputs, n_seq)
        c.close()
    if req.gguf:
        result["peak_rss"] = peak_rss()
    emit_result(result)


if __name__ == "__main__":
    main()
