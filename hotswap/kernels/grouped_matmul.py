"""Grouped matmuls for the experts of a MoE layer (`model/moe.py`): rows sorted by group (their
expert), each group's rows times its own matrix. `Backend.grouped_matmul` picks one.

All take x [N, K] (rows sorted by group), w [G, K, M] and group_sizes [G] int32 (summing to at
most N) and return [N, M], row n times w[its group] (rows past the groups' total: 0):
- `ragged`: XLA's `jax.lax.ragged_dot` (GPU; the differentiable twin a trainer's forward uses).
- `megablox`: the Pallas TPU grouped matmul (`jax.experimental.pallas.ops.tpu.megablox.gmm`),
  tiles of 128 rows visiting only the groups that hold rows.
- `tiled`: each group's rows padded to whole tiles of `TILE` rows, then a loop over the tiles
  that hold rows, one [TILE, K] x [K, M] dot each against the tile's group's matrix. XLA:CPU
  expands `ragged_dot` into work over every group for every row (slower than computing all
  experts densely: docs/en/moe.md), so on CPU the tiles are the grouped matmul: a group's
  matrix is read once per tile of its rows, groups without rows not at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TILE = 32  # rows per tile: a group wastes < TILE padded rows


def ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w, group_sizes)


MEGABLOX_TILE = 128  # megablox's row, contraction and output tiles (TPU's 128 lanes)


def megablox(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    n, k = x.shape
    m = w.shape[-1]
    rows = -(-max(n, 1) // MEGABLOX_TILE) * MEGABLOX_TILE  # gmm takes whole row tiles
    padded = jnp.pad(x, ((0, rows - n), (0, 0)))
    tiling = (MEGABLOX_TILE, min(MEGABLOX_TILE, k), min(MEGABLOX_TILE, m))
    y = gmm(padded, w, group_sizes, preferred_element_type=x.dtype, tiling=tiling)[:n]
    # Rows past the groups' total are not written by the kernel: ragged_dot's zeros instead.
    return jnp.where((jnp.arange(n) < jnp.sum(group_sizes))[:, None], y, jnp.zeros_like(y))


def tiled(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int = TILE) -> jax.Array:
    n, k = x.shape
    g, m = w.shape[0], w.shape[-1]
    tiles_of = (group_sizes + tile - 1) // tile  # [G] tiles per group
    tile_end = jnp.cumsum(tiles_of)  # [G] first tile after each group's
    row_end = jnp.cumsum(group_sizes)  # [G]
    # At most ceil(N / TILE) + min(G, N) tiles hold rows: each nonempty group wastes < 1 tile.
    num_tiles = -(-n // tile) + min(g, n)
    row = jnp.arange(n, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(row_end, row, side="right"), g - 1)  # [N] each row's group
    # Row -> its padded row; rows past the groups' total (ragged_dot's zeros) -> the spare last row.
    dest = (tile_end - tiles_of)[group] * tile + row - (row_end - group_sizes)[group]
    dest = jnp.where(row < row_end[-1], dest, num_tiles * tile)
    padded = jnp.zeros((num_tiles * tile + 1, k), x.dtype).at[dest].set(x)

    def one_tile(t, out):
        e = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), g - 1)  # the tile's group
        rows = jax.lax.dynamic_slice_in_dim(padded, t * tile, tile)  # [TILE, K]
        y = jnp.dot(
            rows, jax.lax.dynamic_index_in_dim(w, e, keepdims=False), preferred_element_type=jnp.float32
        )
        return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), t * tile, 0)

    out = jnp.zeros((num_tiles * tile + 1, m), x.dtype)  # the spare row stays 0
    out = jax.lax.fori_loop(0, tile_end[-1], one_tile, out)  # only the tiles that hold rows
    return out[dest]
