"""The finiteness pass of a weight update: which values are read for NaN/Inf, once, and the error.

Every source is checked here, in the one pass of its placing step (`hf_device.py` for
HF-named tensors, `place.py` for params trees): the engine's first load is staged the
same way, so it is checked once too. `kernels/finite.py` computes the answer (a C++
call on one CPU device, a reduction in HBM elsewhere); this module decides what it reads:

- a tensor the C++ conversion kernel copied: its flag, computed while the values were in
  registers (`add_flag`);
- a tensor converted on the device: its source on the host, when that holds the very
  values (numpy already in the engine's dtype, on CPU: reading it first pulls it into
  cache for the transpose that follows, and leaves no device scalar to fetch); else the
  converted values, since a cast can overflow (`before` / `add`);
- a params tree: its leaves as they are (`add`).

A trainer that already guards its loss may pass check_finite=False (`enabled`): nothing
else is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hotswap.errors import NonFiniteWeights
from hotswap.kernels import finite
from hotswap.kernels.qtensor import is_qtensor


class Check:
    """One update's finiteness check: tensors are added as they are converted (device work
    dispatched, not waited for); `raise_first` then reports the first bad one by name."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._check = finite.FiniteCheck()

    def add(self, named: Mapping[str, Any]) -> None:
        if self.enabled:
            self._check.add(named)

    def add_flag(self, name: str, flag: Any) -> None:
        if self.enabled:
            self._check.add_flag(name, flag)

    def before(self, name: str, source: Any, dtype: np.dtype, on_cpu: bool) -> bool:
        """Check `source` now, before its conversion to `dtype`, if it holds the values the
        conversion will write (see the module docstring)? True when it did."""
        if not (self.enabled and on_cpu and isinstance(source, np.ndarray) and source.dtype == dtype):
            return False
        self._check.add({name: source})
        return True

    def raise_first(
        self,
        order: list[str],
        sources: Mapping[str, Any] | None = None,
        dtypes: Mapping[str, np.dtype] | None = None,
    ) -> None:
        """NonFiniteWeights naming the first bad tensor of `order`, if any. With `sources`
        (what was converted into `dtypes`) the error says when the cast made it so."""
        if not self.enabled:
            return
        flagged = set(self._check.non_finite())
        bad = [n for n in order if n in flagged]
        if not bad:
            return
        name, more = bad[0], len(bad) - 1
        why = ""
        source = None if sources is None else sources[name]
        if is_qtensor(source):  # GGUF blocks: their scales decode to NaN/Inf, nothing was cast
            why = f" ({source.fmt} blocks: a scale or value decodes to NaN/Inf)"
        elif source is not None and not finite.non_finite({name: source}):  # failure path only
            why = f" after conversion to {np.dtype(dtypes[name])} (overflow)"
        also = f" (and {more} more)" if more else ""
        raise NonFiniteWeights(f"{name}: contains NaN or Inf{why}{also}")
