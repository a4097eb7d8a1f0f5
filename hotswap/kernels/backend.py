"""Backend: which attention, KV write, matmuls and sampler statistics a step runs, and the page
layout they read, chosen once from the engine's devices, its mesh and the config.

`Backend.choose` is the only place that decides. It looks at the platform of the devices the
engine runs on (not `jax.default_backend()`: compiling ahead of time for TPU devices from
`jax.experimental.topologies` happens on a CPU host), at how many devices hold the cache, and at
the model's head_dim, and logs one line saying what it picked and why. The frozen value is the
jitted steps' static argument, so every step kind is compiled for one backend.

Each attention kind's implementations are one row of a table (`Kernels`): its attention and
the page layout it reads, the matmuls, norms and sampler statistics around it, what `score`
runs, and where an explicit choice of it can run. `choose` picks the row once (`KERNELS`, or
`FIXED` in deterministic mode) and every method of the Backend runs what that row names.

| row                    | where                               | reads                               |
|------------------------|-------------------------------------|-------------------------------------|
| `KERNELS["pallas"]`    | TPU ("auto"); interpreted elsewhere | writes the step's K/V, then reads   |
| `KERNELS["cpu"]`       | one CPU device, C++ built ("auto")  | cache before step + own K/V; writes |
| `FIXED["cpu"]`         | the same, with `deterministic=True` | as "cpu", in fixed-order blocks     |
| `KERNELS["reference"]` | everything else ("auto")            | cache before step + own K/V         |

The Pallas pages are lane-folded `[num_pages, ps, 2*Hkv*hd]` (`ragged_paged_attention`): on TPU
that is the layout its Mosaic call reads in place for head_dim 64 as for 128. The CPU paths keep
`[num_pages, ps, 2*Hkv, hd]` (the same bytes in the same order): the C++ kernel and the jnp
reference index heads on their own axis. Under tensor parallelism the Pallas attention and its
KV write run in `shard_map` over the kv-head mesh axis: Mosaic calls cannot be partitioned
automatically, and each chip owns whole (K, V) pairs of its heads, so no collective touches a
KV-sized array.

With more devices than kv heads (`kv_replicas` r = tp / num_kv_heads > 1, as vLLM and
tpu-inference do it) the cache holds each kv head r times, `r * num_kv_heads = tp` cached heads,
one per device: `page_shape` counts them, and `attend` / `write` repeat the step's K/V heads r
times first (`cache_heads`). Cached head c is kv head c // r, and device c's q heads
[c*Hq/tp, (c+1)*Hq/tp) all belong to kv head c // r (GQA groups of Hq/num_kv_heads), so every
device attends with its own head's pages and the result is the unreplicated attention's.

Deterministic mode (`deterministic=True`) keeps the C++ backend and selects its fixed-order
kernels, the row `FIXED["cpu"]`: every matmul on `cpu_matmul.fixed_matmuls` (a row's sums one
chain over K, whatever the row count), attention in 16-key blocks at fixed positions
(`cpu_attention`'s `fixed`), and `score` through the same kernels (`dense_matmuls`,
`causal_attention`, `token_logprobs`). A token's log-prob is then the same bits alone or in any
batch, chunk or prefix hit, and `score` returns them. It needs the C++ kernels (one CPU device,
f32): other paths refuse it. The finiteness check of new weights is not here: it runs on arrays
wherever they are, before any engine exists (checkpoint loads), and `finite.py` decides it per
array.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from hotswap.errors import ConfigError
from hotswap.kernels import (
    cpu_attention,
    cpu_build,
    cpu_experts,
    cpu_matmul,
    cpu_sampling,
    grouped_matmul,
    quant_matmul,
    reference,
    routed_experts,
)

log = logging.getLogger(__name__)

ATTENTIONS = ("pallas", "cpu", "reference")  # what "auto" resolves to
# The dtypes the C++ kernels take (activations, pages and weights): f32 and bf16, with f32
# softmax, products and accumulation either way. The decode-sized matmuls read bf16 weights as
# they are (`cpu_matmul`); prompt-sized ones run on XLA's dot. Logits are f32 in both (the
# sampler statistics take f32 only).
CPU_DTYPES = ("float32", "bfloat16")


def jnp_matmuls(x: jax.Array, ws, contract: int = 1, out_dtype=None) -> list[jax.Array]:
    """The matmul routine's interface (`Backend.matmuls`): each w contracted over x's last
    `contract` dims and w's first, `[..., K...] x [K..., N...] -> [..., N...]` (one dot_general,
    so the head-split attention weights are used in their own layout, no relayout), in
    `out_dtype` (None: the operands' promoted dtype; f32 for a 16-bit LM head's logits)."""
    return [jnp.tensordot(x, w, axes=contract, preferred_element_type=out_dtype) for w in ws]


def jnp_mean_square(x: jax.Array) -> jax.Array:
    """The norms' mean of squares (`Backend.mean_square`): x [..., D] f32 -> [..., 1]."""
    return jnp.mean(x * x, axis=-1, keepdims=True)


