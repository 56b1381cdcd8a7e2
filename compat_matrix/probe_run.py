"""Running ``compat_matrix.probe`` inside a cell's environment, and the checks a
cell records in its place when the probe cannot run."""

from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from compat_matrix.environments import PROJECT, env_python
from compat_matrix.log import log

PROBE_CHECKS = (
    "ir_present",
    "provider_registers",
    "plugin_entry_point",
    "kernels_supported",
    "numerics",
    "dispatch",
    "kernel_config",
    "upstream_patch",
    "e2e",
)


def run_probe(
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
        try:
            proc = subprocess.run(
                cmd, cwd=PROJECT, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return None, f"probe did not finish in {timeout} s"
        if out.is_file():
            try:
                return json.loads(out.read_text("utf-8")), ""
            except json.JSONDecodeError as exc:
                return None, f"probe wrote unreadable JSON: {exc}"
        tail = proc.stderr.strip().splitlines()[-3:] or ["no output"]
        return (
            None,
            f"probe exited {proc.returncode} without a result: {' | '.join(tail)}",
        )


def skipped_probe(reason: str) -> list[dict[str, Any]]:
    return [
        {"name": n, "status": "skip", "reason": reason, "seconds": 0.0, "details": {}}
        for n in PROBE_CHECKS
    ]
