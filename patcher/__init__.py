"""vllm-patch: apply, check and upstream small, carried changes to a vLLM tree.

The engine in this package knows nothing about any particular change: each
change lives in its own folder under ``patches/`` with a ``patch.toml`` and the
LibCST codemods that perform it.
"""
