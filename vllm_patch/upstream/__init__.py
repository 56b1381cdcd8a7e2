"""``vllm-patch pr`` and its steps: a patch as a signed-off commit and a PR."""
