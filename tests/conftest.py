"""Eight fake CPU devices for every test, set before jax is imported anywhere."""
import os

# The suite is bound by XLA:CPU compile time. LLVM's backend optimisations and the MLIR fusion emitters make the
# tiny test programs compile several times slower than they run (without the emitters a compile takes about a
# quarter less); every comparison in the tests is between programs compiled alike. Subprocesses inherit these.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
