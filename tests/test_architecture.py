"""The package's architecture as a specification: each package imports only the layers below it and no modules of a
package import each other in a cycle (import-linter, the contracts in pyproject.toml); no module imports the package
inside a function; a config loads without jax; the model finds no kernels in context and never deletes its parts.
"""
import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlm_jax"
# Imports that may sit inside a function: the lazy public API of `mlm_jax/__init__.py`, and the optional backends
# (lm-eval's `LM` subclass imports lm-eval).
LAZY_API = PACKAGE / "__init__.py"
OPTIONAL_BACKENDS = {"mlm_jax.eval.lm"}


def lint_imports(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """import-linter over the `mlm_jax` package found first on the path from `cwd`, with pyproject.toml's
    contracts."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                           "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))"],
                          cwd=cwd, env=env, capture_output=True, text=True)


def test_packages_import_only_the_layers_below_them_and_no_cycles():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize("importer, imported", [("model/norm.py", "mlm_jax.train.loop"),
                                                ("model/linear.py", "mlm_jax.model.attention")])
def test_the_contracts_fail_on_an_upward_import_or_a_cycle(tmp_path, importer, imported):
    """A copy of the package with one import added that goes up a layer (the model importing the trainer) or closes
    a cycle (attention builds on the linear layer)."""
    shutil.copytree(PACKAGE, tmp_path / "mlm_jax", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "mlm_jax" / importer, "a") as f:
        f.write(f"\nimport {imported}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout[-3000:]


def _function_level_imports(path: pathlib.Path):
    """(line, module) of each import of the package inside a function of the file at `path`."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this file's package
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base]
            else:
                continue
            for name in names:
                if name == "mlm_jax" or name.startswith("mlm_jax."):
                    yield node.lineno, name


def test_no_module_imports_the_package_inside_a_function():
    found = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in sorted(PACKAGE.rglob("*.py")) if path != LAZY_API
             for line, name in _function_level_imports(path) if name not in OPTIONAL_BACKENDS]
    assert not found, "imports inside functions (import at the top; a cycle means a layer is wrong):\n" + "\n".join(found)


def test_load_config_imports_no_jax():
    code = ("import sys, mlm_jax; mlm_jax.load_config('configs/llama-1b.yaml', []); "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('mlm_jax'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_model_finds_no_kernels_in_context_and_never_deletes_its_parts():
    """Kernels are passed to the layers (`model.kernels.Kernels`): the one context variable of the model is the
    activation layout (`model.axes`); decoding builds its own blocks (`mlm_jax.infer`) instead of mutating these."""
    for path in sorted((PACKAGE / "model").rglob("*.py")):
        text = path.read_text()
        assert "del self." not in text, path
        assert "ContextVar" not in text or path.name == "axes.py", path
    assert (PACKAGE / "model" / "axes.py").read_text().count("contextvars.ContextVar(") == 1
