"""vLLM's plugin filter: with ``VLLM_PLUGINS`` set, vLLM silently loads only the
plugins it names (comma-separated); the doctor and ``serve`` say so first."""

import os

FILTER_ENV = "VLLM_PLUGINS"


def left_out(plugin: str) -> bool:
    """Whether ``VLLM_PLUGINS`` is set and does not name ``plugin``."""
    value = os.environ.get(FILTER_ENV)
    return value is not None and plugin not in value.split(",")


def left_out_message(plugin: str, provider: str) -> str:
    return (
        f"{FILTER_ENV}={os.environ[FILTER_ENV]!r} leaves out the plugin "
        f"{plugin!r}: vLLM will not load {provider!r}, and every RMSNorm runs "
        "native although the opt-in asks for the kernels"
    )


def left_out_fix(plugin: str) -> str:
    value = os.environ.get(FILTER_ENV) or ""
    return (
        f"export {FILTER_ENV}={','.join(filter(None, [value, plugin]))} "
        f"(or unset {FILTER_ENV}: then vLLM loads every plugin)"
    )
