"""The `quantize` step of the ingest pipeline: full-precision weights, checked, become the
QTensors the engine serves (`kernels/qtensor.py`), at the first load and at every update.

`ModelConfig.quantization` names the scheme (the `quantization` engine option):

| scheme | matmul weights (q/k/v/o, gate/up/down, LM head)  | embedding, norms, router, experts |
|--------|--------------------------------------------------|-----------------------------------|
| `int8` | int8, one f32 scale per output column, or per    | the model's dtype                 |
|        | group of `quantization_group_size` inputs         |                                   |
| `fp8`  | float8_e4m3fn, one scale per output column        | the model's dtype                 |
| `gguf` | a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks as the   | token_embd in its blocks too      |
|        | file holds them; full-precision updates: Q8_0     | (llama.cpp's get_rows); the rest  |
|        | blocks                                            | dequantized to the model's dtype  |

Rows chosen by `ParamSpec.quantizable` (the spec table), one rule: the layer matmuls and the head, as vLLM's and
llama.cpp's weight-only schemes do; experts stay dense (the grouped matmul kernels take dense
weights). Scales are max |w| / 127 (int8) or / 448 (fp8) per column or group, values rounded
to nearest: symmetric round-to-nearest, what vLLM's and qwix's weight-only int8 do. An update
is checked at full precision first (shapes, dtypes, NaN/Inf: `plan.py`, `finiteness.py`), so a
bad update is refused before anything is quantized. Each quantized row is quantized as soon as
it is converted (`hf_device`, `serve_leaf`), in a staged copy as in an in-place update, so an
update holds the dense form of only the tensors in flight.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hotswap.errors import ConfigError
from hotswap.kernels.qtensor import QTensor, is_qtensor
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params
from hotswap.model.spec import ParamSpec, is_spec, param_specs

FP8_MAX = 448.0  # the largest float8_e4m3fn


def configured(
    cfg: ModelConfig,
    quantization: str | None,
    group_size: int | None,
    *,
    gguf: bool,
    device,
    deterministic: bool = False,
) -> ModelConfig:
    """`cfg` serving `quantization`, checked against the model and `device` (the first of the
    engine's): refused before anything loads, with a ConfigError naming why."""
    if quantization is None:
        if group_size is not None:
            raise ConfigError("quantization_group_size needs quantization='int8'")
        return cfg
    if deterministic:  # the quantized kernels have no fixed-order form (int8 rows quantize x on VNNI)
        raise ConfigError(
            "deterministic mode serves unquantized f32 weights; drop quantization or deterministic"
        )
    if quantization == "gguf" and not gguf:
        raise ConfigError(
            "quantization='gguf' serves a GGUF file's blocks as they are; this model is not a .gguf "
            "file (use quantization='int8')"
        )
    if quantization == "fp8" and not fp8_matmuls(device):
        raise ConfigError(
            f"quantization='fp8' needs a chip with fp8 matmuls (TPU v7, NVIDIA compute capability 8.9+); "
            f"this is {getattr(device, 'device_kind', device.platform)} ({device.platform}): use 'int8'"
        )
    cfg = dataclasses.replace(cfg, quantization=quantization, quantization_group_size=group_size)
    check(cfg)
    return cfg


def fp8_matmuls(device) -> bool:
    """Whether `device` multiplies fp8 natively (elsewhere fp8 would only be a storage format)."""
    kind = str(getattr(device, "device_kind", "")).lower()
    if device.platform == "tpu":
        return "v7" in kind or "7x" in kind
    if device.platform == "gpu":
        cc = getattr(device, "compute_capability", None)
        return cc is not None and tuple(int(p) for p in str(cc).split(".")[:2]) >= (8, 9)
    return False


def check(cfg: ModelConfig) -> None:
    """Refuse a scheme that cannot serve this model before anything loads: int8 with a group
    size that does not divide a quantized row's input size (naming the row)."""
    if cfg.quantization != "int8" or cfg.quantization_group_size is None:
        return
    g = cfg.quantization_group_size
    for spec in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec):
        k = math.prod(spec.shape[: spec.n_in])
        if spec.quantizable and k % g:
            raise ConfigError(
                f"quantization_group_size={g} does not divide {spec.name}'s input size {k} "
                f"(shape {spec.shape}); use a divisor of {k}, or no group size (one scale per column)"
            )


