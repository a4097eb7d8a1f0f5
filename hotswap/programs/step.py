"""The step program: one jitted function for every step kind, and the shapes it is compiled for.

One jitted function serves every step kind: a [B, C] block of tokens (`model/batch.py`).
On a ragged backend (the C++ kernels, `Backend.ragged_steps`) a step is one [T, 1]
block holding every decode token and prefill chunk end to end. Otherwise a decode
batch is [B, 1] and a packed prefill is [Nb, PREFILL_ROW] holding every prefill
chunk of the step, run as two calls. B (or T), Nb and P (block-table columns for a kernel;
for the reference attention, the flat list's pages: B*P in a decode batch, P in a
prefill, see `flat_pages`) are padded to the buckets listed here, all compiled at start-up, so
steady-state serving never recompiles. KV page buffers are donated
so XLA updates them in place; params are an argument, so a swap to params of
the same shapes, dtypes and shardings reuses every executable.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from hotswap.engine_config import EngineConfig
from hotswap.kernels.backend import Backend
from hotswap.model import forward
from hotswap.model.batch import Batch
from hotswap.programs.prompt_logprobs import nothing_asked, prompt_logprobs
from hotswap.programs.sampler import Sampled, SamplingArrays, sample
from hotswap.speculative import verified_per_step

PREFILL_ROW = 16  # C of a packed prefill (Pallas, reference): a chunk wastes < 16 padded slots


def _pow2_upto(lo: int, hi: int, *, halves: bool = False) -> list[int]:
    """lo, 2lo, 4lo, ... < hi, then hi; a last step within 1.5x below hi is dropped (hi covers it).
    With halves, 1.5x steps between the powers of two too (lo, 1.5lo, 2lo, 3lo, ...; 1.25x drop)."""
    out, v = [], lo
    while v < hi:
        out.append(v)
        if halves and v >= 2 and v * 3 // 2 < hi:
            out.append(v * 3 // 2)
        v *= 2
    out = sorted(set(out))
    if out and hi < (1.25 if halves else 1.5) * out[-1]:
        out.pop()
    return out + [hi]


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Every shape the step is compiled for."""

    batch: tuple[int, ...]  # decode rows B; for a ragged backend, the tokens T of any step
    blocks: tuple[int, ...]  # packed prefill rows (of PREFILL_ROW tokens each); () when ragged
    pages: tuple[int, ...]  # block-table columns P of a decode batch
    prefill_pages: tuple[int, ...]  # P of a packed prefill (0: nothing cached before any chunk)
    max_samples: int  # rows sampled in one call at most: each running sequence once
    ragged: bool  # steps are [T, 1] blocks (`Backend.ragged_steps`): `batch` holds every T
    # Speculative decoding: the draft tokens a step verifies at most, each one more sampled row
    # (`speculative.verified_per_step`); 0 without speculation.
    drafts: int = 0

    @staticmethod
    def for_config(ecfg: EngineConfig, backend: Backend) -> Buckets:
        pps = ecfg.pages_per_seq
        pages = tuple(_pow2_upto(min(8, pps), pps))
        prefill_pages = pages
        batch = _pow2_upto(1, ecfg.max_num_seqs)
        blocks = _pow2_upto(1, -(-ecfg.max_num_batched_tokens // PREFILL_ROW))
        if backend.kernels.any_table_width:
            # The C++ kernel reads only the pages before each chunk, whatever P the table has:
            # one full-width table, so warm-up compiles one shape per batch bucket, not per P.
            pages = prefill_pages = (pps,)
        elif backend.kernels.reads_table_width:
            # The reference decode reads B*P pages, P the rows' average: finer steps there cut
            # the pages read at long contexts by up to a third (its cost is those reads).
            pages = tuple(_pow2_upto(min(8, pps), pps, halves=True))
            # The reference prefill reads only keys cached before each chunk, often none.
            prefill_pages = (0, *prefill_pages)
        if backend.ragged_steps:
            # Past the decode sizes, steps of 1.5x apart: a padded token costs a real one's
            # matmuls, and the scheduler trims a step down to a bucket (`fill`) only when that
            # defers fewer tokens than padding would waste.
            top = max(ecfg.max_num_batched_tokens, ecfg.max_num_seqs)
            batch = sorted({*batch, *_pow2_upto(batch[-1], top, halves=True)})
            blocks = []
        return Buckets(
            batch=tuple(batch),
            blocks=tuple(blocks),
            pages=pages,
            prefill_pages=prefill_pages,
            max_samples=ecfg.max_num_seqs,
            ragged=backend.ragged_steps,
            drafts=verified_per_step(ecfg.speculative_config, ecfg.max_num_seqs),
        )

    def shapes(self) -> list[tuple[int, int, int]]:
        """(B, C, P) for every compiled step: decode batches (or ragged steps), then packed prefills."""
        return [(b, 1, p) for b in self.batch for p in self.pages] + [
            (nb, PREFILL_ROW, p) for nb in self.blocks for p in self.prefill_pages
        ]

    def largest(self) -> list[tuple[int, int, int]]:
        """The largest decode (or ragged) step and the largest packed prefill: the steps with
        the most temporaries."""
        big = [(self.batch[-1], 1, self.pages[-1])]
        return big + ([(self.blocks[-1], PREFILL_ROW, self.prefill_pages[-1])] if self.blocks else [])

    def samples(self, b: int, c: int) -> int:
        """S, the rows a (B, C) step samples: one per sequence in it, and one per draft token it
        verifies. A packed prefill has at most one sequence per row; a [T, 1] step at most every
        running sequence (and never more rows than tokens)."""
        if c != 1:
            return b + min(self.drafts, b * (c - 1))
        return min(b, self.max_samples + self.drafts)

    def fill(self, n: int) -> int:
        """Tokens a ragged step should run when `n` are ready: n, or the bucket below n when
        deferring the tokens past it (to the next step) is cheaper than padding up to the bucket
        above. Non-ragged steps pad (n): their prefill rows are few and coarse."""
        if not self.ragged or n <= self.batch[0] or n > self.batch[-1]:
            return n
        hi = pick(self.batch, n)
        lo = max(b for b in self.batch if b <= n)
        return lo if hi - n > n - lo else n


def pick(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _step(params, pages, batch: Batch, sa, *, cfg, backend: Backend):
    h, new_kv, pages, routed = forward.forward_paged(params, pages, batch, cfg=cfg, backend=backend)
    flat = h.reshape(-1, h.shape[-1])  # [B*C, D]
    h_last = flat[batch.sample_idx]  # [S, D]
    with jax.named_scope("sample"):
        logits = forward.logits_from_hidden(params, h_last, backend.matmuls, cfg.final_logit_softcapping)
        sampled = sample(
            logits,
            sa,
            backend.row_stats,
            keep_thresholds=backend.keep_thresholds,
            categorical=backend.categorical,
        )
    out = (_leaves(sampled),)
    if routed is not None:  # a MoE model: the experts of every token, [B*C, moe layers, k] int16
        out = (*out, routed.reshape(-1, *routed.shape[2:]).astype(jnp.int16))
    with jax.named_scope("prompt_logprobs"):  # nothing unless some row asks (programs/prompt_logprobs.py)
        prompt = _prompt_logprobs(flat, batch, params, cfg=cfg, backend=backend)
    return (new_kv if backend.read_then_write else pages), out, prompt


def _prompt_logprobs(flat, batch: Batch, params, *, cfg, backend: Backend):
    """The prompt log-probs of the step's asking positions. A decode step of a backend that is
    not ragged carries no prompt position (its prompts run in packed prefill rows), so its
    program leaves the path out: on TPU the lm head inside the path's `cond` costs a copy of the
    head's shard in temporaries (337 MiB a chip for Gemma 3 27B on v5e x8), which every decode
    step would otherwise hold."""
    if batch.prompt_targets.shape[-1] == 1 and not backend.ragged_steps:
        return nothing_asked(flat.shape[0])
    return prompt_logprobs(
        flat,
        batch.prompt_targets.reshape(-1),
        batch.prompt_top.reshape(-1),
        partial(forward.logits_from_hidden, params, mms=backend.matmuls, softcap=cfg.final_logit_softcapping),
        backend.row_stats,
        cfg.vocab_size,
    )


# read_then_write (the reference): read-only forward, then a separate in-place write of the K/V.
forward_jit = partial(jax.jit, static_argnames=("cfg", "backend"))(_step)
write_jit = partial(jax.jit, static_argnames=("cfg", "backend"), donate_argnums=(0,))(forward.write_pages)
# kernels (C++ and Pallas): write and read inside one program, pages donated.
fused_jit = partial(jax.jit, static_argnames=("cfg", "backend"), donate_argnums=(1,))(_step)


# The program's outputs are tuples only: the step cache (programs/step_cache.py) rebuilds a
# loaded program's output tree from nested tuples, so `Sampled` leaves the program as the
# tuple of its fields and `run_step` puts it back together.
def _leaves(sampled: Sampled) -> tuple:
    return tuple(getattr(sampled, f.name) for f in dataclasses.fields(Sampled))


def _with_sampled(pages, out, prompt):
    return pages, (Sampled(*out[0]), *out[1:]), prompt


def run_step(params, pages, batch: Batch, sa, *, cfg, backend: Backend, compiled=None):
    """One step on device: returns (new pages, (Sampled[, routed]), prompt),
    routed for a MoE model: the experts each of the step's B*C tokens went to; prompt: the
    prompt log-probs of the positions that asked (`prompt_logprobs.prompt_logprobs`).
    `compiled`: warm-up's program for this bucket, when it holds one (see `Runner.warmup`)."""
    if compiled is not None:
        return _with_sampled(*compiled(params, pages, batch, sa))
    if backend.read_then_write:
        new_kv, out, prompt = forward_jit(params, pages, batch, sa, cfg=cfg, backend=backend)
        return _with_sampled(write_jit(pages, new_kv, batch, cfg=cfg, backend=backend), out, prompt)
    return _with_sampled(*fused_jit(params, pages, batch, sa, cfg=cfg, backend=backend))


def lower_step(
    params, pages, batch: Batch, sa, *, cfg, backend: Backend
) -> list[tuple[str, jax.stages.Lowered]]:
    """Every program `run_step` runs for these shapes (concrete or abstract arguments), lowered:
    ("step", ...) and, for a read_then_write backend, ("write", ...) too."""
    if not backend.read_then_write:
        return [("step", fused_jit.lower(params, pages, batch, sa, cfg=cfg, backend=backend))]
    forward = forward_jit.lower(params, pages, batch, sa, cfg=cfg, backend=backend)
    new_kv = forward.out_info[0]
    return [("step", forward), ("write", write_jit.lower(pages, new_kv, batch, cfg=cfg, backend=backend))]


def compile_step(params, pages, batch: Batch, sa, *, cfg, backend: Backend) -> jax.stages.Compiled | None:
    """Compile (or load from the persistent cache) every program `run_step` runs for these
    shapes, without running them: a later `run_step` on the same shapes dispatches straight
    to them. Running warm-up steps instead would cost a full padded step per bucket.
    Returns the step's `Compiled` when it is one program (None for read_then_write's two)."""
    compiled = [
        lowered.compile() for _, lowered in lower_step(params, pages, batch, sa, cfg=cfg, backend=backend)
    ]
    return None if backend.read_then_write else compiled[0]


def flat_pages(backend: Backend, c: int, b: int, p: int) -> int | None:
    """The reference attention lists the cached pages it reads flat instead of a [B, P] table:
    B*P of them for a decode batch (P the rows' average), P for a packed prefill (all its
    sequences together). None: a kernel reads [B, P] tables."""
    if not backend.flat_pages:
        return None
    return b * p if c == 1 else p


def placeholder_inputs(
    b: int, c: int, p: int, backend: Backend, s: int | None = None, *, vocab_size: int
) -> tuple[Batch, SamplingArrays]:
    """All-padding step inputs of bucket shape (B, C, P) sampling S rows (`Buckets.samples`;
    default B) from a vocabulary of `vocab_size`: what warm-up compiles against."""
    s = b if s is None else s
    n = flat_pages(backend, c, b, p)
    sa = SamplingArrays.from_rows([], s, vocab_size)
    if n is not None:
        return Batch.zeros(b, c, 0, s, n=n), sa
    return Batch.zeros(b, c, p, s), sa
