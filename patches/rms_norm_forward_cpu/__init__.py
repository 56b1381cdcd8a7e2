"""RMSNorm.forward_cpu: vLLM's CPU fused RMSNorm kernels (see patch.toml)."""
