"""Probe one vLLM environment: does the CPU fused-norm provider work here, and
does the upstream patch?

    python -m compat_matrix.probe [--e2e] [--json FILE] [--only CHECK[,CHECK]]

Run it with the interpreter of the environment to probe. It prints one JSON
document (schema 1) on stdout; whatever vLLM logs goes to stderr. Each check
passes, fails, or is skipped with a one-line reason when this environment cannot
run it (no vLLM IR, no loadable ``_C``, an op this version lacks); a failing
check does not stop the others. Exit status 0 when no check failed, else 1.

The probe changes this process (it registers the provider and wraps the
platform's default priority), never the installed vLLM: the upstream patch is
applied to a hard-linked copy, which the patch engine edits by rename only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from compat_matrix.probe.checks import CHECKS
from compat_matrix.probe.document import probe_document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compat_matrix.probe", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--e2e", action="store_true", help="also run vLLM end to end (about a minute)"
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="also write the document to FILE"
    )
    parser.add_argument(
        "--only",
        metavar="CHECK[,CHECK]",
        type=lambda v: [c.strip() for c in v.split(",") if c.strip()],
        help="run only these checks (and the cheap ones they need); the rest skip",
    )
    args = parser.parse_args(argv)
    unknown = [c for c in args.only or [] if c not in CHECKS]
    if unknown:
        parser.error(f"unknown check {', '.join(unknown)}; checks: {', '.join(CHECKS)}")

    # stdout carries the JSON document only: point fd 1 (vLLM's log stream, C
    # code's printf) at stderr while the checks run.
    sys.stdout.flush()
    saved_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        doc = probe_document(e2e=args.e2e, only=args.only)
    finally:
        sys.stdout.flush()
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
    text = json.dumps(doc, indent=2, default=str)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    print(f"probe: {doc['summary']}", file=sys.stderr)
    return 0 if doc["ok"] else 1
