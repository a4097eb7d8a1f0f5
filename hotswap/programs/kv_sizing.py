"""How many KV pages the engine allocates: the one place that decides.

- An explicit `num_pages` is used as given.
- On CPU, where device memory is host memory shared with everything else, the pool holds
  two `max_model_len` sequences or half of `max_num_seqs` of them, whichever is more.
- On an accelerator, as vLLM (and tpu-inference) size it, the cache takes what is left of
  the chip's memory:

      pages = (free × gpu_memory_utilization − weights − the compiled steps' temporaries)
              ÷ bytes of one page (all layers, this chip's kv heads)

  per chip, the tightest chip deciding. `weights` is the params plus what a hot update
  needs beside them (`weights/place.py` `update_reserve`): a second copy when updates are
  staged whole (`weight_update_staging="copy"`: a rejected update must leave the old ones
  serving, so the new ones are built beside them), the tensors one pass holds in flight when
  they are checked first and written in place (the default on TPU/GPU). A cache sized for
  the params alone would make the first update run out of memory. `free` is `device.memory_stats()`'s
  `bytes_limit − bytes_in_use` on a real device, or the chip's HBM size when compiling
  ahead of time for a TPU slice (`hotswap/programs/tpu_slice.py`). The temporaries are measured, not
  guessed: the largest decode and prefill steps are compiled for a first guess of the pool
  (the budget with no temporaries), and the largest temporary of those is subtracted. A
  step's temporaries grow with the pool if anything (a copy of it would be one), so the
  smaller pool that results needs no more than was measured.

A model with sliding-window layers gives those layers a pool of their own bounded by the
window (`window_pages`; `engine/window_pages.py`), sized from the scheduler's limits, not from
memory: the pages above are then one page of the full layers only, and on an accelerator
the window pool's bytes come off the budget first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from hotswap.engine_config import EngineConfig
from hotswap.errors import DeviceMemoryError
from hotswap.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Weights:
    """One chip's params and what a hot update needs beside them (`reserve`, by `staging`:
    `weights/place.py` `update_reserve`); `params` counts LoRA buffers where there are any."""

    params: int
    reserve: int
    staging: str

    @property
    def total(self) -> int:
        return self.params + self.reserve


def page_bytes(mcfg: ModelConfig, page_size: int, tp: int = 1, layers: int | None = None) -> int:
    """Bytes one page takes on one chip: `layers` layers' (default: every layer's) K and V of
    `page_size` tokens, this chip's `num_kv_heads / tp` heads (`sharding.KV_AXES`: the cache
    is split by kv head), or one head when tp exceeds num_kv_heads (each replicated over
    tp / num_kv_heads chips)."""
    heads = 2 * max(mcfg.num_kv_heads // tp, 1)
    layers = mcfg.num_layers if layers is None else layers
    return layers * page_size * heads * mcfg.head_dim * jnp.dtype(mcfg.kv_dtype).itemsize


def window_layers(mcfg: ModelConfig) -> int:
    """How many layers have a sliding window."""
    return sum(mcfg.layer_window(i) is not None for i in range(mcfg.num_layers))


def window_bound(
    mcfg: ModelConfig, page_size: int, max_num_seqs: int, max_num_batched_tokens: int, disable: bool = False
) -> int | None:
    """Pages (the null page included) the sliding-window layers can ever need at once; None when
    they have no pool of their own (no sliding layer, or `disable_hybrid_kv_cache_manager`).
    Every running sequence holds the pages its next query sees (`ceil(window / page_size) + 1`)
    and, during a step, those its chunk writes; a step's chunks write at most
    `max_num_batched_tokens` tokens. Bounded by the scheduler's limits, whatever the context."""
    if disable or window_layers(mcfg) == 0:
        return None
    per_seq = math.ceil(mcfg.sliding_window / page_size) + 2
    return max_num_seqs * per_seq + math.ceil(max_num_batched_tokens / page_size) + 1


def window_pages(mcfg: ModelConfig, ecfg: EngineConfig) -> int | None:
    """The sliding-window layers' own pool (`engine/window_pages.py`), in pages; None: those
    layers use the full layers' pages, as every layer did before the pool existed (see
    `window_bound`, or a bound no smaller than the full pool: a twin per page can never run
    out, so a larger pool would save nothing)."""
    bound = window_bound(
        mcfg,
        ecfg.page_size,
        ecfg.max_num_seqs,
        ecfg.max_num_batched_tokens,
        ecfg.disable_hybrid_kv_cache_manager,
    )
    return bound if bound is not None and bound < ecfg.num_pages else None


def pool_bytes(mcfg: ModelConfig, num_pages: int, window: int | None, page_size: int, tp: int = 1) -> int:
    """One chip's KV cache: `num_pages` pages of the full layers (of every layer when `window` is
    None) and `window` pages of the sliding-window layers."""
    if window is None:
        return num_pages * page_bytes(mcfg, page_size, tp)
    local = window_layers(mcfg)
    full = page_bytes(mcfg, page_size, tp, mcfg.num_layers - local)
    return num_pages * full + window * page_bytes(mcfg, page_size, tp, local)


