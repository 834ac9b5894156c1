"""mlm_jax: a JAX/XLA trainer for large transformers (tensor, sequence, data/FSDP parallelism and more)."""
from mlm_jax.config import Config, ConfigError
from mlm_jax.validation.config import load_config

__all__ = ["Config", "ConfigError", "Trainer", "generate", "load_config", "load_pretrained"]


def __getattr__(name):
    if name == "Trainer":  # keeps `import mlm_jax` light: jax loads on first use
        from mlm_jax.train.loop import Trainer
        return Trainer
    if name == "generate":  # the module, callable as its `generate` function
        import mlm_jax.generate
        return mlm_jax.generate
    if name == "load_pretrained":
        from mlm_jax.infer.pretrained import load_pretrained
        return load_pretrained
    raise AttributeError(name)
