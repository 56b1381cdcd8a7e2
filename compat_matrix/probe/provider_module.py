"""What the probe reads off the provider module besides ``register()``: the IR
provider name it declares (``PROVIDER``, read before the checks run), its
``status()``, what it logs (``provider_log``), and its opt-in variable
(``OPT_IN_ENV``), set for the length of a block (``env_var``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager


def declared_name(module_name: str) -> str | None:
    """The ``PROVIDER`` the module declares; None when it declares none or does not
    import (the registration check then says why)."""
    try:
        module = importlib.import_module(module_name)
    except Exception:
        return None
    name = getattr(module, "PROVIDER", None)
    return name if isinstance(name, str) else None


def provider_status(module) -> dict | None:
    status = getattr(module, "status", None)
    try:
        return status() if callable(status) else None
    except Exception as exc:
        return {"errors": [f"status() raised {type(exc).__name__}: {exc}"]}


@contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """``name`` set to ``value`` (unset when None) inside the block."""
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


@contextmanager
def provider_log(module_name: str) -> Iterator[list[dict]]:
    """The records the provider module logs inside the block (found by source
    file, whatever logger it uses), as ``{level, message, traceback}``."""
    origin = importlib.util.find_spec(module_name).origin
    records: list[logging.LogRecord] = []
    collect = logging.Handler(logging.DEBUG)
    collect.emit = records.append
    loggers = [logging.getLogger(name) for name in ("", "vllm")]  # vLLM's tree
    for logger in loggers:  # may not propagate to the root
        logger.addHandler(collect)
    found: list[dict] = []
    try:
        yield found
    finally:
        for logger in loggers:
            logger.removeHandler(collect)
        found += [
            {
                "level": r.levelname,
                "message": r.getMessage(),
                "traceback": r.exc_info is not None,
            }
            for r in dict.fromkeys(records)  # once, even if both handlers saw it
            if r.pathname == origin
        ]