def cpu_pages(max_model_len: int, page_size: int, max_num_seqs: int) -> int:
    """The CPU pool: two full sequences or half of max_num_seqs of them, plus the null page."""
    per_seq = math.ceil(max_model_len / page_size)
    return max(per_seq * 2, max_num_seqs * per_seq // 2) + 1


def free_bytes(devices: Sequence[jax.Device]) -> int | None:
    """The least free memory over `devices` from `memory_stats()`; None where a device has no
    stats (the CPU backend)."""
    free = []
    for d in devices:
        stats = d.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(free) if free else None


def pages_that_fit(
    free: int, utilization: float, weights: Weights, temps: int, one_page: int, reserved: int = 0
) -> int:
    """(free × utilization − weights − temps − reserved) ÷ one_page, all bytes per chip
    (`weights`: the params and an update's reserve, module doc; `reserved`: the sliding-window
    layers' pool). Raises DeviceMemoryError when not even the null page and one more fit."""
    budget = int(free * utilization) - weights.total - temps - reserved
    pages = budget // one_page if budget > 0 else 0
    if pages < 2:
        gib = 2**30
        in_place = (
            " or weight_update_staging 'in_place' (one copy of the params)"
            if weights.staging == "copy"
            else ""
        )
        raise DeviceMemoryError(
            f"no room for the KV cache: {free / gib:.2f} GiB free x gpu_memory_utilization {utilization} "
            f"- params {weights.params / gib:.2f} GiB - a hot update's {weights.reserve / gib:.2f} GiB beside "
            f"them (weight_update_staging {weights.staging!r}) - step temporaries {temps / gib:.2f} GiB "
            f"- the sliding-window layers' pages {reserved / gib:.2f} GiB leaves "
            f"{budget / gib:.2f} GiB, under 2 pages of {one_page / 2**20:.2f} MiB; use more chips "
            "(--tensor-parallel-size), a smaller max_num_seqs / max_num_batched_tokens, a higher "
            f"gpu_memory_utilization{in_place}"
        )
    return pages


def accelerator_pages(
    mcfg: ModelConfig,
    free: int,
    utilization: float,
    weights: Weights,
    temps_at: Callable[[int], int],
    *,
    page_size: int,
    tp: int,
    window: int | None,
) -> tuple[int, int]:
    """(pages, temps): the full layers' pool that fits once the sliding-window layers' pool
    (`window` pages, `window_bound`; None: none) and the steps' temporaries are subtracted.
    `temps_at(n)` compiles the largest steps for an n-page pool and returns their largest
    temporary (bytes per chip); it is asked once, at the pool that would fit without them.

    The window pool pays off only when the memory holds more pages than it: otherwise a twin
    per page is all the window layers could use (`window_pages`), and every layer takes the
    same pages, sized as before the window pool existed."""
    one_page = page_bytes(mcfg, page_size, tp)
    first = pages_that_fit(free, utilization, weights, 0, one_page)
    if window is not None and first > window:
        local = window_layers(mcfg)
        full = page_bytes(mcfg, page_size, tp, mcfg.num_layers - local)
        reserved = window * page_bytes(mcfg, page_size, tp, local)
        temps = int(temps_at(pages_that_fit(free, utilization, weights, 0, full, reserved)))
        pages = pages_that_fit(free, utilization, weights, temps, full, reserved)
        if pages > window:
            return pages, temps
        return pages_that_fit(free, utilization, weights, temps, one_page), temps
    temps = int(temps_at(first))
    return pages_that_fit(free, utilization, weights, temps, one_page), temps


def engine_pages(
    mcfg: ModelConfig,
    *,
    page_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    disable_hybrid_kv_cache_manager: bool,
    num_pages: int | None,
    gpu_memory_utilization: float,
    devices: Sequence[jax.Device],
    weights: Weights,
    temps_at: Callable[[int], int],
) -> int:
    """The engine's pool: `num_pages` when given; on CPU (or a device without memory stats)
    `cpu_pages`; on an accelerator what fits its free memory (`accelerator_pages`, over
    `devices`, the chips the cache is split across). `weights`: one chip's params and its
    update reserve (module doc)."""
    if num_pages is not None:
        return num_pages
    free = None if devices[0].platform == "cpu" else free_bytes(devices)
    if free is None:
        return cpu_pages(max_model_len, page_size, max_num_seqs)
    window = window_bound(
        mcfg, page_size, max_num_seqs, max_num_batched_tokens, disable_hybrid_kv_cache_manager
    )
    return accelerator_pages(
        mcfg,
        free,
        gpu_memory_utilization,
        weights,
        temps_at,
        page_size=page_size,
        tp=len(devices),
        window=window,
    )[0]
