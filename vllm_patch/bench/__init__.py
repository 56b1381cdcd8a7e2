"""``vllm-patch bench``: evidence for the change, measured on this machine."""
