"""Bridges to JAX training stacks: Tunix's rollout API (`tunix.py`); NNX states are read by
`weights/nnx.py`.

Needs the optional extra `pip install hotswap[tunix]`; nothing here is imported by the engine.
"""
