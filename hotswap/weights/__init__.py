"""Weights in: readers per source form (directories, GGUF, bytes, trees, NNX states, transfer refs),
staging and placement on the engine's shardings."""
