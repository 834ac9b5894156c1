"""`python -m mlm_jax.plan --config C --gpus N [...]`: one CPU device per GPU where XLA compiles for the CPU."""
import os
import re
import sys

_gpus = re.search(r"--gpus[= ](\d+)", " ".join(sys.argv))
if _gpus and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={_gpus.group(1)}").strip()

from mlm_jax.plan.cli import main  # after the device count is set

sys.exit(main())
