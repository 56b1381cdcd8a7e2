"""Errors the engine reports, and ``ExitCode``: the one home of ``vllm-patch``'s
exit codes, for ``--help`` and ``docs/cli.md``."""

import enum
import os
import sys


class ExitCode(enum.IntEnum):
    short: str  # for ``--help``
    meaning: str  # for the table in ``docs/cli.md``

    def __new__(cls, value: int, short: str, meaning: str) -> "ExitCode":
        member = int.__new__(cls, value)
        member._value_, member.short, member.meaning = value, short, meaning
        return member

    OK = 0, "done", "done, already applied, or nothing to revert"
    PENDING = (
        1,
        "check found a pending patch, doctor something to fix, or a bench step failed",
        "`check` found a patch that is not applied, or partly applied; `doctor` "
        "found something to fix; `bench` had a step fail (what it measured is "
        "written)",
    )
    USAGE = (
        2,
        "usage error",
        "usage error (bad arguments, unknown patch, `apply`/`revert` on a `.whl`; "
        "`bench` or `serve` without vLLM); for `pr`: not a git checkout, a dirty work tree, a "
        "detached or unknown base, no git identity",
    )
    CANNOT_APPLY = (
        3,
        "cannot apply (nothing changed)",
        "cannot apply: not a vLLM tree, a bad wheel, a missing or non-regular file, a "
        "shape the codemod does not recognise, a syntax error, a non-UTF-8 file, a "
        "read-only file or folder, a vLLM version outside the patch's range, an "
        "exclusive patch applied, no default patch, a path leading out of the tree (a "
        "link, a planted backup manifest), a file over the size bound. The message "
        "names the file, what was looked for and what was found; nothing was changed, "
        "unless a write failed between two files: then it says how far it got, and that"
        " apply (or revert) run again finishes it.",
    )

    @classmethod
    def table(cls) -> str:
        """The Markdown table ``docs/cli.md`` carries."""
        rows = [f"| {c.value} | {c.meaning} |" for c in cls]
        return "\n".join(["| code | meaning |", "|---|---|", *rows])


def printable(text: str | os.PathLike) -> str:
    """``text`` printable anywhere: a file name's non-UTF-8 bytes become ``\\xNN``."""
    return os.fsencode(text).decode("utf-8", "backslashreplace")


def warn(message: str) -> None:
    """One warning line on stderr, as every vllm-patch command words it."""
    print(f"vllm-patch: warning: {printable(message)}", file=sys.stderr)


class PatchError(Exception):
    """A failure that names the file, what was looked for and what was found."""

    exit_code = ExitCode.CANNOT_APPLY
    FIELDS = ("message", "path", "looked_for", "found")

    def __init__(self, message: str, path=None, looked_for=None, found=None):
        texts = (message, path, looked_for, found)
        self.message, self.path, self.looked_for, self.found = (
            None if x is None else printable(x) for x in texts
        )
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [f"{self.path}: {self.message}" if self.path else self.message]
        parts += [f"  looked for: {self.looked_for}"] if self.looked_for else []
        return "\n".join(parts + ([f"  found: {self.found}"] if self.found else []))

    def to_json(self) -> dict:
        """``{"error": {...}}``, what ``--json`` prints instead of a report."""
        fields = {k: getattr(self, k) for k in self.FIELDS}
        return {"error": {"code": int(self.exit_code)} | fields}


class UsageError(PatchError):
    exit_code = ExitCode.USAGE


class VllmHasItsOwn(Exception):
    """vLLM has its own form of the change: left as it is; ``check`` exits 0."""


class ShapeNotRecognised(PatchError):
    """Raised by a codemod when the source does not have the shape it edits."""

    def __init__(self, looked_for: str, found: str, *, path: str | None = None):
        super().__init__("source shape not recognised", path, looked_for, found)
