"""The matrix's progress lines: on stderr, so stdout stays free for results."""

from __future__ import annotations

import sys


def log(msg: str) -> None:
    print(f"[compat] {msg}", file=sys.stderr, flush=True)
