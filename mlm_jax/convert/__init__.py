"""Hugging Face interop: `python -m mlm_jax.convert from-hf|to-hf`, one module per family and one registry of them
(`convert.families`) for both directions."""
from mlm_jax.checkpoint.weights import ConvertError

__all__ = ["ConvertError"]
