"""The ruff of the ``[pr]`` extra: what ``pr`` checks vLLM's changed lines with
where the checkout's pre-commit pin cannot be had."""

from functools import cache

from patcher.errors import UsageError


@cache
def ruff_binary() -> str:
    """The ``ruff`` package's own executable."""
    try:
        from ruff.__main__ import find_ruff_bin
    except ImportError:
        raise UsageError(
            "vllm-patch pr needs the [pr] extra (missing: ruff): "
            "pip install 'vllm-patch[pr]'"
        ) from None
    return str(find_ruff_bin())
