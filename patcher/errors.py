"""Errors the engine reports, and ``ExitCode``: the one home of ``vllm-patch``'s
exit codes, for ``--help`` and ``docs/cli.md``."""

import enum
import os
import sys


class ExitCode(enum.IntEnum):
    """One code per meaning; ``docs/cli.md`` carries ``table()``."""

    short: str  # for ``--help``
    meaning: str  # for the table in ``docs/cli.md``

    def __new__(cls, value: int, short: str, meaning: str) -> "ExitCode":
        member = int.__new__(cls, value)
        member._value_ = value
        member.short = short
        member.meaning = meaning
        return member

    OK = 0, "done", "done, already applied, or nothing to revert"
    PENDING = (
        1,
        "check found a patch to apply",
        "`check` found a patch that is not applied, or partly applied",
    )
    USAGE = (
        2,
        "usage error",
        "usage error (bad arguments, unknown patch, `apply`/`revert` on a `.whl`; "
        "`bench` or `serve` without vLLM; `pr` without its `[pr]` extra); for "
        "`pr`: not a git checkout, a dirty work tree, a detached or unknown base, "
        "no git identity",
    )
    CANNOT_APPLY = (
        3,
        "cannot apply (nothing changed)",
        "cannot apply: not a vLLM tree, a bad wheel, a missing or non-regular "
        "file, a shape the codemod does not recognise, a syntax error, a "
        "non-UTF-8 file, a read-only file or folder, a vLLM version outside the "
        "patch's range, an exclusive patch applied, no default patch, a path "
        "leading out of the tree (a link, a planted backup manifest), a file over "
        "the size bound. The message names the file, what was looked for and what "
        "was found; nothing was changed, unless a write failed between two files: "
        "then it says how far it got, and that apply (or revert) run again "
        "finishes it.",
    )
    FIX_NEEDED = (
        4,
        "doctor found something to fix",
        "`doctor` found something to fix (each `FIX` line says how)",
    )
    PART_FAILED = (
        5,
        "a bench part failed",
        "`bench` had a part fail (what it measured is written, the failure named "
        "in `evidence.json`)",
    )
    INTERRUPTED = (
        130,
        "interrupted",
        "interrupted by Ctrl-C (and, for `pr`, SIGTERM or SIGHUP): one line says "
        "so; `pr` has put the checkout back, `bench` has written what it "
        "measured, and a tree `apply` or `revert` left partly done is finished by "
        "running it again",
    )

    @classmethod
    def table(cls) -> str:
        """The Markdown table ``docs/cli.md`` carries."""
        rows = [f"| {c.value} | {c.meaning} |" for c in cls]
        return "\n".join(["| code | meaning |", "|---|---|", *rows])


def printable(text: str | os.PathLike) -> str:
    """``text`` printable anywhere: a file name's non-UTF-8 bytes become
    ``\\xNN``."""
    return os.fsencode(text).decode("utf-8", "backslashreplace")


def warn(message: str) -> None:
    """One warning line on stderr, as every vllm-patch command words it."""
    print(f"vllm-patch: warning: {printable(message)}", file=sys.stderr)


class PatchError(Exception):
    """A failure that names the file, what was looked for and what was found."""

    exit_code = ExitCode.CANNOT_APPLY
    FIELDS = ("message", "path", "looked_for", "found")

    def __init__(self, message: str, path=None, looked_for=None, found=None):
        self.message = printable(message)
        self.path = None if path is None else printable(path)
        self.looked_for = None if looked_for is None else printable(looked_for)
        self.found = None if found is None else printable(found)
        super().__init__(str(self))

    def __str__(self) -> str:
        lines = [f"{self.path}: {self.message}" if self.path else self.message]
        if self.looked_for:
            lines.append(f"  looked for: {self.looked_for}")
        if self.found:
            lines.append(f"  found: {self.found}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """``{"error": {...}}``, what ``--json`` prints instead of a report."""
        fields = {k: getattr(self, k) for k in self.FIELDS}
        return {"error": {"code": int(self.exit_code)} | fields}


class UsageError(PatchError):
    exit_code = ExitCode.USAGE


class Interrupted(PatchError):
    """Ctrl-C (or a signal a job turns into it): said in one line, exit 130."""

    exit_code = ExitCode.INTERRUPTED


class VllmHasItsOwn(Exception):
    """vLLM has its own form of the change: left as it is; ``check`` exits 0."""


class ShapeNotRecognised(PatchError):
    """Raised by a codemod when the source does not have the shape it edits."""

    def __init__(self, looked_for: str, found: str, *, path: str | None = None):
        super().__init__("source shape not recognised", path, looked_for, found)
