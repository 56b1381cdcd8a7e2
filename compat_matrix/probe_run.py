"""Running ``compat_matrix.probe`` inside a cell's environment, and the checks a
cell records in its place when the probe cannot run."""

from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from compat_matrix.cell_env import PROJECT, env_python
from compat_matrix.check_status import CheckStatus
from compat_matrix.log import log
from compat_matrix.probe.checks import CHECKS


def launch_probe(
    env: Path, probe_args: list[str], timeout: int
) -> tuple[dict | None, str]:
    """(the probe's JSON document, "") or (None, why there is none)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        cmd = [
            str(env_python(env)),
            "-m",
            "compat_matrix.probe",
            "--json",
            str(out),
            *probe_args,
        ]
        log(shlex.join(cmd))
        tail, timed_out = _stream_progress(cmd, timeout)
        if timed_out:
            return None, f"probe did not finish in {timeout} s"
        if out.is_file():
            try:
                return json.loads(out.read_text("utf-8")), ""
            except json.JSONDecodeError as exc:
                return None, f"probe wrote unreadable JSON: {exc}"
        return None, f"probe exited without a result: {' | '.join(tail) or 'no output'}"


def _stream_progress(cmd: list[str], timeout: int) -> tuple[list[str], bool]:
    """Run the probe, passing its progress lines on as they come (a probe takes
    about a minute); the last lines of its stderr, and whether it timed out."""
    proc = subprocess.Popen(
        cmd, cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    tail: list[str] = []
    try:
        for line in proc.stderr:
            line = line.rstrip()
            tail = [*tail[-2:], line]
            if line.startswith("probe ["):
                log(line)
        proc.wait()
    finally:
        timed_out = not watchdog.is_alive()
        watchdog.cancel()
    return tail, timed_out


def skipped_probe(reason: str) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "status": CheckStatus.SKIP,
            "reason": reason,
            "seconds": 0.0,
            "details": {},
        }
        for name in CHECKS
    ]
