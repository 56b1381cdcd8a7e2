"""Which vLLM releases the carried change and the out-of-tree provider work with
(docs/compat.md, ARCHITECTURE.md); the repository's tool, not installed."""
