"""hotswap's benchmarks: `hotswap bench` (bench.py), its peer engines and the kernel timings.

They live beside the package, not in the wheel: `hotswap bench` runs them from a source
checkout (an editable install, or `python -m benchmarks.bench` from the repository root).
"""
