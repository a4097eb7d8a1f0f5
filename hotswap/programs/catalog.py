"""Every program the engine runs, compiled from abstract inputs, and what each costs per chip.

The engine runs these compiled programs and nothing else on its devices:
- one step per bucket (`step.Buckets`): a decode batch or a packed prefill, the sampler
  inside it; for a read-then-write backend (`Backend.read_then_write`, the jnp reference)
  also the KV write that follows it, one per token block shape; with speculative decoding,
  the bucket that verifies the most drafts in one call (`verification`);
- `kv init`: the empty page buffers a new or woken cache starts from (`state.new_kv_cache`);
- the update path (`hf_device`, `kernels/finite`): per distinct parameter shape and sharding,
  the on-device HF-layout conversion and the finiteness reduction, and on a row served int8 /
  fp8 its quantization (`weights/quantize.py`).

Here each is lowered from `jax.ShapeDtypeStruct`s carrying the real shardings (no weight is
ever materialised) and compiled for the devices those shardings name: the engine's own
devices (`kv_sizing` measures the steps' temporaries this way before allocating the cache),
or a TPU slice described by a topology on a CPU host (`hotswap/programs/tpu_slice.py`). The `Backend` is
chosen from those devices (`sharding.engine_backend`, as the Engine chooses it), so "auto"
compiles the Pallas kernel for a TPU slice. The params are the tree the engine serves
(`served_params`): under `quantization` int8 / fp8 the matmul weights are QTensors of int8 /
fp8 data and f32 scales, so the steps compile with the int8 dots (`kernels/quant_matmul.py`)
and every per-chip byte count is the served one. `StepStats` is XLA's per-chip memory
analysis of one program plus its Pallas (Mosaic) calls, any copy of a whole page buffer and
its matmuls' operand dtypes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hotswap.engine_config import EngineConfig
from hotswap.errors import ProgramError
from hotswap.kernels import finite
from hotswap.kernels.backend import Backend
from hotswap.kernels.qtensor import QTensor, is_qtensor
from hotswap.model import lora, sharding
from hotswap.model.config import ModelConfig
from hotswap.model.params import Params, abstract_params
from hotswap.model.spec import is_spec, param_specs
from hotswap.programs import kv_sizing
from hotswap.programs.step import PREFILL_ROW, Buckets, lower_step, pick, placeholder_inputs
from hotswap.speculative import MAX_VERIFYING_ROWS, SELF
from hotswap.weights import hf_device, place, quantize

# A Pallas kernel compiled for TPU is one Mosaic custom call in the optimized HLO.
MOSAIC_CALL = 'custom_call_target="tpu_custom_call"'
_HLO_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One compiled program's per-chip bytes (XLA's memory analysis) and its Pallas calls."""

    name: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int  # scratch the program allocates beyond its arguments and outputs
    alias_bytes: int  # outputs that reuse a donated argument's buffer (the KV updated in place)
    pallas_calls: int
    # Copies of a whole page buffer (a relayout around a kernel, say). XLA may place them in
    # another memory space, where temp_bytes does not count them: counted from the HLO.
    kv_copies: int = 0
    # The program's matmuls (XLA's dots and convolutions: XLA:TPU writes a matmul as one) by
    # operand and result dtypes, e.g. {"s8 x s8 -> s32": 15}: int8 weights multiplied as int8.
    matmuls: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        """Live while it runs: its arguments, its outputs that are not aliased, its temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @staticmethod
    def of(name: str, compiled, pages: Iterable[jax.ShapeDtypeStruct] = ()) -> StepStats:
        """`compiled`'s stats; `pages`: the distinct layer page buffers (a full layer's, a
        sliding-window layer's), to count copies of them."""
        m = compiled.memory_analysis()
        text = compiled.as_text()
        return StepStats(
            name=name,
            argument_bytes=int(m.argument_size_in_bytes),
            output_bytes=int(m.output_size_in_bytes),
            temp_bytes=int(m.temp_size_in_bytes),
            alias_bytes=int(m.alias_size_in_bytes),
            pallas_calls=text.count(MOSAIC_CALL),
            kv_copies=sum(_page_copies(text, page) for page in pages),
            matmuls=matmul_dtypes(text),
        )


