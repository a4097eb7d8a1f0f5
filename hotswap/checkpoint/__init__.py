"""HF checkpoints, tokenizers and test checkpoints: the only code that knows HF tensor names."""
