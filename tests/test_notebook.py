"""The quickstart notebook runs top to bottom through the public API."""
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    # the notebook trains 40 steps: its kernel compiles with XLA's optimisations (the suite's fast-compile flags
    # make that run four times slower), on the suite's eight devices
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "validation loss" in outputs and "step 40" in outputs
