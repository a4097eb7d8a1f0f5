"""Compile the engine's step programs ahead of time for devices that need not be attached.

With `jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")`
a CPU host gets TPU devices that `jit(...).lower(ShapeDtypeStruct(..., sharding=...)).compile()`
compiles for with the real TPU compiler (Mosaic included). This module builds what the Engine
would run on such devices, abstractly: the mesh, the `Backend` (chosen from those devices, so
"auto" is Pallas on TPU), params and pages as ShapeDtypeStructs carrying their shardings, and
a bucket's all-padding inputs, then lowers the runner's own jitted programs (`runner.lower_step`)
and reports per program what the compiled executable needs per chip (`StepStats`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from hotswap.config import EngineConfig, ModelConfig
from hotswap.engine import runner, sharding
from hotswap.engine.params import Params, abstract_params
from hotswap.kernels.backend import Backend

# Each Mosaic (Pallas TPU) kernel is one custom call with this target in the compiled HLO.
MOSAIC_TARGET = 'custom_call_target="tpu_custom_call"'
_HLO_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One compiled program's per-chip bytes (XLA's memory analysis) and its Pallas calls."""

    name: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int  # scratch the program allocates beyond its arguments and outputs
    alias_bytes: int  # output bytes that reuse a donated argument's buffer (updated in place)
    pallas_calls: int
    # Copies of a whole page buffer (a relayout around a kernel, say). XLA may place them in
    # another memory space, where temp_bytes does not count them: counted from the HLO.
    kv_copies: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def compile_stats(
    name: str, lowered: jax.stages.Lowered, page: jax.ShapeDtypeStruct | None = None
) -> StepStats:
    """Compile `lowered` and read its StepStats; `page`: one layer's page buffer (for kv_copies)."""
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    kv_copies = 0
    if page is not None:
        local = page.sharding.shard_shape(page.shape) if page.sharding is not None else page.shape
        ty = f"{_HLO_DTYPES.get(page.dtype.name, page.dtype.name)}[{','.join(map(str, local))}]"
        kv_copies = len(re.findall(rf"= \(?{re.escape(ty)}\{{[^}}]*\}}[^=]* copy(?:-start)?\(", text))
    return StepStats(
        name=name,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        pallas_calls=text.count(MOSAIC_TARGET),
        kv_copies=kv_copies,
    )


@dataclasses.dataclass(frozen=True)
class AbstractEngine:
    """What an Engine on `mesh` would hold, as ShapeDtypeStructs with their shardings."""

    mcfg: ModelConfig
    ecfg: EngineConfig
    mesh: jax.sharding.Mesh
    backend: Backend
    params: Params
    pages: tuple[jax.ShapeDtypeStruct, ...]

    @property
    def kv_cache_bytes_per_chip(self) -> int:
        return sum(p.size * p.dtype.itemsize for p in self.pages) // self.mesh.size

    def step_stats(self, b: int, c: int, p: int) -> list[StepStats]:
        """Compile every program the runner runs for bucket (B, C, P) (`runner.Buckets.shapes`)."""
        rep = NamedSharding(self.mesh, PartitionSpec())
        batch, sa = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
            runner.placeholder_inputs(b, c, p, self.backend),
        )
        lowered = runner.lower_step(self.params, self.pages, batch, sa, cfg=self.mcfg, backend=self.backend)
        return [compile_stats(name, low, self.pages[0]) for name, low in lowered]

    def decode_stats(self, batch_size: int | None = None) -> list[StepStats]:
        """The decode step at `batch_size` rows (default max_num_seqs) and the largest page bucket."""
        buckets = runner.Buckets.for_config(self.ecfg, self.backend)
        b = runner.pick(buckets.batch, batch_size or self.ecfg.max_num_seqs)
        return self.step_stats(b, 1, buckets.pages[-1])


def abstract_engine(
    mcfg: ModelConfig,
    ecfg: EngineConfig,
    devices: Sequence[Any],
    tensor_parallel_size: int = 1,
) -> AbstractEngine:
    """The engine on the first `tensor_parallel_size` of `devices` (e.g. a topology's), with
    the Backend `ecfg.attention` resolves to there and the KV dtype of the params."""
    mesh = sharding.make_mesh(tensor_parallel_size, devices)
    backend = Backend.choose(
        ecfg.attention, head_dim=mcfg.head_dim, mesh=mesh, head_axis=sharding.RULES["kv_heads"]
    )
    ecfg = dataclasses.replace(ecfg, attention=backend.attention)
    shardings = sharding.param_shardings(mcfg, mesh)
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract_params(mcfg), shardings
    )
    kv = sharding.kv_sharding(mcfg, mesh, folded=backend.folded_pages)
    shape = backend.page_shape(ecfg.num_pages, ecfg.page_size, mcfg.num_kv_heads, mcfg.head_dim)
    pages = tuple(
        jax.ShapeDtypeStruct(shape, jax.numpy.dtype(mcfg.dtype), sharding=kv) for _ in range(mcfg.num_layers)
    )
    return AbstractEngine(mcfg, ecfg, mesh, backend, params, pages)


def topology_devices(name: str) -> list[Any]:
    """The TPU devices of a topology such as "v5e:2x2", compiled for on this host (libtpu)."""
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
