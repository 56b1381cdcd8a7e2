"""Enable vLLM's C fused RMSNorm kernels on CPU (see patch.toml)."""