# An HLO instruction's name and result type; a dot or convolution's result type and operands
# (printed with or without their types).
_DEFINED = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = \(?([a-z0-9]+)\[", re.M)
_OPERAND = r"(?:[a-z0-9]+\[[^\]]*\]\S* )?(%[\w.\-]+)"
_MATMUL = re.compile(
    rf"^\s*(?:ROOT )?%[\w.\-]+ = ([a-z0-9]+)\[[^\]]*\]\S* (?:convolution|dot)\({_OPERAND}, {_OPERAND}[,)]",
    re.M,
)


def matmul_dtypes(hlo: str) -> dict[str, int]:
    """How many dots and convolutions of an optimized HLO module multiply which dtypes, keyed
    "lhs x rhs -> result" in HLO's names (bf16, s8, f8e4m3fn, s32, f32)."""
    defined = dict(_DEFINED.findall(hlo))
    counts: dict[str, int] = {}
    for out, lhs, rhs in _MATMUL.findall(hlo):
        key = f"{defined.get(lhs, '?')} x {defined.get(rhs, '?')} -> {out}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _page_copies(hlo: str, page: jax.ShapeDtypeStruct) -> int:
    """`copy` (or async copy-start) instructions whose result is one device's page buffer."""
    local = page.sharding.shard_shape(page.shape) if page.sharding is not None else page.shape
    ty = f"{_HLO_DTYPES.get(page.dtype.name, page.dtype.name)}[{','.join(map(str, local))}]"
    return len(re.findall(rf"= \(?{re.escape(ty)}\{{[^}}]*\}}[^=]* copy(?:-start)?\(", hlo))


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the programs run: the Backend, the params' and KV's shardings, and a replicated
    sharding for the step inputs."""

    backend: Backend
    params: Params  # params-shaped tree of Sharding
    kv: jax.sharding.Sharding
    replicated: jax.sharding.Sharding

    @staticmethod
    def on(
        mcfg: ModelConfig,
        attention: str,
        shardings: Params | None,
        kv: NamedSharding | None,
        device=None,
        *,
        deterministic: bool = False,
    ):
        """The Engine's target for `Engine(shardings=, kv_sharding=)` (None, None: one device,
        `device` or the first of `jax.devices()`), with the Backend it would choose there
        (`deterministic`: its batch-invariant kernels)."""
        backend, kv = sharding.engine_backend(mcfg, attention, kv, device, deterministic=deterministic)
        if kv is None:
            one = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
            return Target(backend, jax.tree.map(lambda _: one, param_specs(mcfg), is_leaf=is_spec), one, one)
        return Target(backend, shardings, kv, NamedSharding(kv.mesh, PartitionSpec()))

    @staticmethod
    def first_chips(mcfg: ModelConfig, attention: str, devices: Sequence[Any], tp: int) -> Target:
        """The engine on the first `tp` of `devices` (a topology's chips): no mesh at TP 1."""
        if tp == 1:
            return Target.on(mcfg, attention, None, None, devices[0])
        mesh = sharding.make_mesh(tp, devices)
        return Target.on(
            mcfg, attention, sharding.param_shardings(mcfg, mesh), sharding.kv_sharding(mcfg, mesh)
        )


def served_params(mcfg: ModelConfig, target: Target, *, dense: bool = False) -> Params:
    """The params the engine serves, as ShapeDtypeStructs on the target's shardings: in the
    model's dtype, and on the rows `mcfg.quantization` serves quantized QTensors of int8/fp8
    data and f32 scales (`weights/quantize.py` `served_abstract`). `dense`: every row in the
    model's dtype, as an update's tensors arrive before they are quantized."""
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        abstract_params(mcfg),
        target.params,
    )
    return params if dense else quantize.served_abstract(mcfg, params)


def abstract_inputs(mcfg: ModelConfig, ecfg: EngineConfig, target: Target):
    """(params, KV pages) as ShapeDtypeStructs on the target's shardings: the served params
    (`served_params`), the pages in the model's KV dtype (`kv_dtype`) and the backend's page layout."""
    params = served_params(mcfg, target)
    if ecfg.enable_lora:  # the adapters' buffers ride in the step's params (EngineState.step_params)
        params = {**params, "lora": lora_buffers(mcfg, ecfg.max_loras, ecfg.max_lora_rank, target)}
    dtype = jnp.dtype(mcfg.kv_dtype)
    pages = tuple(
        jax.ShapeDtypeStruct(shape, dtype, sharding=target.kv)
        for shape in _page_shapes(mcfg, ecfg, target.backend)
    )
    return params, pages


def lora_buffers(mcfg: ModelConfig, max_loras: int, max_rank: int, target: Target) -> dict:
    """The abstract buffers of adapters served by name (model/lora.py): A `[*in, L*R]` and B
    `[L*R, *out]` per adaptable row, on the adapted weight's devices, and the column -> slot map."""
    cols, dtype = max_loras * max_rank, jnp.dtype(mcfg.dtype)
    layers = []
    for layer_specs, layer_sh in zip(param_specs(mcfg)["layers"], target.params["layers"], strict=True):
        bufs = {}
        for key, spec in layer_specs.items():
            if spec.adaptable:
                a_shape, b_shape = spec.lora_shapes(cols)
                a_sh, b_sh = lora.factor_shardings(layer_sh[key], len(a_shape) - 1)
                bufs[key] = (
                    jax.ShapeDtypeStruct(a_shape, dtype, sharding=a_sh),
                    jax.ShapeDtypeStruct(b_shape, dtype, sharding=b_sh),
                )
        layers.append(bufs)
    return {
        "layers": layers,
        "col_slot": jax.ShapeDtypeStruct((cols,), jnp.int32, sharding=target.replicated),
    }


def lora_bytes_per_chip(mcfg: ModelConfig, max_loras: int, max_rank: int, target: Target) -> int:
    """Bytes of one chip's shards of the buffers of adapters served by name."""
    return max(_shard_bytes(jax.tree.leaves(lora_buffers(mcfg, max_loras, max_rank, target))).values())


def _page_shapes(mcfg: ModelConfig, ecfg: EngineConfig, backend: Backend) -> list[tuple[int, ...]]:
    """Each layer's page buffer shape (a sliding-window layer's pool may be smaller,
    `kv_sizing.window_pages`), as `state.new_kv_cache` makes them."""
    window = kv_sizing.window_pages(mcfg, ecfg)
    rows = [
        window if window is not None and mcfg.layer_window(i) is not None else ecfg.num_pages
        for i in range(mcfg.num_layers)
    ]
    return [backend.page_shape(n, ecfg.page_size, mcfg.num_kv_heads, mcfg.head_dim) for n in rows]


def step_name(b: int, c: int, p: int) -> str:
    return f"decode B={b} P={p}" if c == 1 else f"prefill rows={b} P={p}"


def largest_shapes(ecfg: EngineConfig, backend: Backend) -> list[tuple[int, int, int]]:
    """The largest decode and the largest packed-prefill bucket: the steps with the most
    temporaries (what the KV sizing subtracts, and a quick AOT check)."""
    return Buckets.for_config(ecfg, backend).largest()


@dataclasses.dataclass(frozen=True)
class Verification:
    """The step that verifies the most drafts in one call (speculative decoding). A verifying
    sequence feeds its last token and its k draft tokens as one chunk, every position sampled:
    on a packed-prefill backend (Pallas, the reference) one row of PREFILL_ROW per sequence, in
    the packed-prefill program; on a ragged one, k + 1 of a [T, 1] step's tokens."""

    shape: tuple[int, int, int]  # (B, C, P) of the bucket
    sequences: int  # verifying sequences one call holds (each at max_model_len: P pages)
    tokens: int  # each one's chunk: its last token and k drafts
    sampled_rows: int  # S of the bucket: `Buckets.samples`, its drafts included
    calls: int  # calls a step takes to verify every sequence that may verify at once


def verification(ecfg: EngineConfig, backend: Backend) -> Verification | None:
    """The fullest verification step for `ecfg` (None without speculative decoding): as many
    sequences as may verify in one step (min(max_num_seqs, MAX_VERIFYING_ROWS), each a full
    draft: `speculative.verified_per_step`), as many as one call of the largest bucket holds."""
    spec = ecfg.speculative_config
    if spec is None:
        return None
    buckets = Buckets.for_config(ecfg, backend)
    tokens = spec.num_speculative_tokens + 1
    verifying = max(1, min(ecfg.max_num_seqs, MAX_VERIFYING_ROWS, ecfg.max_num_batched_tokens // tokens))
    if buckets.ragged:
        n = max(1, min(verifying, buckets.batch[-1] // tokens))
        shape = (pick(buckets.batch, min(n * tokens, buckets.batch[-1])), 1, buckets.pages[-1])
    else:
        n = min(verifying, buckets.blocks[-1])
        shape = (pick(buckets.blocks, n), PREFILL_ROW, buckets.prefill_pages[-1])
    return Verification(shape, n, tokens, buckets.samples(*shape[:2]), -(-verifying // n))


def draft_programs(
    mcfg: ModelConfig, ecfg: EngineConfig, target: Target
) -> list[tuple[str, Callable[[], Any]]]:
    """A self-speculative draft's step (speculative_config draft_model "self"; none otherwise,
    a draft checkpoint's included): the decode step of the model cut to its first layers, at
    the most sequences a step drafts for, on the same params and pages (its K/V are the
    target's of those layers)."""
    spec = ecfg.speculative_config
    if spec is None or spec.method != "draft_model" or spec.model != SELF:
        return []
    spec.check_model(mcfg.num_layers)
    buckets = Buckets.for_config(ecfg, target.backend)
    shape = (pick(buckets.batch, min(ecfg.max_num_seqs, MAX_VERIFYING_ROWS)), 1, buckets.pages[-1])
    n = spec.draft_layers
    on = dataclasses.replace(target, params={**target.params, "layers": target.params["layers"][:n]})
    return [
        (f"draft {name}", lower) for name, lower in step_programs(mcfg.first_layers(n), ecfg, on, [shape])
    ]


def pool_bytes_per_chip(pages: Iterable[jax.ShapeDtypeStruct]) -> int:
    """One chip's bytes of the layers' page buffers (`abstract_inputs`' pages)."""
    return sum(
        int(np.prod(p.sharding.shard_shape(p.shape) if p.sharding is not None else p.shape))
        * p.dtype.itemsize
        for p in pages
    )


def largest_temps(mcfg: ModelConfig, ecfg: EngineConfig, target: Target) -> int:
    """The largest temporary (bytes per chip) of the largest steps, compiled for `ecfg`'s pool."""
    todo = step_programs(mcfg, ecfg, target, largest_shapes(ecfg, target.backend))
    return max(compile_stats(name, lower).temp_bytes for name, lower in todo)


def step_programs(
    mcfg: ModelConfig, ecfg: EngineConfig, target: Target, shapes: list[tuple[int, int, int]]
) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(name, lower) for the programs `step.run_step` runs for each bucket shape (B, C, P):
    the step, and for a read-then-write backend the KV write (once per token block: it does
    not depend on P)."""
    params, pages = abstract_inputs(mcfg, ecfg, target)
    writes = set()
    buckets = Buckets.for_config(ecfg, target.backend)
    for b, c, p in shapes:
        inputs = placeholder_inputs(
            b, c, p, target.backend, buckets.samples(b, c), vocab_size=mcfg.vocab_size
        )
        batch, sa = (_abstract(t, target.replicated) for t in inputs)
        lowered = dict(lower_step(params, pages, batch, sa, cfg=mcfg, backend=target.backend))
        yield step_name(b, c, p), lambda low=lowered["step"]: low
        if "write" in lowered and (b, c) not in writes:
            writes.add((b, c))
            yield f"kv write B={b} C={c}", lambda low=lowered["write"]: low


def _abstract(tree, where) -> Any:
    """A tree of host arrays -> ShapeDtypeStructs on `where` (step inputs are replicated)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=where), tree
    )


def kv_init_programs(
    mcfg: ModelConfig, ecfg: EngineConfig, target: Target
) -> list[tuple[str, Callable[[], Any]]]:
    """(name, lower) of the programs that make one empty layer buffer (`state.new_kv_cache`):
    one per distinct shape (a full layer's, a sliding-window layer's)."""
    programs = []
    for shape in dict.fromkeys(_page_shapes(mcfg, ecfg, target.backend)):
        zeros = jax.jit(
            lambda shape=shape: jnp.zeros(shape, jnp.dtype(mcfg.kv_dtype)), out_shardings=target.kv
        )
        programs.append((f"kv init {shape[0]} pages", zeros.lower))
    return programs


def update_programs(mcfg: ModelConfig, target: Target) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(name, lower) of an HF-named update's programs, once per distinct shape and sharding:
    the on-device conversion from the file's layout (`hf_device`), the finiteness check and,
    on a row served int8 / fp8, the quantization (`weights/quantize.py`)."""
    dtype = np.dtype(jnp.dtype(mcfg.dtype))
    specs = jax.tree.leaves(param_specs(mcfg), is_leaf=is_spec)
    shardings = jax.tree.leaves(target.params)
    seen = set()
    for spec, sh in zip(specs, shardings, strict=True):
        key = (spec.layout, str(sh))
        if key in seen:
            continue
        seen.add(key)
        dims = "x".join(map(str, spec.shape))
        out = jax.ShapeDtypeStruct(spec.shape, dtype, sharding=sh)
        yield f"update convert {dims}", lambda spec=spec, sh=sh: hf_device.lower_conversion(spec, dtype, sh)
        yield f"update finite {dims}", lambda out=out: finite.lower_xla_check(out)
        if spec.quantizable and mcfg.quantization in ("int8", "fp8"):  # each tensor as converted
            yield (
                f"update quantize {dims}",
                lambda spec=spec, out=out: quantize.lower_quantize(mcfg, spec, out),
            )


def compile_stats(
    name: str, lower: Callable[[], Any], pages: Iterable[jax.ShapeDtypeStruct] = ()
) -> StepStats:
    """Lower and compile one program (`pages`: the distinct layer page buffers, to count copies
    of them); errors propagate with the program's name (`ProgramError`)."""
    try:
        return StepStats.of(name, lower().compile(), pages)
    except Exception as e:  # any lowering or compiler error: say which program
        raise ProgramError(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def params_bytes_per_chip(mcfg: ModelConfig, target: Target, *, experts_only: bool = False) -> int:
    """Bytes of one chip's shards of the served params (the largest over the chips; a quantized
    row counts its int8/fp8 data and f32 scales); `experts_only`: of the sparse layers' stacked
    expert weights alone."""
    per = _leaf_bytes_per_chip(mcfg, target, experts_only=experts_only)
    return max((sum(leaves) for leaves in per.values()), default=0)


def weights_per_chip(mcfg: ModelConfig, target: Target, staging: str) -> kv_sizing.Weights:
    """One chip's served params and what a hot update needs beside them under `staging`
    (`weight_update_staging`; `weights/place.py` `update_reserve`): what the KV sizing
    takes off each chip before the cache. The params are counted as served (int8/fp8 data and
    f32 scales on the quantized rows); an update's tensors arrive at full precision, so those in
    flight are counted dense. Each is quantized as soon as it is converted (`hf_device`,
    `quantize.serve_leaf`): no dense copy of the whole tree is ever held."""
    per = _leaf_bytes_per_chip(mcfg, target)
    dense = _leaf_bytes_per_chip(mcfg, target, dense=True)
    params = max((sum(leaves) for leaves in per.values()), default=0)
    largest = max((max(leaves) for leaves in dense.values()), default=0)
    resolved = place.resolve(staging, next(iter(target.kv.device_set)).platform)
    return kv_sizing.Weights(params, place.update_reserve(resolved, params, largest), resolved)


def _leaf_bytes_per_chip(
    mcfg: ModelConfig, target: Target, *, experts_only: bool = False, dense: bool = False
) -> dict:
    """Each chip's bytes of each leaf's shard, {device: [bytes, ...]}: of the served params (a
    QTensor's data and scales together), or with `dense` of the params in the model's dtype."""
    leaves = jax.tree.leaves(served_params(mcfg, target, dense=dense), is_leaf=is_qtensor)
    specs = jax.tree.leaves(param_specs(mcfg), is_leaf=is_spec)
    per: dict[Any, list[int]] = {}
    for spec, leaf in zip(specs, leaves, strict=True):
        if experts_only and "expert" not in spec.axes:
            continue
        parts = (leaf.data, leaf.scales) if isinstance(leaf, QTensor) else (leaf,)
        for d, n in _shard_bytes(parts).items():
            per.setdefault(d, []).append(n)
    return per


def _shard_bytes(arrays: Iterable[jax.ShapeDtypeStruct]) -> dict[Any, int]:
    """{device: bytes of its shards of `arrays`} (ShapeDtypeStructs with shardings)."""
    out: dict[Any, int] = {}
    for x in arrays:
        if x is None:
            continue
        n = int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
        for d in x.sharding.device_set:
            out[d] = out.get(d, 0) + n
    return out


def active_expert_fraction(mcfg: ModelConfig, rows: int) -> float:
    """The share of a sparse layer's experts a decode step of `rows` tokens reads, expected under
    uniform routing (each row picks k distinct of E): 1 - (1 - k/E)^rows. 1 for a dense model."""
    if not mcfg.num_experts:
        return 1.0
    return 1.0 - (1.0 - mcfg.num_experts_per_tok / mcfg.num_experts) ** rows
