"""Every rule a run must satisfy, checked before anything is traced or written: on the config alone
(`validation.config`, with `load_config`; no jax) and on the devices and backend (`validation.plan`, which resolves
the degrees, the microbatch count and the kernels)."""
