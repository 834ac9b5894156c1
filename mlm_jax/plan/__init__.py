"""The layout planner: every candidate layout of a config on N GPUs compiled for those GPUs (without them), read for
its memory and collectives, priced from one-GPU measurements, and ranked (`python -m mlm_jax.plan`)."""
