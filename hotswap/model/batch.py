"""What one jitted step computes: a [B, C] block of tokens and where each one's K/V lives.

Two layouts share this shape:
- decode: B sequences, C == 1, one new token each;
- packed prefill: the chunks of several sequences laid end to end, each padded to a
  multiple of C and cut into rows of C tokens, so every row belongs to one sequence.
  The matmuls see B*C tokens with little padding (a chunk wastes < C slots), instead
  of one call per sequence padded to a power of two.

Kernels read pages through [B, P] block tables. The reference attention instead lists
the cached pages it reads flat (page_ids / page_rows / page_cols), each sequence's once:
a short decode row does not pay for the longest, and a prefill chunk's rows share one
read of their prefix.

Sliding-window layers read and write their own pages when they have a pool of their own
(`engine/window_pages.py`): `window_block_tables`, `window_slots` and `window_page_ids` are the
same tables, slots and page list in that pool (equal to the others when there is none), and
`windowed()` is the batch those layers see.

All arrays are host-built (runner.py), int32 but for the bool `prompt_top`, and padded to
bucket shapes, so the step compiles once per bucket. Padding tokens sit at positions >= their row's kv_len, write
to slot 0 (the null page) and are never sampled.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: jax.Array  # [B, C] token ids
    positions: jax.Array  # [B, C] absolute positions
    slots: jax.Array  # [B, C] flat KV slot (page * page_size + offset) each token writes
    block_tables: jax.Array  # [B, P] the row's sequence's pages (P covers what attention reads)
    # The reference attention reads cached pages from a flat list instead of block_tables (P == 0):
    page_ids: jax.Array  # [N] every cached page the call reads, each sequence's once, end to end
    page_rows: jax.Array  # [N] the segment (sequence of this call) reading it (B: padding)
    page_cols: jax.Array  # [N] its index in that sequence's table (key positions col*ps ...)
    kv_lens: jax.Array  # [B] the row's sequence length after this step (0: padding row)
    chunk_starts: jax.Array  # [B] first position of the sequence's chunk in this step
    segments: jax.Array  # [B] which sequence of this call the row belongs to (-1: padding)
    sample_idx: jax.Array  # [S] flat index (b * C + c) of the token each sequence samples from
    adapters: jax.Array  # [B] the row's LoRA adapter slot (-1: the base model; model/lora.py)
    window_block_tables: jax.Array  # [B, P] block_tables in the window pool (0: a page behind the window)
    window_slots: jax.Array  # [B, C] slots in the window pool
    window_page_ids: jax.Array  # [N] page_ids in the window pool
    # Prompt log-probs (programs/prompt_logprobs.py): at a prompt position of a row that asks,
    # the next prompt token, whose log-prob the step returns (-1: not asked); and whether the
    # row wants the top-k alternatives there too.
    prompt_targets: jax.Array  # [B, C]
    prompt_top: jax.Array  # [B, C] bool

    def windowed(self) -> Batch:
        """What a sliding-window layer reads and writes: the window pool's tables, slots and pages."""
        return dataclasses.replace(
            self,
            block_tables=self.window_block_tables,
            slots=self.window_slots,
            page_ids=self.window_page_ids,
        )

    @staticmethod
    def zeros(b: int, c: int, p: int, s: int, n: int = 0) -> Batch:
        """All-padding inputs of bucket shape: what warm-up compiles against (writes nothing real)."""
        z = np.zeros
        return Batch(
            tokens=z((b, c), np.int32),
            positions=z((b, c), np.int32),
            slots=z((b, c), np.int32),
            block_tables=z((b, p), np.int32),
            page_ids=z(n, np.int32),
            page_rows=np.full(n, b, np.int32),
            page_cols=z(n, np.int32),
            kv_lens=z(b, np.int32),
            chunk_starts=z(b, np.int32),
            segments=np.full(b, -1, np.int32),
            sample_idx=z(s, np.int32),
            adapters=np.full(b, -1, np.int32),
            window_block_tables=z((b, p), np.int32),
            window_slots=z((b, c), np.int32),
            window_page_ids=z(n, np.int32),
            prompt_targets=np.full((b, c), -1, np.int32),
            prompt_top=z((b, c), bool),
        )
