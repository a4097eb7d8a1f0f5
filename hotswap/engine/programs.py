"""Every program the engine runs, compiled from abstract inputs, and what each costs per chip.

The engine runs these compiled programs and nothing else on its devices:
- one step per bucket (`runner.Buckets`): a decode batch or a packed prefill, the sampler
  inside it; for the read-then-write attention (`kernels.READ_THEN_WRITE`) also the KV write
  that follows it, one per token block shape;
- `kv init`: the empty page buffers a new or woken cache starts from (`state.new_kv_cache`);
- the update path (`hf_device`, `kernels/finite`): per distinct parameter shape and sharding,
  the on-device HF-layout conversion and the finiteness reduction.

Here each is lowered from `jax.ShapeDtypeStruct`s carrying the real shardings (no weight is
ever materialised) and compiled for the devices those shardings name: the engine's own
devices (`kv_sizing` measures the steps' temporaries this way before allocating the cache),
or a TPU slice described by a topology on a CPU host (`hotswap/aot.py`). `StepStats` is
XLA's per-chip memory analysis of one program plus its Pallas (Mosaic) calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hotswap.config import EngineConfig, ModelConfig
from hotswap.engine import hf_device, runner
from hotswap.engine.params import Params, abstract_params
from hotswap.engine.spec import is_spec, param_specs
from hotswap.errors import ProgramError
from hotswap.kernels import READ_THEN_WRITE, finite

# A Pallas kernel compiled for TPU is one Mosaic custom call in the optimized HLO.
MOSAIC_CALL = 'custom_call_target="tpu_custom_call"'


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One compiled program's per-chip bytes (XLA's memory analysis) and its Pallas calls."""

    name: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int  # outputs that reuse a donated argument's buffer (the KV updated in place)
    pallas_calls: int

    @property
    def peak_bytes(self) -> int:
        """Live while it runs: its arguments, its outputs that are not aliased, its temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @staticmethod
    def of(name: str, compiled) -> StepStats:
        m = compiled.memory_analysis()
        return StepStats(
            name=name,
            argument_bytes=int(m.argument_size_in_bytes),
            output_bytes=int(m.output_size_in_bytes),
            temp_bytes=int(m.temp_size_in_bytes),
            alias_bytes=int(m.alias_size_in_bytes),
            pallas_calls=compiled.as_text().count(MOSAIC_CALL),
        )


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the programs run: the params' and KV's shardings, and a replicated one for inputs."""

    params: Params  # params-shaped tree of Sharding
    kv: jax.sharding.Sharding
    replicated: jax.sharding.Sharding

    @staticmethod
    def on_mesh(params: Params, kv: NamedSharding) -> Target:
        return Target(params, kv, NamedSharding(kv.mesh, PartitionSpec()))

    @staticmethod
    def one_device(mcfg: ModelConfig, device: jax.Device) -> Target:
        one = jax.sharding.SingleDeviceSharding(device)
        return Target(jax.tree.map(lambda _: one, param_specs(mcfg), is_leaf=is_spec), one, one)


def abstract_inputs(mcfg: ModelConfig, ecfg: EngineConfig, target: Target):
    """(params, KV pages) as ShapeDtypeStructs on the target's shardings, in the model's dtype."""
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        abstract_params(mcfg),
        target.params,
    )
    shape = (ecfg.num_pages, ecfg.page_size, 2 * mcfg.num_kv_heads, mcfg.head_dim)
    page = jax.ShapeDtypeStruct(shape, jnp.dtype(mcfg.dtype), sharding=target.kv)
    return params, (page,) * mcfg.num_layers


def _abstract(tree, sharding) -> Any:
    """A tree of host arrays -> ShapeDtypeStructs on `sharding` (step inputs are replicated)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding), tree
    )


def step_name(b: int, c: int, p: int) -> str:
    return f"decode B={b} P={p}" if c == 1 else f"prefill rows={b} P={p}"


def largest_shapes(ecfg: EngineConfig) -> list[tuple[int, int, int]]:
    """The largest decode and the largest packed-prefill bucket: the steps with the most
    temporaries (what the KV sizing subtracts, and a quick AOT check)."""
    b = runner.Buckets.for_config(ecfg)
    return [(b.batch[-1], 1, b.pages[-1]), (b.blocks[-1], runner.PREFILL_ROW, b.prefill_pages[-1])]


def largest_temps(mcfg: ModelConfig, ecfg: EngineConfig, target: Target, impl: str) -> int:
    """The largest temporary (bytes per chip) of the largest steps, compiled for `ecfg`'s pool."""
    todo = step_programs(mcfg, ecfg, target, impl, largest_shapes(ecfg))
    return max(compile_stats(name, lower).temp_bytes for name, lower in todo)


