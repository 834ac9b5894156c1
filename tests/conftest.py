"""Eight fake CPU devices for every test, set before jax is imported anywhere."""
import os

# LLVM's backend optimisations make the tiny test programs compile several times slower than they run; every
# comparison in the tests is between programs compiled alike.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
