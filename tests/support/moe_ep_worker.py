"""Expert parallelism on an 8-device fake CPU mesh, run by tests/models/test_moe.py in a subprocess
(the device count is fixed when jax starts). Prints one JSON object on the last line of stdout.

usage: python tests/support/moe_ep_worker.py TMPDIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hotswap import LLM, SamplingParams
from hotswap.checkpoint.create import create_checkpoint
from hotswap.checkpoint.hf import load_hf_dir
from hotswap.errors import ConfigError
from hotswap.kernels.backend import Backend
from hotswap.model import moe, sharding

# 8 heads and kv heads (TP up to 8), 16 experts top-2 (EP up to 8), a dense layer among sparse.
SHAPES = {
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "mlp_only_layers": [1],
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
}
KW = dict(max_model_len=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=48, warmup=False)
SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, return_routed_experts=True)
PROMPTS = [list(range(5, 20)), [7, 8, 9] * 4, list(range(100, 130))]


def layer(model: Path) -> dict:
    """One sparse layer alone (`moe.sparse_mlp`), experts split over 2/4/8 devices, against one
    device: decode-sized (per-pair) and prefill-sized (grouped) inputs."""
    cfg, params = load_hf_dir(model)
    lp = params["layers"][0]
    one = Backend.choose("reference", head_dim=cfg.head_dim, devices=jax.devices()[:1])
    out = {}
    for rows in (4, 48):
        h = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, cfg.hidden_size), np.float32))
        want, want_e = jax.jit(lambda lp, h, be=one: moe.sparse_mlp(lp, cfg, h, be))(lp, h)
        for tp in (2, 4, 8):
            mesh = sharding.make_mesh(tp)
            be = Backend.choose("reference", head_dim=cfg.head_dim, mesh=mesh, head_axis="tp")
            placed = jax.device_put(lp, sharding.param_shardings(cfg, mesh)["layers"][0])
            got, got_e = jax.jit(lambda lp, h, be=be: moe.sparse_mlp(lp, cfg, h, be))(placed, h)
            out[f"{rows}/{tp}"] = [float(jnp.abs(got - want).max()), bool((got_e == want_e).all())]
    return out


def main(tmp: Path) -> dict:
    model = create_checkpoint(tmp / "moe", preset="tiny", arch="qwen3_moe", seed=0, overrides=SHAPES)
    res: dict = {"devices": jax.device_count(), "ep": {}, "layer": layer(model)}
    for tp in (1, 2, 4, 8):
        t = time.monotonic()
        llm = LLM(model, tensor_parallel_size=tp, **KW)
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, SP, use_tqdm=False)]
        gate = llm.params["layers"][0]["experts_gate"]
        res["ep"][tp] = {
            "out": [
                {"ids": o.token_ids, "lps": o.logprobs, "routed": o.routed_experts.tolist()} for o in outs
            ],
            "expert_shard": list(gate.addressable_shards[0].data.shape),
            "expert_spec": [str(a) for a in gate.sharding.spec] if hasattr(gate.sharding, "spec") else None,
        }
        print(f"tp={tp}: {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
    odd = create_checkpoint(
        tmp / "odd", preset="tiny", arch="qwen3_moe", seed=0, overrides={**SHAPES, "num_experts": 12}
    )
    try:
        LLM(odd, tensor_parallel_size=8, **KW)
    except ConfigError as e:
        res["odd_error"] = str(e)
    return res


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