def step_programs(
    mcfg: ModelConfig, ecfg: EngineConfig, target: Target, impl: str, shapes: list[tuple[int, int, int]]
) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(name, lower) for the step of each bucket shape (B, C, P), and the KV writes they need.
    `impl` is the attention the steps run (a resolved `EngineConfig.attention`, or
    "pallas_compiled" for a TPU compiled on a CPU host)."""
    params, pages = abstract_inputs(mcfg, ecfg, target)
    writes = set()
    for b, c, p in shapes:
        batch, sa = (_abstract(t, target.replicated) for t in runner.placeholder_inputs(b, c, p, impl))
        if impl not in READ_THEN_WRITE:
            yield (
                step_name(b, c, p),
                lambda batch=batch, sa=sa: runner.fused_jit.lower(
                    params, pages, batch, sa, cfg=mcfg, impl=impl
                ),
            )
            continue
        forward = runner.forward_jit.lower(params, pages, batch, sa, cfg=mcfg, impl=impl)
        yield step_name(b, c, p), lambda forward=forward: forward
        if (b, c) not in writes:  # the write depends on the token block only
            writes.add((b, c))
            yield (
                f"kv write B={b} C={c}",
                lambda forward=forward, batch=batch: runner.write_jit.lower(
                    pages, forward.out_info[0], batch.slots
                ),
            )


def kv_init_program(mcfg: ModelConfig, ecfg: EngineConfig, target: Target):
    """(name, lower) of the program that makes one empty layer buffer (`state.new_kv_cache`)."""
    shape = (ecfg.num_pages, ecfg.page_size, 2 * mcfg.num_kv_heads, mcfg.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(mcfg.dtype)), out_shardings=target.kv)
    return "kv init", zeros.lower


def update_programs(mcfg: ModelConfig, target: Target) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(name, lower) of an HF-named update's programs, once per distinct shape and sharding:
    the on-device conversion from the file's layout (`hf_device`) and the finiteness check."""
    dtype = np.dtype(jnp.dtype(mcfg.dtype))
    specs = jax.tree.leaves(param_specs(mcfg), is_leaf=is_spec)
    shardings = jax.tree.leaves(target.params)
    seen = set()
    for spec, sharding in zip(specs, shardings, strict=True):
        key = (spec.shape, spec.transpose, str(sharding))
        if key in seen:
            continue
        seen.add(key)
        dims = "x".join(map(str, spec.shape))
        src = jax.ShapeDtypeStruct(
            spec.hf_shape, dtype, sharding=hf_device._source_sharding(sharding, spec.transpose)
        )
        out = jax.ShapeDtypeStruct(spec.shape, dtype, sharding=sharding)
        convert = hf_device._converter(spec.transpose, dtype, sharding)
        yield f"update convert {dims}", lambda convert=convert, src=src: convert.lower(src)
        yield f"update finite {dims}", lambda out=out: finite._xla_finite.lower(out)


def compile_stats(name: str, lower: Callable[[], Any]) -> StepStats:
    """Lower and compile one program; errors propagate with the program's name (`ProgramError`)."""
    try:
        return StepStats.of(name, lower().compile())
    except Exception as e:  # any lowering or compiler error: say which program
        raise ProgramError(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def params_bytes_per_chip(mcfg: ModelConfig, target: Target) -> int:
    """Bytes of one chip's shards of the params (the largest over the chips)."""
    itemsize = jnp.dtype(mcfg.dtype).itemsize
    per = {}
    for spec, sharding in zip(
        jax.tree.leaves(param_specs(mcfg), is_leaf=is_spec), jax.tree.leaves(target.params), strict=True
    ):
        shard = sharding.shard_shape(spec.shape)
        for d in sharding.device_set:
            per[d] = per.get(d, 0) + int(np.prod(shard)) * itemsize
    return max(per.values())
