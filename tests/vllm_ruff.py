"""vLLM's ``ruff format`` (88 columns, py310), with the ruff of the test group,
to hold what the codemods write to it: they lay it out without ruff."""

import subprocess

from ruff.__main__ import find_ruff_bin

from patches.cpu_fused_norms.layout import LINE_LENGTH
from vllm_patch.upstream.pr_format import changed_ranges


def ruff_format(source: str) -> str:
    """``source`` as vLLM's ``ruff format`` lays it out (line ends kept)."""
    cmd = [find_ruff_bin(), "format", "--isolated", "--no-cache"]
    cmd += ["--line-length", str(LINE_LENGTH), "--target-version", "py310", "-"]
    done = subprocess.run(
        cmd, input=source.encode(), capture_output=True, check=True
    )
    return done.stdout.decode()


def touched_lines_ruff_moves(before: str, after: str) -> list[str]:
    """The lines ``after`` adds or edits over ``before`` that vLLM's ruff would
    lay out otherwise, or that pass 88 columns."""
    touched = {i for a, b in changed_ranges(before, after) for i in range(a, b)}
    moved = {
        i for a, b in changed_ranges(ruff_format(after), after) for i in range(a, b)
    }
    lines = after.splitlines()
    return [
        lines[i]
        for i in sorted(touched)
        if i in moved or len(lines[i]) > LINE_LENGTH
    ]
