"""How a check or a cell ended: the words the probe's documents, the results
and MATRIX.md hold."""

from __future__ import annotations

from enum import Enum


class CheckStatus(str, Enum):
    """A ``str``: JSON holds the plain word, and a word read back from JSON
    compares (and hashes, on every Python) equal to its member."""

    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"
    UNAVAILABLE = "unavailable"  # a cell only: the registry did not answer

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value
