"""vllm_patch.runtime.child: the one child runner, with real subprocesses."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from vllm_patch.runtime import child


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
        str(targets),
        "/extra",
        "/inherited",
        str(child.PROJECT_ROOT),
    ]
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
    assert "Traceback" in outcome.log and "no good" in outcome.log[-200:]
    with pytest.raises(child.ChildFailed, match="ValueError: no good"):
        outcome.value()


def test_a_child_that_dies_without_a_result_says_how(targets):
    outcome = child.run(
        "toolkit_targets:exit_without_result", {"code": 3}, pythonpath=[targets]
    )
    assert not outcome.ok
    assert outcome.returncode == 3
    assert outcome.error == "exit code 3: about to leave"


@pytest.mark.parametrize("abort", [True, False], ids=["aborts", "returns"])
def test_what_a_child_reported_survives_its_crash(targets, abort):
    values = [{"step": 1}, ["two"], "three"]
    outcome = child.run(
        "toolkit_targets:report_then_abort",
        {"values": values, "abort": abort},
        pythonpath=[targets],
        timeout=120,
    )
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
