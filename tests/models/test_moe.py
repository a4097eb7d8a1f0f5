"""Mixture of experts (Qwen3-MoE, Mixtral) against HF transformers (PyTorch CPU, eager, f32):
generation through the paged engine (chunked prefill, prefix hits, decode), the experts each
token was routed to, an HF round trip and the typed errors of a checkpoint that does not fit.
`score` and bf16 parity run with the dense families in test_parity.py / test_parity_bf16.py."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
import transformers
from helpers import SUPPORT, WORKER_PYTHONPATH, soak
from safetensors.numpy import load_file, save_file
from test_parity import MOE_CASES

from hotswap import LLM, SamplingParams
from hotswap.checkpoint.create import create_checkpoint
from hotswap.checkpoint.hf import load_hf_dir, save_hf_dir
from hotswap.errors import WeightsMismatch
from hotswap.kernels.backend import jnp_matmuls

GEN = 12


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {
        name: create_checkpoint(root / name, preset="tiny", arch=arch, seed=11, overrides=ov)
        for name, (arch, ov) in MOE_CASES.items()
    }


def _hf_run(model, seq: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """[len(seq), V] f32 log-probs of the token after each position, and per sparse layer the
    router's scores [len(seq), E] (`output_router_logits`)."""
    with torch.no_grad():
        out = model(torch.tensor([seq]), output_router_logits=True)
    logprobs = torch.log_softmax(out.logits[0].float(), -1).numpy()
    return logprobs, [r.float().numpy() for r in out.router_logits]


