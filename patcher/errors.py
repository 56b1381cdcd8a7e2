"""Errors the engine reports, each mapped to a documented exit code."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    """Done, already applied, or nothing to revert."""
    PENDING = 1
    """``check`` found a patch that applies but is not applied yet; ``doctor``
    found something to fix."""
    USAGE = 2
    """Bad command line (argparse's own code), or a verb the target cannot take."""
    CANNOT_APPLY = 3
    """Not a vLLM tree, unrecognised shape, syntax error, version out of range,
    unreadable or unwritable file. Nothing was written."""


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
        self.message = message
        self.path = path
        self.looked_for = looked_for
        self.found = found
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [f"{self.path}: {self.message}" if self.path else self.message]
        if self.looked_for:
            parts.append(f"  looked for: {self.looked_for}")
        if self.found:
            parts.append(f"  found: {self.found}")
        return "\n".join(parts)


class UsageError(PatchError):
    exit_code = ExitCode.USAGE


class ShapeNotRecognised(PatchError):
    """Raised by a codemod when the source does not have the shape it edits."""

    def __init__(self, looked_for: str, found: str, *, path: str | None = None):
        super().__init__(
            "source shape not recognised", path=path, looked_for=looked_for, found=found
        )