def _pallas_on_tpu_problem(head_dim: int) -> str | None:
    """Why the Mosaic kernel cannot read this model's pages in place (None: it can)."""
    if head_dim % 64:
        return (
            f"head_dim {head_dim} is not a multiple of 64: a head's (K, V) pair would not fill whole "
            "128-lane groups of the folded pages"
        )
    return None


# ---- each kind's implementations --------------------------------------------------------
# An `attend` takes the step's K/V as the cache holds them (`Backend.cache_heads`) and returns
# (output [B, C, Hq, hd], the layer's pages after the step).


def _reference_attend(backend: Backend, q, k, v, pages, batch, scale, window, softcap):
    """The jnp reference leaves the pages as they were (the engine writes k/v after the step,
    `Backend.write`): a decode batch ([B, 1] queries) or a packed prefill."""
    if q.shape[1] == 1:
        o = reference.decode_attention(
            q,
            pages,
            k,
            v,
            batch.page_ids,
            batch.page_rows,
            batch.page_cols,
            batch.chunk_starts,
            scale=scale,
            window=window,
            softcap=softcap,
        )
        return o, pages
    o = reference.prefill_attention(
        q,
        pages,
        k,
        v,
        batch.page_ids,
        batch.page_rows,
        batch.page_cols,
        batch.positions,
        batch.kv_lens,
        batch.chunk_starts,
        batch.segments,
        scale=scale,
        window=window,
        softcap=softcap,
    )
    return o, pages


def _cpu_attend(backend: Backend, q, k, v, pages, batch, scale, window, softcap, *, fixed: bool):
    """The C++ kernel reads, then writes k/v into its aliased page buffer; `fixed`: in 16-key
    blocks at fixed positions (deterministic mode)."""
    return cpu_attention.paged_attention(
        q,
        pages,
        k,
        v,
        batch.block_tables,
        batch.positions,
        batch.chunk_starts,
        batch.kv_lens,
        scale=scale,
        slots=batch.slots,
        fixed=fixed,
        window=window,
        softcap=softcap,
    )


def _pallas_attend(backend: Backend, q, k, v, pages, batch, scale, window, softcap):
    """Pallas writes the step's K/V first and reads the written pages; on a mesh, in shard_map
    over the kv-head axis (module doc)."""
    from hotswap.kernels import ragged_paged_attention

    def local(q, k, v, pages, block_tables, positions, kv_lens, slots):
        written = reference.write_kv(pages, k, v, slots)
        o = ragged_paged_attention.paged_attention(
            q,
            written,
            block_tables,
            positions,
            kv_lens,
            scale=scale,
            interpret=backend.interpret,
            window=window,
            softcap=softcap,
        )
        return o, written

    args = (q, k, v, pages, batch.block_tables, batch.positions, batch.kv_lens, batch.slots)
    if backend.mesh is None:
        return local(*args)
    heads = PartitionSpec(None, None, backend.head_axis, None)  # q, k, v, out: [B, C, H, hd]
    lanes = PartitionSpec(None, None, backend.head_axis)  # pages: each device its heads' lanes
    rep = PartitionSpec()
    return jax.shard_map(
        local,
        mesh=backend.mesh,
        in_specs=(heads, heads, heads, lanes, rep, rep, rep, rep),
        out_specs=(heads, lanes),
        check_vma=False,  # the Pallas call has no replication rule
    )(*args)


