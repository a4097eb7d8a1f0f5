"""Sharded checks on an 8-device fake CPU mesh, run by tests/engine/test_sharding.py in a subprocess.

The device count is fixed when jax starts, and the rest of the suite runs on a
single device in its own process, so these checks live in a separate process
started with XLA_FLAGS=--xla_force_host_platform_device_count=8. Prints one
JSON object on the last line of stdout; the test asserts on it.

usage: python tests/support/sharding_worker.py TMPDIR
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import jax
from helpers import count_compiles
from jax.sharding import NamedSharding, PartitionSpec

from hotswap import LLM, SamplingParams
from hotswap.checkpoint import hf
from hotswap.checkpoint.create import create_checkpoint
from hotswap.errors import ConfigError
from hotswap.model import sharding
from hotswap.programs.step import PREFILL_ROW, forward_jit, placeholder_inputs, write_jit

# head_dim 16; every sharded dim (8 heads, 8 kv heads, F=256, V=512) divides by 8.
SHAPES = {"num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 128, "intermediate_size": 256}
# One page bucket (4 pages of 8) and prompts that each prefill in one C=16 chunk in the
# same step: the only compiled shapes are one prefill and one decode batch per mesh.
KW = dict(max_model_len=32, page_size=8, max_num_seqs=4, max_num_batched_tokens=48, warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(5, 20)), [7, 8, 9] * 4, list(range(100, 114))]
KV_COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)")


def generate(llm: LLM) -> list[dict]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [{"ids": o.outputs[0].token_ids, "lps": o.outputs[0].logprobs} for o in outs]


def padded(spec: PartitionSpec, ndim: int) -> list:
    """A spec as a JSON list, one entry per dim (P(None, 'tp') and P(None, 'tp', None) are the same)."""
    return list(spec) + [None] * (ndim - len(spec))


def describe(llm: LLM) -> dict:
    """Shardings as the test sees them: spec strings and per-device shard shapes."""
    p, pages = llm.params, llm.state.kv.pages[0]
    leaves = {"embed": p["embed"], "lm_head": p["lm_head"], **{k: p["layers"][0][k] for k in p["layers"][0]}}

    def info(x):
        shards = x.addressable_shards
        return {
            "spec": padded(x.sharding.spec, x.ndim) if hasattr(x.sharding, "spec") else None,
            "devices": len({s.device for s in shards}),
            "distinct": len({str(s.index) for s in shards}),
            "shard_shape": list(shards[0].data.shape),
        }

    return {"params": {k: info(v) for k, v in leaves.items()}, "kv": info(pages)}


def collectives(llm: LLM) -> dict:
    """Collectives in the compiled decode (B=4) and prefill (C=16) programs, as 'op shape' -> count.

    A reference step is two programs: the read-only forward (+ sampler) and the donated
    KV write; both are checked.
    """
    e, out = llm.engine, {}
    for name, (b, c) in {"decode": (4, 1), "prefill": (2, PREFILL_ROW)}.items():
        batch, sa = placeholder_inputs(b, c, 4, e.backend, vocab_size=e.mcfg.vocab_size)
        args = (e.state.params, e.state.kv.pages, batch, sa)
        fwd = forward_jit.lower(*args, cfg=e.mcfg, backend=e.backend).compile()
        new_kv, *_ = forward_jit(*args, cfg=e.mcfg, backend=e.backend)
        write = write_jit.lower(e.state.kv.pages, new_kv, batch, cfg=e.mcfg, backend=e.backend).compile()
        for prog, compiled in (("forward", fwd), ("write", write)):
            found = KV_COLLECTIVE.findall(compiled.as_text())
            out[f"{name}/{prog}"] = dict(Counter(f"{op} {shape}" for shape, op in found))
        out[f"{name}/new_kv_sharding"] = padded(new_kv[0][0].sharding.spec, 4)
        out[f"{name}/write_in_place"] = "input_output_alias" in write.as_text()  # donation survives
    return out


def fsdp(params, mesh):
    """What an FSDP trainer holds: every array split on its first axis over all 8 devices."""
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("fsdp"))), params)


def main(tmp: Path) -> dict:
    t0 = time.monotonic()
    dir_a = create_checkpoint(tmp / "a", preset="tiny", arch="llama", seed=0, overrides=SHAPES)
    dir_b = create_checkpoint(tmp / "b", preset="tiny", arch="llama", seed=1, overrides=SHAPES)
    res: dict = {"devices": jax.device_count(), "tp": {}, "timings": {}}

    llm = None
    for tp in (1, 2, 4, 8):
        t = time.monotonic()
        llm = LLM(dir_a, tensor_parallel_size=tp, **KW)
        res["tp"][tp] = {"out": generate(llm), "shardings": describe(llm)}
        res["timings"][f"tp{tp}"] = round(time.monotonic() - t, 1)
    llm8 = llm
    llm8.reset_prefix_cache()  # a prefix hit would read cached pages: another (valid) bucket
    with count_compiles() as n:
        generate(llm8)  # same shapes again: served from the jit cache
    res["recompiles_second_generate"] = n()

    t = time.monotonic()
    try:
        LLM(dir_a, tensor_parallel_size=3, **KW)
    except ConfigError as e:
        res["tp3_error"] = str(e)
    res["collectives"] = collectives(llm8)
    res["timings"]["hlo"] = round(time.monotonic() - t, 1)

    # Update from FSDP-sharded trainer params: a device-to-device reshard, no recompile.
    t = time.monotonic()
    fsdp_mesh = jax.make_mesh((8,), ("fsdp",), (jax.sharding.AxisType.Auto,))
    params_a, params_b = hf.load_hf_dir(dir_a)[1], hf.load_hf_dir(dir_b)[1]
    trainer_a, trainer_b = fsdp(params_a, fsdp_mesh), fsdp(params_b, fsdp_mesh)
    versions = [llm8.update_weights(trainer_a)]  # warm-up: the finiteness jit sees a new input sharding
    generate(llm8)
    with count_compiles() as n:
        versions.append(llm8.update_weights(trainer_b))
        after_update = generate(llm8)
    res["update"] = {"versions": versions, "recompiles": n(), "out": after_update}
    res["fresh_b"] = generate(LLM(dir_b, tensor_parallel_size=8, **KW))
    res["timings"]["update"] = round(time.monotonic() - t, 1)

    # Same-sharding update: arrays already on the engine's shardings are served as they are.
    mine = jax.device_put(params_a, sharding.param_shardings(llm8.config, sharding.make_mesh(8)))
    res["same_sharding_version"] = llm8.update_weights(mine)
    pairs = list(zip(jax.tree.leaves(mine), jax.tree.leaves(llm8.params), strict=True))
    res["same_sharding_identity"] = all(a is b for a, b in pairs)
    res["same_sharding_buffers"] = all(
        sa.data.unsafe_buffer_pointer() == sb.data.unsafe_buffer_pointer()
        for a, b in pairs
        for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True)
    )
    res["after_same_sharding"] = generate(llm8)
    res["timings"]["total"] = round(time.monotonic() - t0, 1)
    return res


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
