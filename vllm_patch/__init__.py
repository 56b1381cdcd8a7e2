"""vllm-patch's jobs above the engine (``patcher``); ARCHITECTURE.md has the map."""
