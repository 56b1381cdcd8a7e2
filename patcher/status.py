"""What a plan says about a patch, or one of its edits, on a tree.

Standard library only: the compatibility report reads these words from result
files without the engine's dependencies installed.
"""

from __future__ import annotations

import enum


class PlanStatus(str, enum.Enum):
    """A ``str`` so that JSON output and result files hold the plain word."""

    APPLICABLE = "applicable"
    """Apply would change the tree."""
    PARTLY_APPLIED = "partly applied"
    """Some edits are made, others not (a kill between two files, or part of the
    change made by hand): apply completes it, revert undoes it."""
    APPLIED = "applied"
    """Apply would change nothing: the tree has the change already."""
    REVERTIBLE = "revertible"
    """Revert would change the tree."""
    NOT_APPLIED = "not applied"
    """Revert would change nothing: the tree does not have the change."""
    IN_VLLM = "in vLLM"
    """vLLM has its own form of the change: nothing to apply or revert."""
    NOT_APPLICABLE = "not applicable"
    """The codemod refused (or the version is out of range): nothing is written."""
    SKIPPED = "skipped"
    """An optional edit left out: its file is missing or has another shape."""

    def __str__(self) -> str:  # the word, also in f-strings on Python 3.12+
        return self.value

    @classmethod
    def pending(cls, direction: str, changes: bool) -> PlanStatus:
        """The status of a plan (or edit) that the engine accepts: whether
        ``direction`` ("apply" or "revert") would change anything."""
        if direction == "apply":
            return cls.APPLICABLE if changes else cls.APPLIED
        return cls.REVERTIBLE if changes else cls.NOT_APPLIED
