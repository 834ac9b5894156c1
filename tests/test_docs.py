"""Every command in README.md and docs/ works: the newcomer's training command runs; each training command's config
resolves (`--print-config`); each other command's module, subcommand and flags exist; each pip extra is declared."""
import contextlib
import glob
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from mlm_jax.train.__main__ import main as train_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# What a command may start with besides `python -m mlm_jax...`: installs, the tests, TensorBoard, the local launcher.
OTHER = ("pip", "pytest", "tensorboard", "scripts/launch_local.sh")


def commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every command in the pages' bash blocks, continuation lines joined, comments and environment
    assignments dropped, `&&` chains split, `$RANK` as process 0."""
    out = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                for part in line.replace("$RANK", "0").split("&&"):
                    argv = shlex.split(part, comments=True)
                    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                        argv = argv[1:]
                    if argv:
                        out.append((page, argv))
    return out


COMMANDS = commands()


def test_the_pages_hold_commands_and_readme_stays_a_guide():
    assert len(COMMANDS) > 40 and {page for page, _ in COMMANDS} >= {"README.md", "docs/data.md"}
    with open(os.path.join(ROOT, "README.md")) as f:
        assert len(f.read().splitlines()) < 200


def test_the_newcomer_command_trains(tmp_path):
    """README's first command on the CPU (its `pip install -e .` is what the suite runs in), cut to its first 10
    steps and an evaluation; the rest of its 200 are more of the same."""
    (page, first), (_, second) = COMMANDS[:2]
    assert page == "README.md" and first == ["pip", "install", "-e", "."] and second == ["python", "-m",
                                                                                           "mlm_jax.train"]
    proc = subprocess.run([sys.executable, "-m", "mlm_jax.train", "log.progress=never", "train.steps=10",
                           "train.eval_every=10"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "step 10/10 | eval_loss" in proc.stdout
    (run,) = (tmp_path / "runs").iterdir()
    assert {"config.yaml", "metrics.jsonl", "tensorboard", "checkpoints"} <= {p.name for p in run.iterdir()}


def _train_args(page, argv):
    """The training arguments of a `python -m mlm_jax.train` or `scripts/launch_local.sh N` command; a `--config`
    that the page's `convert from-hf SRC OUT` writes (`OUT/config.yaml`) is left out, the overrides checked alone."""
    args = argv[2:] if argv[0] == "scripts/launch_local.sh" else argv[3:]
    if "--config" in args:
        i = args.index("--config")
        converted = {f"{a[5]}/config.yaml" for p, a in COMMANDS if p == page and a[2:4] == ["mlm_jax.convert",
                                                                                           "from-hf"]}
        if args[i + 1] in converted:
            return args[:i] + args[i + 2:]
    return args


@pytest.mark.parametrize("page, argv", [c for c in COMMANDS if c[1][:3] == ["python", "-m", "mlm_jax.train"]
                                        or c[1][0] == "scripts/launch_local.sh"],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_training_commands_resolve(page, argv, monkeypatch):
    """The config resolves: every key known and every value allowed (data and checkpoint paths are the user's)."""
    monkeypatch.chdir(ROOT)
    args = _train_args(page, argv)
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        code = train_main(args + ["--print-config"])
    assert code == 0, (page, err.getvalue())
    assert out.getvalue().startswith("name:") or "model:" in out.getvalue()


def _help(module: str, sub: str | None) -> str:
    proc = subprocess.run([sys.executable, "-m", module, *([sub] if sub else []), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, (module, sub, proc.stderr)
    return proc.stdout


HELPED = sorted({(argv[2], argv[3] if argv[2] == "mlm_jax.convert" else None) for _, argv in COMMANDS
                 if argv[:2] == ["python", "-m"] and argv[2] != "mlm_jax.train"})


@pytest.mark.parametrize("module, sub", HELPED, ids=lambda v: v or "")
def test_other_commands_name_flags_their_tool_has(module, sub):
    text = _help(module, sub)
    for page, argv in COMMANDS:
        if argv[:3] == ["python", "-m", module] and (sub is None or argv[3] == sub):
            for flag in (a.split("=")[0] for a in argv if a.startswith("--")):
                assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", text), (page, argv, flag)


def test_every_command_is_one_the_suite_knows_and_every_extra_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    for page, argv in COMMANDS:
        assert argv[:2] == ["python", "-m"] and argv[2].startswith("mlm_jax") or argv[0] in OTHER, (page, argv)
        if argv[:3] == ["pip", "install", "-e"]:
            named = re.fullmatch(r"\.(\[([a-z0-9_,-]+)\])?", argv[3])
            assert named, (page, argv)
            assert set(filter(None, (named.group(2) or "").split(","))) <= extras, (page, argv)
        elif argv[:2] == ["pip", "install"]:
            assert argv[2] in ("torch", "tensorboard"), (page, argv)  # README's CPU torch, TensorBoard's viewer
            if argv[2] == "torch":
                assert argv[3:] == ["--index-url", "https://download.pytorch.org/whl/cpu"], (page, argv)
