"""``vllm-patch doctor``: is this environment ready for vLLM on CPU and the patches?"""
