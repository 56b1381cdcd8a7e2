"""``vllm-patch doctor``: is this environment ready for vLLM on CPU, and what
state are the carried patches and their providers in?"""
