"""The instruction-set paths of the quantized CPU kernels (`cpu/isa.h`), by name, for the FFI
attribute `isa`: the engine passes "auto" (the best path this CPU has, picked in C++); tests pass
every path in `runnable()` and check each against the same oracle."""

from __future__ import annotations

import numpy as np

from hotswap.kernels.cpu_target import host

# Name -> the `Isa` enum value of cpu/isa.h (fixed numbers: a new path takes the next), best first;
# and the cpuinfo flags each needs (isa.h's `Needs`, which tests/kernels/test_cpu_int8.py checks
# this against).
PATHS: dict[str, int] = {
    "avx512_vnni": 0,
    "avx512_bf16": 1,
    "avx512": 2,
    "avx_vnni": 5,
    "avx2": 3,
    "scalar": 4,
    "auto": -1,
}
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
NEEDS: dict[str, tuple[str, ...]] = {
    "avx512_vnni": (*_AVX512, "avx512_vnni"),
    "avx512_bf16": (*_AVX512, "avx512_bf16"),
    "avx512": _AVX512,
    "avx_vnni": ("avx2", "fma", "avx_vnni"),
    "avx2": ("avx2", "fma"),
    "scalar": (),
}
# The cpuinfo flags isa.h's table reads, in the order of its `Feature` bits (bit i is FEATURES[i]).
FEATURES = ("avx2", "fma", *_AVX512, "avx512_vnni", "avx512_bf16", "avx_vnni")


def features(flags) -> int:
    """isa.h's `Feature` bits of a CPU with the cpuinfo `flags` (others are ignored)."""
    return sum(1 << bit for bit, name in enumerate(FEATURES) if name in set(flags))


def runnable() -> list[str]:
    """The paths this CPU can run, best first."""
    flags = set(host().isa)
    return [name for name, needs in NEEDS.items() if set(needs) <= flags]


def attribute(path: str) -> np.int32:
    """The FFI attribute value for `path` (a name of PATHS)."""
    if path not in PATHS:
        raise ValueError(f"unknown CPU path {path!r}; known: {', '.join(PATHS)}")
    return np.int32(PATHS[path])
