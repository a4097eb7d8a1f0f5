"""Which CPU this process runs on, and which instructions code compiled here may use.

Two caches hold machine code built on this host: the C++ kernels (`kernels/cpu_build.py`,
built with `-march=native`) and the compiled steps (`programs/compile_cache.py`'s JAX cache and
`programs/step_cache.py`; XLA:CPU compiles for the host's CPU and its features). A cache
directory can travel (a shared home, a copied `~/.cache/hotswap`, a container image): code
built on an AVX-512 box runs illegal instructions on an AVX2 box, and code built on an AVX2
box runs the slow path on an AVX-512 one. So both caches are keyed by `host()`, and a
kernel also records the ISA its compiler resolved `-march=native` to (`native_target`): an
entry built for another CPU is a miss, rebuilt, never run.

Read from Linux's /proc/cpuinfo (the kernel's view of CPUID); elsewhere from `platform`.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# The cpuinfo flags that name instruction sets (what decides whether code runs, and which
# path is fast). Others (virtualization, power management, bugs) vary between hosts of one
# CPU model and would only split the cache.
_ISA = re.compile(
    r"^(sse\d?\w*|ssse3|avx\w*|fma\w*|f16c|bmi\d|amx\w*|popcnt|abm|lzcnt|movbe|adx|aes|vaes|"
    r"pclmulqdq|vpclmulqdq|gfni|sha_ni|sha512|xop|tbm|rdrand|rdseed|"
    r"asimd\w*|sve\w*|sme(?!p)\w*|fp16|bf16|i8mm|dotprod|neon)$"
)


@dataclass(frozen=True)
class Host:
    """The CPU: its model name and its instruction-set flags (sorted)."""

    model: str
    isa: tuple[str, ...]

    @property
    def key(self) -> str:
        """A short stable digest of model and flags, for cache keys and directory names."""
        return hashlib.sha256(repr((self.model, self.isa)).encode()).hexdigest()[:12]

    def describe(self) -> str:
        """'AMD EPYC 9R14 (avx2 avx512_bf16 avx512_vnni avx512f fma ...)': what benchmark
        figures are recorded with."""
        return f"{self.model} ({' '.join(self.isa)})"


def parse_cpuinfo(text: str) -> Host:
    """A Host from /proc/cpuinfo's text (the first processor's entry: all cores of one
    machine share a model; on x86 'model name' and 'flags', on Arm 'Features')."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("hardware") or fields.get("cpu part") or "unknown"
    flags = (fields.get("flags") or fields.get("features") or "").split()
    return Host(model=model, isa=tuple(sorted({f for f in flags if _ISA.match(f)})))


@functools.cache
def host() -> Host:
    """This machine's CPU (read once per process)."""
    try:
        return parse_cpuinfo(CPUINFO.read_text())
    except OSError:
        return Host(model=platform.processor() or platform.machine() or "unknown", isa=())


@functools.cache
def native_target(cxx: str) -> str:
    """What `cxx -march=native` compiles for, as the compiler resolves it: GCC's `-march=`
    value and enabled `-m` ISA options (`-Q --help=target`), or clang's target CPU and
    features (`-###`). Falls back to `host()` when the compiler answers neither."""
    gcc = subprocess.run(
        [cxx, "-march=native", "-Q", "--help=target"], capture_output=True, text=True, check=False
    )
    if gcc.returncode == 0 and "-march=" in gcc.stdout:
        opts = re.findall(r"^\s+(-m[\w.=-]+?)=?\s+(\S+)\s*$", gcc.stdout, re.M)
        march = [v for k, v in opts if k == "-march"]
        on = sorted(k for k, v in opts if v == "[enabled]")
        return f"{march[0] if march else '?'}:{' '.join(on)}"
    clang = subprocess.run(
        [cxx, "-march=native", "-###", "-x", "c++", "-c", "/dev/null"],
        capture_output=True,
        text=True,
        check=False,
    )
    cpu = re.findall(r'"-target-cpu" "([^"]+)"', clang.stderr)
    if cpu:
        features = sorted(re.findall(r'"-target-feature" "(\+[^"]+)"', clang.stderr))
        return f"{cpu[0]}:{' '.join(features)}"
    return host().describe()
