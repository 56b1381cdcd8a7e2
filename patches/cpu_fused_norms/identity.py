"""The out-of-tree provider's identity, the one home of these names; no torch,
no vLLM: ``vllm-patch pr`` reads them where neither is installed."""

PROVIDER = "vllm_c_cpu"
UPSTREAM_PROVIDER = "vllm_c"
OPS = ("rms_norm", "fused_add_rms_norm")
# Outside vLLM's ``VLLM_`` namespace on purpose: vLLM warns about every ``VLLM_*``
# variable it does not know, and ``--fail-on-environ-validation`` refuses to start.
OPT_IN_ENV = "VLLMPATCH_CPU_FUSED_NORMS"
# As vLLM's boolean flags (``vllm/envs.py``: ``.lower() in ("true", "1")``);
# anything else is off, and a value neither on nor off is said to be ignored.
OPT_IN_ON = ("1", "true")
OPT_IN_OFF = ("", "0", "false")
