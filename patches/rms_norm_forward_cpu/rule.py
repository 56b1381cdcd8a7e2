"""Where vLLM's CPU norm kernels match native, as the source both forms write and
the provider runs: dtypes once per process, never in traced code (the fused add's
bfloat16 only where the build rounds as torch does), the rest per call."""

from importlib.util import find_spec
from pathlib import Path

CPU_PY = "vllm/platforms/cpu.py"  # where the tree says which builds vLLM loads
HIDDEN_MULTIPLE = 8  # the kernels vectorise the hidden size in blocks of 8

# In cpu.py where vLLM loads a build per x86 CPU class; ``_C`` has AVX512-BF16.
PER_ISA_BUILDS = "_C_AVX512"

X86_ROUNDS = (
    "\n        or (arch == CpuArchEnum.X86 and torch.cpu._is_avx512_bf16_supported())"
)

DTYPES_FUNCTION = '''\
def cpu_fused_norm_dtypes() -> tuple[tuple[torch.dtype, ...], tuple[torch.dtype, ...]]:
    """The dtypes in which vLLM's CPU rms_norm and fused_add_rms_norm kernels
    match forward_native on this machine: (rms_norm's, fused_add_rms_norm's)."""
    from vllm.platforms import CpuArchEnum, current_platform

    if not current_platform.is_cpu():
        return (), ()
    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "rms_norm"):
        return (), ()
    arch = current_platform.get_cpu_architecture()
    # POWER's VSX kernels have no float16; the aarch64 build needs BF16.
    arm_bf16 = (
        arch == CpuArchEnum.ARM and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    dtypes = [torch.float32]
    if arch in (CpuArchEnum.X86, CpuArchEnum.ARM):
        dtypes.append(torch.float16)
    if arm_bf16 or arch in (CpuArchEnum.X86, CpuArchEnum.POWERPC, CpuArchEnum.S390X):
        dtypes.append(torch.bfloat16)
    # The fused add writes the residual back in bfloat16: builds that
    # truncate float32 to bfloat16 there bias it, layer after layer.
    rounds_bf16 = (
        arm_bf16
        or arch in (CpuArchEnum.POWERPC, CpuArchEnum.S390X){x86_rounds}
    )
    add_dtypes = [d for d in dtypes if rounds_bf16 or d != torch.bfloat16]
    return tuple(dtypes), tuple(add_dtypes)
'''


def dtypes_function(cpu_py: str) -> str:
    """``cpu_fused_norm_dtypes``'s source for a tree whose cpu.py reads ``cpu_py``."""
    x86 = X86_ROUNDS if PER_ISA_BUILDS in cpu_py else ""
    return DTYPES_FUNCTION.format(x86_rounds=x86)


def call_checks(
    x: str,
    weight: str,
    dtypes: str,
    residual: str | None = None,
    weight_may_be_none: bool = False,
) -> str:
    """The per-call condition (Python source) for the kernel to match native;
    ``dtypes`` names the op's tuple from ``cpu_fused_norm_dtypes()``."""
    checks = [f"{weight} is not None"] if weight_may_be_none else []
    checks += [
        f"{x}.dtype in {dtypes}",
        f"{weight}.dtype == {x}.dtype",
        f"{x}.shape[-1] % {HIDDEN_MULTIPLE} == 0",
        f"{x}.is_contiguous()",
    ]
    if residual is not None:
        checks += [f"{residual}.dtype == {x}.dtype", f"{residual}.is_contiguous()"]
    return " and ".join(checks)


def installed_dtypes() -> tuple[tuple, tuple]:
    """``cpu_fused_norm_dtypes()`` for the installed vLLM, run on this machine."""
    import torch

    cpu_py = Path(find_spec("vllm.platforms.cpu").origin).read_text("utf-8")
    namespace = {"torch": torch}
    exec(dtypes_function(cpu_py), namespace)
    return namespace["cpu_fused_norm_dtypes"]()


def call_predicate(residual: bool, weight_may_be_none: bool = False):
    """:func:`call_checks` as a function ``(x, weight, dtypes, residual)``."""
    checks = call_checks(
        "x", "weight", "dtypes", "residual" if residual else None, weight_may_be_none
    )
    return eval(f"lambda x, weight, dtypes, residual=None: {checks}")


# The CustomOp form: what RMSNorm gains (and the provider's subclass runs), the
# kernels through vllm._custom_ops imported where used, as poly_norm does.
INIT_LINES = """\
# The dtypes in which vLLM's CPU kernels match forward_native for this
# layer: none without a weight, with a variance size override or with
# batch invariance.
self.cpu_dtypes, self.cpu_add_dtypes = (
    cpu_fused_norm_dtypes()
    if self.has_weight
    and self.variance_size_override is None
    and not {batch_invariant}
    else ((), ())
)
"""

FORWARD_CPU = f"""\
def forward_cpu(
    self,
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    from vllm import _custom_ops as ops

    # The kernels ignore strides and take the hidden size in blocks of 8.
    if residual is None:
        if {call_checks("x", "self.weight", "self.cpu_dtypes")}:
            out = torch.empty_like(x)
            ops.rms_norm(out, x, self.weight.data, self.variance_epsilon)
            return out
    elif {call_checks("x", "self.weight", "self.cpu_add_dtypes", "residual")}:
        ops.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)
        return x, residual
    return self.forward_native(x, residual)
"""

# Batch invariance, by the name layernorm.py imports (a function before 0.19).
BATCH_INVARIANT = {
    "vllm_is_batch_invariant": "vllm_is_batch_invariant()",
    "envs": "envs.VLLM_BATCH_INVARIANT",
}