def _fixed_causal_attention(q, k, v, lengths, scale: float, *, window: int | None, softcap):
    """The step's fixed-order C++ kernel over [B, L] sequences, every key the chunk's own, so
    each query sums exactly what a step computes for it."""
    b, n, hkv, hd = k.shape
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    no_pages = jnp.zeros((1, 1, 2 * hkv, hd), q.dtype)  # nothing cached: never read
    zeros = jnp.zeros((b,), jnp.int32)
    return cpu_attention.paged_attention(
        q,
        no_pages,
        k,
        v,
        zeros[:, None],
        positions,
        zeros,
        lengths,
        scale=scale,
        fixed=True,
        window=window,
        softcap=softcap,
    )


def _log_softmax_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]


def _fixed_token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """What the sampler returns: logit - logsumexp by the C++ row kernel."""
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    _, lse = cpu_sampling.argmax_logsumexp(flat)
    chosen = jnp.take_along_axis(flat, tokens.reshape(-1, 1), axis=-1)[:, 0]
    return (chosen - lse).reshape(lead)


def _reference_runs(platform: str, n: int, head_dim: int, dtype: str, where: str) -> str:
    return "asked for: the jnp reference"


def _cpu_runs(platform: str, n: int, head_dim: int, dtype: str, where: str) -> str:
    if platform != "cpu" or n != 1:
        raise ConfigError(
            "attention='cpu' runs on the CPU backend with the KV cache on one device; "
            f"here the cache is on {where}: use 'auto'"
        )
    if dtype not in CPU_DTYPES:
        raise ConfigError(
            f"attention='cpu' takes dtype {' or '.join(CPU_DTYPES)}, not {dtype!r}: "
            "use attention='auto' (the jnp reference for this dtype) or another dtype"
        )
    if not cpu_build.available():
        raise ConfigError("attention='cpu' needs the C++ kernels, which did not build here: use 'auto'")
    return "asked for: the C++ kernels"


def _pallas_runs(platform: str, n: int, head_dim: int, dtype: str, where: str) -> str:
    if platform != "tpu":
        return f"asked for: the Pallas kernel, interpreted ({platform} has no Mosaic)"
    problem = _pallas_on_tpu_problem(head_dim)
    if problem is not None:
        raise ConfigError(f"attention='pallas' on TPU: {problem}; use 'auto' or 'reference'")
    return "asked for: the Pallas kernel"


