"""Hugging Face interop for the Llama family: `python -m mlm_jax.convert from-hf|to-hf`, `load_pretrained`."""


class ConvertError(ValueError):
    """A source or checkpoint that cannot be converted; the message is one line."""
