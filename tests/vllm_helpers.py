"""vLLM's config and log as the provider's tests read them: the config the
engine builds for a user's IR op priority (eager or compiled), what the
provider logs, and vLLM's strict environment validation. (Moved from the old
compatibility probe, which no longer exists.)"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager


def vllm_config(user: dict[str, list[str]] | None, *, compiled: bool):
    from vllm.config import CompilationConfig, KernelConfig, VllmConfig
    from vllm.config.compilation import CompilationMode
    from vllm.config.kernel import IrOpPriorityConfig

    if compiled:
        compilation = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, backend="inductor"
        )
    else:
        compilation = CompilationConfig(mode=CompilationMode.NONE)
    kernel = KernelConfig(ir_op_priority=IrOpPriorityConfig(**(user or {})))
    return VllmConfig(kernel_config=kernel, compilation_config=compilation)


def strict_environ_error(variables: dict[str, str]) -> str | None:
    """What vLLM's start-up environment validation in its strict form (what
    ``--fail-on-environ-validation`` runs) raises with ``variables`` set: the
    error, or None when it accepts them. Judged on ``variables`` alone: the
    process's other ``VLLM_*`` variables vLLM does not know are left out."""
    from vllm import envs
    from vllm.platforms import current_platform

    # The platform's method from 0.33 on; vllm.envs' function before.
    validate = getattr(current_platform, "validate_environ", None)
    validate = validate or envs.validate_environ
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(
            (k, v)
            for k, v in saved.items()
            if not k.startswith("VLLM_") or k in envs.environment_variables
        )
        os.environ.update(variables)
        validate(True)
    except ValueError as exc:
        return str(exc)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return None


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
