"""What a plan says about a patch or an edit; standard library only: the
compatibility report reads these words from result files."""

import enum


class PlanStatus(str, enum.Enum):
    """A ``str``: JSON output and result files hold the plain word."""

    APPLICABLE = "applicable"  # apply would change the tree
    PARTLY_APPLIED = "partly applied"  # some edits made (a kill, a hand edit)
    APPLIED = "applied"  # apply would change nothing
    REVERTIBLE = "revertible"  # revert would change the tree
    NOT_APPLIED = "not applied"  # revert would change nothing
    IN_VLLM = "in vLLM"  # vLLM has its own form of the change
    NOT_APPLICABLE = "not applicable"  # refused: nothing is written
    SKIPPED = "skipped"  # an optional edit left out (file missing or other shape)

    def __str__(self) -> str:  # the word, also in f-strings on Python 3.12+
        return self.value

    @classmethod
    def from_changes(cls, direction: str, changes: bool) -> "PlanStatus":
        """Whether ``direction`` ("apply" or "revert") would change anything."""
        if direction == "apply":
            return cls.APPLICABLE if changes else cls.APPLIED
        return cls.REVERTIBLE if changes else cls.NOT_APPLIED
