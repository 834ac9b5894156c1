"""Eight fake CPU devices for every test, set before jax is imported anywhere."""
import atexit
import os
import shutil
import tempfile

# The suite is bound by XLA:CPU compile time. LLVM's backend optimisations and the MLIR fusion emitters make the
# tiny test programs compile several times slower than they run (without the emitters a compile takes about a
# quarter less), and code generation split over threads, which the test processes already keep busy, about a
# seventh slower than in one piece; every comparison in the tests is between programs compiled alike.
# Subprocesses inherit these.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same programs (the one-device references of the equivalence tests, a layout shared by
# several checks): a persistent compilation cache compiles each once per run (test_pipeline.py: 236 s against 282
# on two cores; the whole suite's test time 5% less).
# The first process creates it and removes it at exit; pytest-xdist's workers and the tests' subprocesses inherit it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mlm_jax-tests-compiled-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
