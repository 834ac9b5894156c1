"""Training: state, step, loop, optimizer, loss, metrics. `python -m mlm_jax.train` runs it."""