@dataclasses.dataclass(frozen=True, eq=False)
class Kernels:
    """One kind's implementations: the step's attention and the page layout it reads, the
    matmuls, norms and sampler statistics around it, the cache-free forward's (`score`), and
    where an explicit choice of it runs. A row of `KERNELS` or `FIXED`; the defaults are the jnp
    ones. Compared by identity: each row is one module-level value."""

    name: str  # the `attention` option's value
    # (backend, q, k, v, pages, batch, scale, window, softcap) -> (out, pages): `Backend.attend`
    attend: Callable[..., tuple[jax.Array, jax.Array]]
    runs_here: Callable[[str, int, int, str, str], str]  # (platform, n, head_dim, dtype, where) -> why
    folded_pages: bool = False  # pages [num_pages, ps, 2*Hkv*hd], not [.., 2*Hkv, hd] (module doc)
    read_then_write: bool = False  # `Backend.read_then_write`
    reads_before_step: bool = False  # attention reads the cache before the step plus own K/V
    flat_pages: bool = False  # the cached pages as one flat list (`Batch.page_ids`)
    ragged_steps: bool = False  # a step is one [T, 1] block (`Backend.ragged_steps`)
    # What a step's page buckets (programs/step.py `Buckets`) cost it: `any_table_width`, the
    # kernel reads only the pages before each row's chunk whatever the block table's width;
    # `reads_table_width`, a decode reads all B*P pages of its table and a prefill only the keys
    # cached before each chunk (often none).
    any_table_width: bool = False
    reads_table_width: bool = False
    matmuls: Callable = jnp_matmuls
    routed_experts: Callable = functools.partial(routed_experts.sliced, mms=jnp_matmuls)
    dense_matmuls: Callable = jnp_matmuls
    causal_attention: Callable = reference.dense_causal_attention
    token_logprobs: Callable = _log_softmax_logprobs
    mean_square: Callable = jnp_mean_square
    row_stats: Callable = reference.argmax_logsumexp
    keep_thresholds: Callable = reference.keep_thresholds
    categorical: Callable = reference.categorical


# attention kind -> its kernels (the module doc's table)
KERNELS = {
    "pallas": Kernels("pallas", _pallas_attend, _pallas_runs, folded_pages=True),
    "cpu": Kernels(
        "cpu",
        functools.partial(_cpu_attend, fixed=False),
        _cpu_runs,
        reads_before_step=True,
        ragged_steps=True,
        any_table_width=True,
        matmuls=cpu_matmul.matmuls,  # the C++ matmul for decode-sized rows, else XLA's dot
        routed_experts=cpu_experts.routed_experts,  # reads the routed rows in place
        row_stats=cpu_sampling.argmax_logsumexp,
        keep_thresholds=cpu_sampling.keep_thresholds,
        categorical=cpu_sampling.categorical,
    ),
    "reference": Kernels(
        "reference",
        _reference_attend,
        _reference_runs,
        read_then_write=True,
        reads_before_step=True,
        flat_pages=True,
        reads_table_width=True,
    ),
}
# Deterministic mode: the kinds that have batch-invariant kernels (module doc), and those kernels.
FIXED = {
    "cpu": dataclasses.replace(
        KERNELS["cpu"],
        attend=functools.partial(_cpu_attend, fixed=True),
        matmuls=cpu_matmul.fixed_matmuls,
        routed_experts=functools.partial(routed_experts.sliced, mms=cpu_matmul.fixed_matmuls),
        dense_matmuls=cpu_matmul.fixed_matmuls,
        causal_attention=_fixed_causal_attention,
        token_logprobs=_fixed_token_logprobs,
        mean_square=cpu_sampling.row_mean_square,
    ),
}
ATTENTIONS = tuple(KERNELS)  # what "auto" resolves to
# The experts' grouped matmul by platform (`Backend.grouped_matmul`); XLA's `ragged_dot` elsewhere.
GROUPED_MATMULS = {"cpu": grouped_matmul.tiled, "tpu": grouped_matmul.megablox}


