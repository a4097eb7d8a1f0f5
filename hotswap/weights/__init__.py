"""Weights in, one pipeline: one reader per source form (directories, GGUF, bytes, trees, NNX
states, transfer refs: `sources.read`) -> the one validator (`model/validate.py`) -> placement
on the engine's shardings with one finiteness pass (`hf_device.py`, `ingest.py`, `finiteness.py`)."""
