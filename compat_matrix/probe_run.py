"""Running the probe inside a cell's environment (a ``vllm_patch.runtime.child``
with the environment's interpreter), and the checks a cell records in its place when
the probe cannot run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compat_matrix.cell_env import env_python
from compat_matrix.check_status import CheckStatus
from compat_matrix.log import log
from compat_matrix.probe.checks import CHECKS
from vllm_patch.runtime import child

PROBE = "compat_matrix.probe.document:probe_document"


def launch_probe(
    env: Path, probe_kwargs: dict[str, Any], timeout: int
) -> tuple[dict | None, str]:
    """(the probe's JSON document, "") or (None, why there is none). Its
    progress lines are passed on as they come (a probe takes about a minute)."""
    python = env_python(env)
    log(f"{python}: {PROBE}({probe_kwargs})")
    outcome = child.run(
        PROBE, probe_kwargs, python=python, timeout=timeout, progress=_progress
    )
    if outcome.ok:
        return outcome.result, ""
    if outcome.timed_out:
        return None, f"probe did not finish in {timeout} s"
    return None, f"probe exited without a result: {outcome.error}"


def _progress(line: str) -> None:
    if line.startswith("probe ["):
        log(line)


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