# Mixtral's generate with HOTSWAP_SOAK=1: its score and bf16 parity run in test_parity*.py.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=soak) if n.startswith("mixtral") else n for n in MOE_CASES]
)
def test_generate_matches_transformers(moe_dirs, name):
    model_dir = moe_dirs[name]
    # 32-token steps: the 70-token prompt prefills in chunks; pages of 16: the second round's
    # prompts (each first prompt plus half its continuation) hit the pages the first wrote.
    llm = LLM(
        model_dir,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        page_size=16,
        warmup=False,
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, llm.config.vocab_size, n).tolist() for n in (5, 40, 70)]
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    first = llm.generate(prompts, sp, use_tqdm=False)
    again = [p + list(o.outputs[0].token_ids[: GEN // 2]) for p, o in zip(prompts, first, strict=True)]
    hits = llm.engine.stats["cached_tokens"]
    second = llm.generate(again, sp, use_tqdm=False)
    assert llm.engine.stats["cached_tokens"] - hits >= 16 * 2

    worst, agree = 0.0, {"computed": [], "from the prefix cache": []}
    k, cfg = llm.config.num_experts_per_tok, llm.config
    for ctx, ro in zip(prompts + again, first + second, strict=True):
        out, hit = ro.outputs[0], ro.num_cached_tokens
        seq = ctx + list(out.token_ids)
        lp, router = _hf_run(hf, seq)
        at = lp[len(ctx) - 1 : len(seq) - 1]  # [GEN, V]: the positions that chose each token
        assert list(out.token_ids) == at.argmax(-1).tolist(), f"{name}: greedy differs from HF"
        theirs = at[np.arange(GEN), out.token_ids]
        worst = max(worst, float(np.abs(np.asarray(out.logprobs) - theirs).max()))
        # The experts of every input token, against HF's router top-k (its softmax, in f32).
        assert len(router) == len(cfg.moe_layers)
        hf_top = np.stack(
            [torch.topk(torch.softmax(torch.tensor(r), -1), k).indices.numpy() for r in router], 1
        )
        routed = out.routed_experts
        assert routed.shape == (len(seq) - 1, len(cfg.moe_layers), k) and routed.dtype == np.int16
        same = np.all(routed == hf_top[:-1], axis=-1)  # [tokens, layers]
        agree["computed"].append(same[hit:].ravel())
        agree["from the prefix cache"].append(same[:hit].ravel())
    assert worst <= 1e-4, f"{name}: max |dlogprob| {worst:.2e}"
    for where, parts in agree.items():
        rate = float(np.concatenate(parts).mean())
        assert rate >= 0.99, f"{name}: routed experts of tokens {where} equal HF's top-k at {rate:.4f}"
    llm.engine.check_invariants()


@pytest.mark.transformers_matrix
def test_hf_round_trip(moe_dirs, tmp_path):
    """load -> save -> load is bit-exact, per-expert tensors as HF names them, and the saved
    directory loads in transformers."""
    src = moe_dirs["qwen3-moe-8x2-norm+dense-layer"]
    cfg, params = load_hf_dir(src)
    save_hf_dir(json.loads((src / "config.json").read_text()), params, tmp_path)
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert sorted(a) == sorted(b)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in b
    assert "model.layers.1.mlp.down_proj.weight" in b  # the dense layer (mlp_only_layers)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert cfg.moe_layers == (0, 2)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)


def _edited(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    t = load_file(src / "model.safetensors")
    hf = json.loads((src / "config.json").read_text())
    if edit_tensors:
        edit_tensors(t)
    if edit_config:
        edit_config(hf)
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def test_checkpoint_that_does_not_fit_is_refused(moe_dirs, tmp_path):
    src = moe_dirs["qwen3-moe-8x2-norm+dense-layer"]
    llm = LLM(src, max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16, warmup=False)

    def drop_expert(t):
        del t["model.layers.2.mlp.experts.5.up_proj.weight"]

    missing = _edited(src, tmp_path / "missing", drop_expert)
    with pytest.raises(WeightsMismatch, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        llm.update_weights(str(missing))

    def more_experts(t):  # a 9th expert for every projection, and a router that scores 9
        for name in list(t):
            if ".experts.7." in name:
                t[name.replace(".experts.7.", ".experts.8.")] = t[name]
            if name.endswith("mlp.gate.weight"):
                t[name] = np.concatenate([t[name], t[name][:1]])

    nine = _edited(src, tmp_path / "nine", more_experts, lambda c: c.update(num_experts=9))
    with pytest.raises(WeightsMismatch, match="num_experts=9"):
        llm.update_weights(str(nine))
    nine_no_config = _edited(src, tmp_path / "nine-tensors", more_experts)
    (nine_no_config / "config.json").unlink()
    with pytest.raises(WeightsMismatch, match=r"model\.layers\.0\.mlp\.experts\.8\.|mlp\.gate\.weight"):
        llm.update_weights(str(nine_no_config))

    top4 = _edited(src, tmp_path / "top4", edit_config=lambda c: c.update(num_experts_per_tok=4))
    with pytest.raises(WeightsMismatch, match="num_experts_per_tok=4"):
        llm.update_weights(str(top4))
    assert llm.weights_version == 1  # every refusal left the weights serving


@pytest.mark.parametrize("sizes", [[0, 33, 0, 1, 31, 32, 0, 3], [1, 0, 0, 0, 0, 0, 0, 0], [0] * 7 + [64]])
def test_grouped_matmuls_agree(sizes):
    """The CPU's tiled grouped matmul against XLA's ragged_dot, on groups of 0, 1, TILE-1, TILE,
    TILE+1 rows and all rows in the last group."""
    import jax
    import jax.numpy as jnp

    from hotswap.kernels import grouped_matmul

    rng = np.random.default_rng(0)
    n, g = sum(sizes), len(sizes)
    x = jnp.asarray(rng.standard_normal((n, 24), np.float32))
    w = jnp.asarray(rng.standard_normal((g, 24, 40), np.float32))
    gs = jnp.asarray(sizes, jnp.int32)
    want = np.asarray(jax.lax.ragged_dot(x, w, gs))
    np.testing.assert_allclose(jax.jit(grouped_matmul.tiled)(x, w, gs), want, rtol=1e-5, atol=1e-5)


def test_grouped_matmul_rows_past_the_groups_are_zero():
    """Under expert parallelism a device's groups hold only its pairs: the rest come back 0."""
    import jax
    import jax.numpy as jnp

    from hotswap.kernels import grouped_matmul

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((40, 8), np.float32))
    w = jnp.asarray(rng.standard_normal((3, 8, 5), np.float32))
    gs = jnp.asarray([5, 0, 30], jnp.int32)
    got = np.asarray(jax.jit(grouped_matmul.tiled)(x, w, gs))
    np.testing.assert_allclose(got, np.asarray(jax.lax.ragged_dot(x, w, gs)), rtol=1e-5, atol=1e-5)
    assert not got[35:].any()


@soak  # an engine per EP degree over 8 host devices: 97 s with a warm compilation cache, up to 30 min cold
def test_expert_parallel_matches_one_device(tmp_path):
    """EP 2/4/8 (experts split by expert over the tensor-parallel devices, attention by head) on
    a fake 8-device CPU mesh: the tokens, log-probs and routed experts of one device."""
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": WORKER_PYTHONPATH,
    }
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "moe_ep_worker.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["devices"] == 8
    for key, (diff, same_experts) in res["layer"].items():  # rows/devices: one sparse layer alone
        assert diff <= 1e-5 and same_experts, (key, diff)
    base = res["ep"]["1"]["out"]
    for tp in ("2", "4", "8"):
        got = res["ep"][tp]
        assert got["expert_shard"] == [16 // int(tp), 128, 64]  # each device its experts, whole
        for a, b in zip(got["out"], base, strict=True):
            assert a["ids"] == b["ids"]
            np.testing.assert_allclose(a["lps"], b["lps"], atol=1e-4)
            assert a["routed"] == b["routed"]
    assert "num_experts=12" in res["odd_error"] and "tensor_parallel_size=8" in res["odd_error"]


@soak  # a server process compiling its own buckets, checked against HF: about 15 minutes
def test_server_returns_routed_experts(moe_dirs, tmp_path):
    """A real `hotswap serve --enable-return-routed-experts`: SGLang's /generate (base64 int32,
    `routed_experts_start_len` for a later turn) and vLLM's `routed_experts` on /v1/completions,
    both HF's router top-k."""
    import base64

    import httpx
    from api_helpers import ADMIN_KEY, admin
    from helpers import KNOBS
    from server_process import ServerProcess, cli_flags

    model_dir = moe_dirs["qwen3-moe-8x2-norm+dense-layer"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    flags = [
        str(model_dir),
        "--admin-key",
        ADMIN_KEY,
        "--served-model-name",
        "moe",
        "--enable-return-routed-experts",
    ]
    flags += cli_flags(**KNOBS)
    prompt = np.random.default_rng(3).integers(4, 512, 40).tolist()
    with ServerProcess(flags, tmp_path / "server.log") as server:
        server.wait_healthy(900)
        http = httpx.Client(base_url=server.base, timeout=120)
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
        first = http.post("/generate", json={**body, "return_routed_experts": True}, headers=admin()).json()
        turn2 = prompt + first["output_ids"] + [7, 8, 9]
        later = {
            "input_ids": turn2,
            "sampling_params": body["sampling_params"],
            "return_routed_experts": True,
        }
        second = http.post(
            "/generate", json={**later, "routed_experts_start_len": len(prompt)}, headers=admin()
        ).json()
        done = http.post(
            "/v1/completions",
            json={"model": "moe", "prompt": prompt, "max_tokens": 6, "temperature": 0.0},
            headers=admin(),
        ).json()

    def hf_top(seq):
        _, router = _hf_run(hf, seq)
        return np.stack(
            [torch.topk(torch.softmax(torch.tensor(r), -1), 2).indices.numpy() for r in router], 1
        )

    def decoded(meta):
        return np.frombuffer(base64.b64decode(meta["routed_experts"]), np.int32).reshape(-1, 2, 2)

    seq1 = prompt + first["output_ids"]
    got1 = decoded(first["meta_info"])
    assert got1.shape == (len(seq1) - 1, 2, 2)
    assert np.mean(np.all(got1 == hf_top(seq1)[:-1], -1)) >= 0.99
    seq2 = turn2 + second["output_ids"]
    got2 = decoded(second["meta_info"])
    assert second["meta_info"]["routed_experts_start_len"] == len(prompt)
    assert got2.shape == (len(seq2) - 1 - len(prompt), 2, 2)
    assert np.mean(np.all(got2 == hf_top(seq2)[len(prompt) : -1], -1)) >= 0.99
    choice = done["choices"][0]
    assert np.array_equal(np.asarray(choice["routed_experts"]), got1)


def test_qwen3_30b_a3b_preset_has_the_published_sizes():
    """The preset's spec table: 30.5B parameters of which 3.3B are active per token (Qwen's
    model card), every layer sparse."""
    import jax

    from hotswap.checkpoint.create import load_preset
    from hotswap.model.config import ModelConfig
    from hotswap.model.spec import is_spec, param_specs

    cfg = ModelConfig.from_hf(load_preset("qwen3-30b-a3b"))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    assert cfg.moe_layers == tuple(range(48)) and cfg.norm_topk_prob and cfg.dtype == "bfloat16"
    rows = jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
    total = sum(int(np.prod(s.shape)) for s in rows)
    experts = sum(int(np.prod(s.shape)) for s in rows if "expert" in s.axes)
    active = total - experts * (1 - 8 / 128)
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 <= active < 3.4e9, (total, active)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "t,k,e,d,f",
    [
        (3, 3, 8, 44, 70),  # tokens sharing experts (read once for all their pairs); 8-lane tails
        (1, 2, 16, 200, 1000),  # a decode row: several column chunks per expert
    ],
)
def test_routed_experts_kernel_equals_the_slices(t, k, e, d, f, dtype):
    """The C++ kernel, reading the routed experts' rows in place, against the jnp twin that
    slices each pair's matrices out of the stacks (f32 weights and bf16 ones as they are), one
    pair weighted 0 as under expert parallelism."""
    import jax
    import jax.numpy as jnp

    from hotswap.kernels import cpu_experts, routed_experts

    rng = np.random.default_rng(2)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((t, d)), dt)
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    assert t == 1 or len(np.unique(experts)) < t * k
    experts = jnp.asarray(experts, jnp.int32)
    weights = rng.random((t, k)).astype(np.float32)
    weights[0, -1] = 0.0
    gate, up = (jnp.asarray(rng.standard_normal((e, d, f)) / np.sqrt(d), dt) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((e, f, d)) / np.sqrt(f), dt)
    args = (x, experts, jnp.asarray(weights), gate, up, down)
    got = np.asarray(jax.jit(cpu_experts.routed_experts)(*args))
    want = np.asarray(jax.jit(functools.partial(routed_experts.sliced, mms=jnp_matmuls))(*args))
    assert got.dtype == want.dtype == np.float32 and got.shape == (t, d)
    if dtype == "float32":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:  # both round gate, up, SwiGLU and each expert's output to bf16; their sums differ in order
        assert np.abs(got - want).max() <= 2.0**-6 * np.abs(want).max()


def test_decode_step_reads_the_routed_experts_in_place(tmp_path):
    """The compiled batch-1 decode step on one CPU device passes each sparse layer's stacked
    experts (parameters) straight to the kernel: no slice or gather of an expert's matrix and no
    copy of a stack. The jnp twin's program slices them, so the check sees slices where they are."""
    import re

    import jax
    import jax.numpy as jnp

    from hotswap.model import moe
    from hotswap.programs.step import forward_jit, placeholder_inputs

    d, f = 64, 48  # hidden and expert widths: an expert's matrix is [64, 48] or [48, 64]
    model = create_checkpoint(
        tmp_path / "m",
        preset="tiny",
        arch="qwen3_moe",
        seed=0,
        overrides={"num_hidden_layers": 1, "hidden_size": d, "moe_intermediate_size": f},
    )
    llm = LLM(model, max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16, warmup=False)
    e = llm.engine
    assert e.backend.attention == "cpu" and e.mcfg.num_experts == 8

    def expert_slices(hlo: str) -> list[str]:
        """Slices and gathers whose result holds an expert's matrix ([.., 64, 48] or [.., 48, 64])."""
        found = []
        for line in hlo.splitlines():
            m = re.search(r"= \w+\[([\d,]*)\]\S* (dynamic-slice|gather|slice)\(", line)
            if m and {d, f} <= {int(n) for n in m.group(1).split(",") if n}:
                found.append(line)
        return found

    batch, sa = placeholder_inputs(1, 1, 4, e.backend, vocab_size=e.mcfg.vocab_size)
    args = (e.state.params, e.state.kv.pages, batch, sa)
    hlo = forward_jit.lower(*args, cfg=e.mcfg, backend=e.backend).compile().as_text()
    defined = dict(re.findall(r"^\s*(?:ROOT )?(%\S+) = \S+ ([\w-]+)\(", hlo, flags=re.M))  # name -> op
    calls = [line for line in hlo.splitlines() if "HotswapRoutedExperts" in line and "custom-call(" in line]
    assert len(calls) == 1  # one per sparse layer
    for call in calls:
        operands = re.findall(r"%[\w.-]+", call.split("custom-call(", 1)[1].split(")", 1)[0])
        gate, up, down = operands[3:6]  # x, experts, weights, then the stacks: the step's parameters
        assert [defined[name] for name in (gate, up, down)] == ["parameter"] * 3, call
        assert "experts_gate" in gate and "experts_up" in up and "experts_down" in down, call
    assert expert_slices(hlo) == []
    assert not re.search(r"= \w+\[8,(64,48|48,64)\]\S* copy\(", hlo)
    # The control: the jnp twin (backend None) on one decode row slices 2 pairs x 3 matrices.
    lp = e.state.params["layers"][0]
    row = jax.ShapeDtypeStruct((1, d), jnp.float32)
    sliced = jax.jit(lambda lp, h: moe.sparse_mlp(lp, e.mcfg, h)).lower(lp, row).compile().as_text()
    assert "HotswapRoutedExperts" not in sliced and len(expert_slices(sliced)) >= 2 * 3