def groups(cfg: ModelConfig, spec: ParamSpec) -> int:
    k = math.prod(spec.shape[: spec.n_in])
    return 1 if cfg.quantization_group_size is None else k // cfg.quantization_group_size


def _scales_sharding(sharding, spec: ParamSpec):
    """Scales [G, out...] follow the weight's output axes; G is never split."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    parts = tuple(sharding.spec) + (None,) * (len(spec.shape) - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(None, *parts[spec.n_in :]))


def served_abstract(cfg: ModelConfig, abstract: Params) -> Params:
    """The tree the engine serves for the dense `abstract` it checks updates against: QTensors
    of ShapeDtypeStructs on the quantized rows (int8 and fp8; a GGUF's blocks are known only
    from its file, so "gguf" returns `abstract` and the served tree is the params'
    own). Used for programs compiled ahead of time and for memory sizing."""
    if cfg.quantization not in ("int8", "fp8"):
        return abstract
    dtype = jnp.int8 if cfg.quantization == "int8" else jnp.float8_e4m3fn

    def one(spec: ParamSpec, a):
        if not spec.quantizable:
            return a
        sh = getattr(a, "sharding", None)
        scales_shape = (groups(cfg, spec), *spec.shape[spec.n_in :])
        return QTensor(
            jax.ShapeDtypeStruct(a.shape, dtype, sharding=sh),
            jax.ShapeDtypeStruct(scales_shape, jnp.float32, sharding=_scales_sharding(sh, spec)),
            cfg.quantization,
            tuple(spec.shape),
            spec.n_in,
        )

    return jax.tree.map(one, param_specs(cfg), abstract, is_leaf=is_spec)


def serve(cfg: ModelConfig, params: Params) -> Params:
    """Checked full-precision params -> what the engine serves under `cfg.quantization`:
    each dense leaf of a quantized row quantized on its own devices (QTensors, as a GGUF's
    blocks arrive, pass as they are). None: `params` unchanged."""
    if cfg.quantization is None:
        return params
    return jax.tree.map(
        functools.partial(serve_leaf, cfg),
        param_specs(cfg),
        params,
        is_leaf=lambda x: is_spec(x) or is_qtensor(x),
    )


def serve_leaf(cfg: ModelConfig, spec: ParamSpec, leaf):
    """One checked leaf as `serve` serves it: quantized on a quantized row (`quantize_leaf`),
    else as it is. The HF conversion (`hf_device`) calls it on each tensor as it converts it,
    so an update holds the dense form of only the tensors in flight."""
    if cfg.quantization is None or leaf is None or is_qtensor(leaf) or not spec.quantizable:
        return leaf
    return quantize_leaf(cfg, spec, leaf)


def quantize_leaf(cfg: ModelConfig, spec: ParamSpec, leaf: jax.Array) -> QTensor | jax.Array:
    """One dense weight in the scheme's format, on the leaf's devices and sharding (under "gguf",
    a row whose inputs are not whole 32-wide Q8_0 blocks stays dense, as llama.cpp keeps it)."""
    k = spec.n_in
    sh = getattr(leaf, "sharding", None)
    if cfg.quantization == "gguf":
        if math.prod(spec.shape[:k]) % 32:  # not whole Q8_0 blocks: served in the model's dtype
            return leaf
        data = _q8_0_jit(leaf, k)
        return QTensor(data, None, "q8_0", tuple(spec.shape), k)
    fn, static = _program(cfg, spec, sh)
    data, scales = fn(leaf, *static)
    return QTensor(data, scales, cfg.quantization, tuple(spec.shape), k)


def lower_quantize(cfg: ModelConfig, spec: ParamSpec, dense: jax.ShapeDtypeStruct):
    """`quantize_leaf`'s program (int8 / fp8) for a dense leaf on `dense.sharding`, lowered and
    not run: what `hotswap aot` compiles for an update (`programs/catalog.py`)."""
    fn, static = _program(cfg, spec, dense.sharding)
    return fn.lower(dense, *static)


def _program(cfg: ModelConfig, spec: ParamSpec, sh):
    """The jitted int8 / fp8 quantizer and its static arguments (n_in, groups, out shardings)."""
    g = groups(cfg, spec) if cfg.quantization == "int8" else 1
    fn = _int8_jit if cfg.quantization == "int8" else _fp8_jit
    out = None if not isinstance(sh, NamedSharding) else (sh, _scales_sharding(sh, spec))
    return fn, (spec.n_in, g, out)


def _absmax_scales(w: jax.Array, n_in: int, g: int, top: float):
    """w [in..., out...] as [G, K/G, N] f32 and its scales [G, N]: max |w| / top (1 where a
    column is all zeros, so its values quantize to 0)."""
    shape = w.shape
    kk, nn = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    wg = w.astype(jnp.float32).reshape(g, kk // g, nn)
    amax = jnp.max(jnp.abs(wg), axis=1)
    return wg, jnp.where(amax > 0, amax / top, 1.0)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _int8_jit(w, n_in, g, out):
    wg, scales = _absmax_scales(w, n_in, g, 127.0)
    data = jnp.clip(jnp.round(wg / scales[:, None, :]), -127, 127).astype(jnp.int8).reshape(w.shape)
    scales = scales.reshape(g, *w.shape[n_in:])
    if out is not None:
        data, scales = jax.lax.with_sharding_constraint((data, scales), out)
    return data, scales


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _fp8_jit(w, n_in, g, out):
    wg, scales = _absmax_scales(w, n_in, g, FP8_MAX)
    data = (wg / scales[:, None, :]).astype(jnp.float8_e4m3fn).reshape(w.shape)
    scales = scales.reshape(g, *w.shape[n_in:])
    if out is not None:
        data, scales = jax.lax.with_sharding_constraint((data, scales), out)
    return data, scales


@functools.partial(jax.jit, static_argnums=(1,))
def _q8_0_jit(w, n_in):
    """llama.cpp's Q8_0 of the [out, in] matrix: per 32 inputs, d = max |w| / 127 as f16 and the
    values round(w / d) (quantize_row_q8_0_ref)."""
    kk = math.prod(w.shape[:n_in])
    m = w.astype(jnp.float32).reshape(kk, -1).T.reshape(-1, kk // 32, 32)  # [N, blocks, 32]
    d = jnp.max(jnp.abs(m), axis=-1) / 127.0
    inv = jnp.where(d > 0, 1.0 / d, 0.0)
    q = jnp.round(m * inv[..., None]).astype(jnp.int8)
    d16 = jax.lax.bitcast_convert_type(d.astype(jnp.float16), jnp.uint8)  # [N, blocks, 2]
    blocks = jnp.concatenate([d16, jax.lax.bitcast_convert_type(q, jnp.uint8)], axis=-1)
    return blocks.reshape(m.shape[0], -1)


def served_bytes(params: Params) -> int:
    """Bytes of a served tree (QTensors counted by their data and scales)."""
    return int(
        sum(
            leaf.nbytes if is_qtensor(leaf) else np.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
            for leaf in jax.tree.leaves(params, is_leaf=is_qtensor)
        )
    )


def label(params: Params) -> str | None:
    """How a served tree is quantized, as outputs report it: None (no QTensor), "int8" (a scale
    per column), "int8-g128" (per 128 inputs), "fp8", or "gguf:q4_1+q8_0" (the block formats
    it holds)."""
    qs = [leaf for leaf in jax.tree.leaves(params, is_leaf=is_qtensor) if is_qtensor(leaf)]
    if not qs:
        return None
    blocks = sorted({q.fmt for q in qs if q.format.blocks})
    if blocks:
        return "gguf:" + "+".join(blocks)
    q = qs[0]
    groups = q.scales.shape[0]
    return q.fmt if groups == 1 else f"{q.fmt}-g{q.k // groups}"
