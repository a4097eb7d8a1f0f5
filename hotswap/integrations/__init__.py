"""Bridges to JAX training stacks: Flax NNX models (`flax.py`) and Tunix's rollout API (`tunix.py`).

Both need the optional extra `pip install hotswap[tunix]`; nothing here is imported by the engine.
"""
