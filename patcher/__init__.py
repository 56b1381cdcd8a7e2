"""The engine: plan, apply and revert the patches under ``patches/`` on a vLLM
tree."""
