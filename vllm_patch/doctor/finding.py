"""One line of the doctor's report, and its fixes for the Python it checks."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field

from vllm_patch.runtime import cpu_torch

PYTHON = sys.executable


@dataclass
class Finding:
    check: str
    status: str  # "ok", "info" or "fix"
    message: str
    fix: str | None = None
    fix_argv: list[str] | None = field(default=None, repr=False)
    """A command ``--fix`` may run as is (only removals of broken packages)."""

    def line(self) -> str:
        tag = {"ok": "ok  ", "info": "info", "fix": "FIX "}[self.status]
        return f"[{tag}] {self.message}" + (f" -- fix: {self.fix}" if self.fix else "")


def pip(*args: str) -> str:
    return shlex.join([PYTHON, "-m", "pip", *args])


def removal(names: list[str]) -> tuple[str, list[str]]:
    """Removing packages that break beside this torch (text models need none),
    as text and as ``--fix``'s command: pip under ``-I`` (no ``pip/`` of the
    working folder, no ``PYTHON*`` variable, no user site)."""
    argv = cpu_torch.remove_command(PYTHON, names)
    argv.insert(1, "-I")
    return shlex.join(argv), argv


def traceback_hint(module: str) -> str:
    return f"{PYTHON} -c 'import {module}' shows the traceback"
