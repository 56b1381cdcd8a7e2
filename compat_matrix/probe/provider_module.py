"""What the probe reads off a provider module besides its register function: an
optional ``status()``, and the opt-in variable named by its ``OPT_IN_ENV``, set
for the length of a block.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def provider_status(module) -> dict | None:
    status = getattr(module, "status", None)
    try:
        return status() if callable(status) else None
    except Exception as exc:
        return {"errors": [f"status() raised {type(exc).__name__}: {exc}"]}


@contextmanager
def env_var(name: str | None, value: str | None) -> Iterator[None]:
    """``name`` set to ``value`` (unset when None) inside the block; no-op without
    a name."""
    if not name:
        yield
        return
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
