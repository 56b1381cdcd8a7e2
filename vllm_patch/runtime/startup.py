"""Code run first by every interpreter a measured child starts: vLLM's CPU
platform spawns its workers (``VLLM_WORKER_MULTIPROC_METHOD=spawn``,
vllm/platforms/cpu.py, 0.32.0) and a server starts an engine process, fresh
interpreters that nothing done in the parent reaches. Each runs the
``sitecustomize`` module it finds first on ``PYTHONPATH``."""

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path


@contextlib.contextmanager
def startup_folder(lines: Sequence[str]) -> Iterator[str]:
    """A new folder holding a ``sitecustomize`` of ``lines``, removed on the
    way out: put first on a child's ``PYTHONPATH``, it runs in every interpreter
    of that child, and shadows any ``sitecustomize`` the environment has there."""
    with tempfile.TemporaryDirectory(prefix="vllm-patch-startup-") as folder:
        Path(folder, "sitecustomize.py").write_text("\n".join(lines) + "\n")
        yield folder
