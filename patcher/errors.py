"""Errors the engine reports, and the exit codes they map to.

``ExitCode`` is the one home of ``vllm-patch``'s exit codes: the CLI's help text
is built from it and a test holds the table in ``docs/cli.md`` to it.
"""

from __future__ import annotations

import enum
import os
import sys


class ExitCode(enum.IntEnum):
    short: str
    """For ``--help``."""
    meaning: str
    """For the table in ``docs/cli.md``."""

    def __new__(cls, value: int, short: str, meaning: str) -> ExitCode:
        member = int.__new__(cls, value)
        member._value_ = value
        member.short = short
        member.meaning = meaning
        return member

    OK = 0, "done", "done, already applied, or nothing to revert"
    PENDING = (
        1,
        "check found a pending patch, doctor something to fix, or a bench step failed",
        "`check` found a patch that applies but is not applied yet; `doctor` found "
        "something to fix; `bench` had a step fail (what it measured is written)",
    )
    USAGE = (
        2,
        "usage error",
        "usage error (bad arguments, unknown patch, `apply`/`revert` on a `.whl`; "
        "`bench` without vLLM); for `pr`: not a git checkout, a dirty work tree, a "
        "detached or unknown base, no git identity",
    )
    CANNOT_APPLY = (
        3,
        "cannot apply (nothing changed)",
        "cannot apply: not a vLLM tree, a bad or damaged wheel, a missing or "
        "non-regular file, a shape the codemod does not recognise, a compatibility "
        "shim whose module is not in the tree, a syntax error, a non-UTF-8 file, a "
        "read-only file or folder, a vLLM version outside the patch's range, an "
        "interrupted operation that cannot be finished, a path leading out of the "
        "tree (a planted intent record or backup manifest, a link, a .git file "
        "naming another folder), a file over the size bound. The message names the "
        "file, what was looked for and what was found; nothing was changed, unless "
        "a write failed half-way: then it names the system call and says what the "
        "tree holds and that the next command finishes or undoes it.",
    )

    @classmethod
    def table(cls) -> str:
        """The Markdown table ``docs/cli.md`` carries."""
        rows = [f"| {c.value} | {c.meaning} |" for c in cls]
        return "\n".join(["| code | meaning |", "|---|---|", *rows])


def shown(text: str | os.PathLike) -> str:
    """A path (or a message holding one) as it can be printed anywhere: bytes a
    file name has that are not UTF-8 become ``\\xNN`` instead of failing to print."""
    return os.fsencode(text).decode("utf-8", "backslashreplace")


def warn(message: str) -> None:
    """One warning line on stderr, as every vllm-patch command words it."""
    print(f"vllm-patch: warning: {shown(message)}", file=sys.stderr)


class PatchError(Exception):
    """A failure that names the file, what was looked for and what was found."""

    exit_code = ExitCode.CANNOT_APPLY

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        looked_for: str | None = None,
        found: str | None = None,
    ) -> None:
        self.message = shown(message)
        self.path = None if path is None else shown(path)
        self.looked_for = None if looked_for is None else shown(looked_for)
        self.found = None if found is None else shown(found)
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [f"{self.path}: {self.message}" if self.path else self.message]
        if self.looked_for:
            parts.append(f"  looked for: {self.looked_for}")
        if self.found:
            parts.append(f"  found: {self.found}")
        return "\n".join(parts)

    def to_json(self) -> dict:
        """``{"error": {...}}``, what ``--json`` prints instead of a report."""
        return {
            "error": {
                "code": int(self.exit_code),
                "message": self.message,
                "path": self.path,
                "looked_for": self.looked_for,
                "found": self.found,
            }
        }


class ReadError(PatchError):
    """A file that exists but could not be read for a reason of the system (too
    many open files, an I/O error): never taken for a damaged or missing file."""


class UsageError(PatchError):
    exit_code = ExitCode.USAGE


class ShapeNotRecognised(PatchError):
    """Raised by a codemod when the source does not have the shape it edits."""

    def __init__(self, looked_for: str, found: str, *, path: str | None = None):
        super().__init__(
            "source shape not recognised", path=path, looked_for=looked_for, found=found
        )