@dataclasses.dataclass(frozen=True)
class Backend:
    """The kernels a step runs (module doc): built by `choose`; equal for equal choices."""

    attention: str  # one of ATTENTIONS
    platform: str  # of the engine's devices: "tpu", "cpu", "gpu"
    mesh: Mesh | None = None  # the cache's mesh when it spans more than one device
    head_axis: str | None = None  # the mesh axis kv heads are split over (with mesh)
    deterministic: bool = False  # batch-invariant kernels (module doc)
    kv_replicas: int = 1  # devices holding each kv head's pages (module doc)
    reason: str = dataclasses.field(default="", compare=False)
    # the row of `attention` (of `FIXED` when deterministic): what every method below runs
    kernels: Kernels = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        table = FIXED if self.deterministic else KERNELS
        if self.attention not in table:
            raise ConfigError(
                f"attention={self.attention!r}"
                + (" has no batch-invariant kernels" if self.deterministic else "")
                + f"; use one of {', '.join(table)}"
            )
        object.__setattr__(self, "kernels", table[self.attention])  # derived: chosen with attention

    @staticmethod
    def choose(
        attention: str,
        *,
        head_dim: int,
        dtype: str = "float32",
        kv_dtype: str | None = None,
        devices: Sequence[Any] | None = None,
        mesh: Mesh | None = None,
        head_axis: str | None = None,
        deterministic: bool = False,
        kv_replicas: int = 1,
    ) -> Backend:
        """`attention` ("auto" or one of ATTENTIONS) for a model of `head_dim` and `dtype`, its KV
        pages in `kv_dtype` (None: `dtype`), on `devices` (default: the first of `jax.devices()`)
        or on `mesh` (its devices; kv heads split over `head_axis`; each kv head held by
        `kv_replicas` of them). An explicit choice that cannot run here raises ConfigError saying
        why, as does `deterministic` anywhere but on the C++ kernels in f32, and pages in a dtype
        the chosen kernel does not read (`_check_kv_dtype`)."""
        if mesh is not None:
            devices = list(mesh.devices.flat)
        devices = list(devices) if devices is not None else jax.devices()[:1]
        platform, n = devices[0].platform, len(devices)
        if mesh is not None and mesh.size > 1 and head_axis not in mesh.axis_names:
            raise ConfigError(
                f"the mesh has axes {mesh.axis_names}, none of them the kv-head axis {head_axis!r}"
            )
        where = f"{n} {platform} device{'s' if n > 1 else ''}"
        kv_dtype = kv_dtype or dtype
        if attention == "auto":
            attention, why = _auto(platform, n, head_dim, dtype, kv_dtype)
        elif attention in KERNELS:
            why = KERNELS[attention].runs_here(platform, n, head_dim, dtype, where)
        else:
            raise ConfigError(f"attention={attention!r}; use 'auto' or one of {', '.join(ATTENTIONS)}")
        _check_kv_dtype(attention, dtype, kv_dtype)
        if deterministic:
            _check_deterministic(attention, dtype, why)
            why += "; deterministic: the fixed-order kernels"
        backend = Backend(
            attention=attention,
            platform=platform,
            mesh=mesh if mesh is not None and mesh.size > 1 else None,
            head_axis=head_axis if mesh is not None and mesh.size > 1 else None,
            deterministic=deterministic,
            kv_replicas=kv_replicas,
            reason=why,
        )
        log.info("hotswap backend: attention=%s on %s: %s", attention, where, why)
        return backend

    # ---- what the steps read ------------------------------------------------

    @property
    def interpret(self) -> bool:
        """Pallas runs interpreted off TPU (its scalar prefetch lowers only through Mosaic)."""
        return self.platform != "tpu"

    @property
    def read_then_write(self) -> bool:
        """The step reads the cache untouched and its K/V are written by a second donated
        program (`write`): fusing XLA's scatter with the reads made XLA:CPU copy every layer."""
        return self.kernels.read_then_write

    @property
    def reads_before_step(self) -> bool:
        """Attention reads the cache as it was before the step plus the step's own K/V."""
        return self.kernels.reads_before_step

    @property
    def flat_pages(self) -> bool:
        """The cached pages come as one flat list (`Batch.page_ids`), not [B, P] block tables."""
        return self.kernels.flat_pages

    @property
    def ragged_steps(self) -> bool:
        """A step is one [T, 1] block: decode tokens and prefill chunks end to end, a row per
        token, in one call (the C++ kernel reads each row's keys on its own). Else a decode
        batch and a packed prefill ([Nb, PREFILL_ROW], what Pallas and the reference tile
        over) run as separate calls."""
        return self.kernels.ragged_steps

    @property
    def folded_pages(self) -> bool:
        """Pages are `[num_pages, ps, 2*Hkv*hd]` (see module doc), not `[.., 2*Hkv, hd]`."""
        return self.kernels.folded_pages

    def page_shape(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """A layer's page buffer for a model of `kv_heads`: `kv_replicas` copies of each (module doc)."""
        kv_heads *= self.kv_replicas
        if self.folded_pages:
            return (num_pages, page_size, 2 * kv_heads * head_dim)
        return (num_pages, page_size, 2 * kv_heads, head_dim)

    @property
    def matmuls(self):
        """`(x, [w, ...]) -> [x @ w, ...]`: on the C++ backend, hotswap's C++ matmul for
        decode-sized row counts, one call for the weights that share x (`cpu_matmul.matmuls`
        falls back to XLA's dot otherwise); in deterministic mode the fixed-order kernel for all.
        Quantized weights (QTensors) go to `quant_matmul`, the one place that decides their kernel."""
        return self._quantized(self.kernels.matmuls)

    def _quantized(self, dense):
        return quant_matmul.with_quantized(dense, self.platform, cpu_kernels=self.kernels.name == "cpu")

    @property
    def grouped_matmul(self):
        """The experts' grouped matmul (`kernels/grouped_matmul.py`): tiles on CPU, whose XLA
        expands `ragged_dot` into every group's work; the Pallas megablox kernel on TPU (inside
        the experts' shard_map on a mesh); XLA's `ragged_dot` elsewhere."""
        return GROUPED_MATMULS.get(self.platform, grouped_matmul.ragged)

    @property
    def routed_experts(self):
        """The experts of a MoE layer for few token-expert pairs (a decode step;
        `kernels/routed_experts.py`): on the C++ backend the kernel that reads the routed
        experts' rows in place from the stacked weights (`cpu_experts`); elsewhere, and in
        deterministic mode (its fixed-order matmul), each pair's slices through `matmuls`."""
        return self.kernels.routed_experts

    # ---- scoring (`forward.forward_dense`) -----------------------------------

    @property
    def dense_matmuls(self):
        """The cache-free forward's matmuls: XLA's dot, or in deterministic mode the step's
        (quantized weights as in `matmuls`)."""
        return self._quantized(self.kernels.dense_matmuls)

    def causal_attention(self, q, k, v, lengths, scale: float, *, window: int | None = None, softcap=None):
        """Causal self-attention of [B, L] sequences of `lengths` (q [B, L, Hq, hd], k/v [B, L,
        Hkv, hd]) for the cache-free forward; `window` / `softcap` static, as in `reference`. In
        deterministic mode the step's kernel, every key the chunk's own, so each query sums
        exactly what a step computes for it."""
        return self.kernels.causal_attention(q, k, v, lengths, scale=scale, window=window, softcap=softcap)

    def token_logprobs(self, logits: jax.Array, tokens: jax.Array) -> jax.Array:
        """log p(tokens) under logits [..., V] (tokens [...]): log_softmax, or in deterministic mode
        what the sampler returns, logit - logsumexp by `row_stats`."""
        return self.kernels.token_logprobs(logits, tokens)

    @property
    def mean_square(self):
        """The RMS norms' mean of squares: XLA's reduction, or in deterministic mode the C++ row
        kernel, one order per row (XLA's orders a row's sum by the row count: for D = 64 a
        [1, D] row and the same row among 8 differ)."""
        return self.kernels.mean_square

    @property
    def row_stats(self):
        """Each logits row's (argmax, logsumexp), what the sampler needs of every row."""
        return self.kernels.row_stats

    @property
    def keep_thresholds(self):
        """Each filtering row's least kept logit (top-k / top-p / min-p), for the sampler."""
        return self.kernels.keep_thresholds

    @property
    def categorical(self):
        """Each sampling row's draw from its scaled logits and one uniform (the inverse CDF)."""
        return self.kernels.categorical

    # ---- the step's attention -----------------------------------------------

    def cache_heads(self, x: jax.Array) -> jax.Array:
        """The step's K or V [..., Hkv, hd] as the cache holds them: each head `kv_replicas` times."""
        return x if self.kv_replicas == 1 else jnp.repeat(x, self.kv_replicas, axis=-2)

    def write(self, pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
        """A layer's K/V into its pages, for `read_then_write` (run as its own donated program)."""
        return reference.write_kv(pages, self.cache_heads(k), self.cache_heads(v), slots)

    def attend(self, q, k, v, pages, batch, scale: float, *, window: int | None = None, softcap=None):
        """One layer's attention for the step: (output [B, C, Hq, hd], the layer's pages after
        the step). `batch` is the step's `Batch`; `window` / `softcap` are the layer's static
        sliding window and logit softcap (`reference` module doc; None: none). The kind's
        `attend` says which pages it reads and when it writes the step's K/V."""
        k, v = self.cache_heads(k), self.cache_heads(v)
        return self.kernels.attend(self, q, k, v, pages, batch, scale, window, softcap)


def _auto(platform: str, n: int, head_dim: int, dtype: str, kv_dtype: str) -> tuple[str, str]:
    """What "auto" means here, and why."""
    if platform == "tpu":
        problem = _pallas_on_tpu_problem(head_dim)
        if problem is None:
            return "pallas", "TPU: the Pallas kernel"
        return "reference", f"TPU, but {problem}: the jnp reference"
    if platform == "cpu" and n == 1 and (dtype not in CPU_DTYPES or kv_dtype not in CPU_DTYPES):
        taken = dtype if dtype not in CPU_DTYPES else f"{kv_dtype} pages"
        return "reference", f"one CPU device, but the C++ kernels do not take {taken}: the jnp reference"
    if platform == "cpu" and n == 1:
        if cpu_build.available():
            return "cpu", "one CPU device: the C++ kernels"
        return "reference", "one CPU device, but the C++ kernels did not build: the jnp reference"
    if platform == "cpu":
        # An opaque custom call would make GSPMD gather a head-sharded cache around it.
        return "reference", f"the cache spans {n} CPU devices (the C++ kernels run on one): the jnp reference"
    return "reference", f"{platform}: the jnp reference (the Pallas kernel is TPU-only)"


def _check_kv_dtype(attention: str, dtype: str, kv_dtype: str) -> None:
    """KV pages in a dtype of their own (`kv_cache_dtype`): the C++ kernels and the jnp reference
    read f32 or bf16 pages under either activation dtype (the reference any float); the Pallas
    kernel reads pages in the queries' dtype."""
    if kv_dtype == dtype:
        return
    if attention == "pallas":
        raise ConfigError(
            f"kv_cache_dtype={kv_dtype!r} under dtype {dtype!r}: the Pallas kernel reads its pages in the "
            "queries' dtype; use kv_cache_dtype='auto', or attention='reference'"
        )
    if attention == "cpu" and kv_dtype not in CPU_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype={kv_dtype!r}: the C++ CPU kernels read {' or '.join(CPU_DTYPES)} pages; use one "
            "of those, or attention='reference'"
        )


def _check_deterministic(attention: str, dtype: str, why: str) -> None:
    """Deterministic mode runs on the C++ kernels' fixed-order paths (`FIXED`), f32 only."""
    if attention not in FIXED:
        raise ConfigError(
            f"deterministic mode needs the C++ CPU kernels (one CPU device), but attention is "
            f"{attention!r} ({why}); the jnp, Pallas and tensor-parallel paths have no "
            "batch-invariant kernels yet"
        )
    if dtype != "float32":
        raise ConfigError(
            f"deterministic mode takes dtype float32 (its fixed-order matmul is f32), not {dtype!r}"
        )
