"""Two CPU processes on loopback serve one tensor-parallel model, the way a TPU pod slice does.

    python examples/multihost_cpu.py                    # launcher: 2 processes x 1 device, tp=2
    python examples/multihost_cpu.py --local-devices 2  # 2 processes x 2 devices, tp=4
    python examples/multihost_cpu.py --transfer '[GOOD, BAD, ...]'  # updates from trainers' offers

The launcher writes two checkpoints (the served weights and an update), starts
one copy of this script per process with `--process-id`, and relays their
output. With `--transfer` (a JSON list of TransferRefs, each published by a trainer with
`transfer.publish(params, for_processes=2)`), process 0 instead generates, updates
from the first (each process pulls its own shards), generates, tries each of the
others (which must fail on every process and change nothing) and generates again. Every process builds the same LLM over the global mesh. Process 0
drives: it wraps its engine in a `multihost.Driver`, generates, hot-swaps the
weights from a checkpoint path, from an in-memory tree and from safetensors
bytes (both sent by a device broadcast), sleeps and wakes up, and generates
after each; the follower applies the same
commands with `multihost.follow`. Each process ends by printing one JSON line
with the outputs it saw and its weights version; they must agree.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(5, 20)), [7, 8, 9] * 4]
# 4 q and 4 kv heads: tensor-parallel over 2 or 4 devices.
SHAPES = {"num_attention_heads": 4, "num_key_value_heads": 4}
ENGINE = dict(max_model_len=32, page_size=8, max_num_seqs=4, max_num_batched_tokens=48, warmup=False)


def launch(args) -> int:
    from hotswap.checkpoint.create import create_checkpoint

    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="hotswap-multihost-"))
    model = create_checkpoint(tmp / "v1", preset="tiny", seed=0, overrides=SHAPES)
    update = create_checkpoint(tmp / "v2", preset="tiny", seed=1, overrides=SHAPES)
    with socket.socket() as s:  # only to pick a free port for jax's coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if args.local_devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--process-id", str(i), "--num-processes", str(args.num_processes)]
            + ["--coordinator", f"127.0.0.1:{port}", "--model", str(model), "--update", str(update)]
            + (["--transfer", args.transfer] if args.transfer else []),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(args.num_processes)
    ]
    rcs = []
    for i, p in enumerate(procs):
        out, _ = p.communicate(timeout=args.timeout)
        rcs.append(p.returncode)
        for line in out.splitlines():
            if line.startswith("{") or p.returncode:
                print(f"[process {i}] {line}", flush=True)
        print(f"[process {i}] exit {p.returncode}", flush=True)
    return max(rcs)


def serve(args) -> None:
    import jax

    from hotswap.engine import multihost

    multihost.initialize(args.coordinator, args.num_processes, args.process_id)
    from hotswap import LLM, SamplingParams
    from hotswap.weights import transfer

    # One model over every device of every process.
    llm = LLM(args.model, tensor_parallel_size=jax.device_count(), **ENGINE)
    seen: dict[str, dict] = {}  # request id -> token ids and the weights versions that made them
    record = {"process": jax.process_index(), "devices": jax.device_count(), "outputs": seen}

    def keep(out) -> None:
        if out.finished:
            c = out.outputs[0]
            seen[out.request_id] = {"ids": c.token_ids, "versions": sorted(set(c.weights_versions))}

    if jax.process_index() == 0:
        llm.engine = driver = multihost.Driver(llm.engine)
        sp = SamplingParams(**GREEDY)
        rounds = []

        def generate(tag: str) -> None:
            for k, prompt in enumerate(PROMPTS):
                driver.add_request(f"{tag}-{k}", prompt, sp, sink=keep)
            while any(f"{tag}-{k}" not in seen for k in range(len(PROMPTS))):
                driver.step()
            rounds.append(llm.weights_version)

        try:
            generate("v1")
            if args.transfer:
                transfer_updates(llm, json.loads(args.transfer), generate, record)
            else:
                usual_updates(llm, driver, args, generate, record)
            driver.reset_prefix_cache()
        finally:  # a failure here must end the followers too, not leave them waiting for a command
            driver.stop()
        record["versions_served"] = rounds
    else:
        record["commands"] = multihost.follow(llm.engine, on_output=keep)
    record["weights_version"] = llm.weights_version
    record["pulled_bytes"] = transfer.stats["bytes"]
    specs = jax.tree.leaves(llm.engine.abstract)
    record["param_bytes"] = sum(x.size * x.dtype.itemsize for x in specs)
    record["own_shard_bytes"] = sum(  # what this process's devices hold of the weights
        math.prod(len(range(*s.indices(n))) for s, n in zip(index, x.shape, strict=True)) * x.dtype.itemsize
        for x in specs
        for index in x.sharding.addressable_devices_indices_map(x.shape).values()
    )
    print(json.dumps(record), flush=True)
    jax.distributed.shutdown()


def transfer_updates(llm, refs: list[dict], generate, record: dict) -> None:
    """Each process pulls its own shards of the first offer; each other one fails everywhere."""
    from hotswap.errors import HotswapError
    from hotswap.weights.transfer import TransferRef

    good, *bad = (TransferRef.from_json(r) for r in refs)
    llm.update_weights(good)
    generate("t")
    record["rejected"] = []
    for ref in bad:
        try:
            llm.update_weights(ref)
            record["rejected"].append(None)
        except HotswapError as e:
            record["rejected"].append([type(e).__name__, str(e)])
    generate("t-after")


LORA_ALPHA = 4.0


def lora_tree(llm, rank: int = 2, seed: int = 0) -> dict:
    """A seeded rank-`rank` LoRA adapter on layer 0's q projection, in the params layout (what a
    JAX trainer holds): A `[D, r]`, B `[r, Hq, hd]`."""
    import numpy as np

    wq = llm.engine.abstract["layers"][0]["wq"]
    rng = np.random.default_rng(seed)
    a = (0.5 * rng.standard_normal((wq.shape[0], rank))).astype(np.float32)
    b = (0.5 * rng.standard_normal((rank, *wq.shape[1:]))).astype(np.float32)
    return {"layers": [{"wq": {"lora_a": a, "lora_b": b}}]}


def usual_updates(llm, driver, args, generate, record: dict) -> None:
    """Path, host tree, sleep/wakeup, bytes and LoRA adapter updates, then a rejected path."""
    from hotswap.checkpoint import hf
    from hotswap.checkpoint.payload import encode_safetensors
    from hotswap.errors import HotswapError

    llm.update_weights(args.update)  # a checkpoint path: every process reads it
    generate("v2")
    llm.update_weights(hf.load_hf_dir(args.model)[1])  # host tree: sent by device broadcast
    generate("v3")
    driver.sleep(1)  # params to host memory, KV dropped, on every process
    driver.wakeup()
    generate("v3-woken")
    payload = encode_safetensors(hf.read_hf_tensors(args.update))
    llm.update_weights(payload)  # safetensors bytes, as the HTTP endpoint receives them
    generate("v4")
    # A LoRA adapter in the params layout, merged into the base on every process (read and
    # checked on process 0, its factors broadcast and read back as an adapter).
    llm.update_weights(lora_tree(llm), lora_alpha=LORA_ALPHA)
    generate("v5-lora")
    try:  # a rejected update fails the same way everywhere and changes nothing
        llm.update_weights(Path(args.update) / "no-such-checkpoint")
    except HotswapError as e:
        record["rejected"] = type(e).__name__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process-id", type=int, default=None, help="set by the launcher")
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--local-devices", type=int, default=1, help="fake CPU devices per process")
    ap.add_argument("--coordinator", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--update", default=None)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--workdir", default=None, help="where the launcher writes the checkpoints")
    ap.add_argument("--transfer", default=None, help="JSON [good, bad, ...] per-process TransferRefs")
    args = ap.parse_args()
    if args.process_id is None:
        sys.exit(launch(args))
    serve(args)


if __name__ == "__main__":
    main()
