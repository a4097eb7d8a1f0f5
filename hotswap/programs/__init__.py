"""The compiled programs: the step (forward + sampler) and its buckets, the step and compile
caches, KV sizing, and ahead-of-time compilation for TPU slices."""
