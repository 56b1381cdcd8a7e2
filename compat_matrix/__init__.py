"""Which vLLM releases the carried change and the out-of-tree provider work with
(docs/compat.md): ``checks/`` per release, ``qemu/`` for aarch64, ``report``
for MATRIX.md. The repository's tool: not installed with the project."""
