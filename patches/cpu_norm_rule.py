"""Where vLLM's CPU ``rms_norm`` and ``fused_add_rms_norm`` kernels run: the rule's
one home, as real code.

Both forms write this code into vLLM and the provider runs it by importing it:
the CustomOp form copies ``cpu_norm_dtypes``, ``cpu_threads_shared``,
``RMSNormForwardCpu.forward_cpu`` and the body of
``RMSNormForwardCpu.bind_cpu_ops`` (as the tail of ``RMSNorm.__init__``) into
``layernorm.py``; the IR form copies the two functions into ``vllm_c.py``.
``patches/cpu_norm_source.py`` reads this file with LibCST and adapts it per
tree; nothing is executed as generated source. ``expects_kernel`` and
``layer_dtypes`` are for tests only.
"""

import functools
import os

import torch
from vllm import envs


@functools.cache
def cpu_norm_dtypes() -> tuple[torch.dtype, ...]:
    """Returns the dtypes in which this machine's CPU kernels match forward_native.

    Cached once per process and called outside traced code: dynamo refuses
    ``torch.cpu._is_avx512_bf16_supported()`` ("marked as skipped", torch 2.13).
    """
    from vllm.platforms import CpuArchEnum, current_platform

    if not current_platform.is_cpu():
        return ()
    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "rms_norm"):
        return ()
    arch = current_platform.get_cpu_architecture()
    dtypes = [torch.float32]
    # POWER's VSX kernels have no float16 (csrc/cpu/cpu_types_vsx.hpp, 0.34.0).
    if arch in (CpuArchEnum.X86, CpuArchEnum.ARM):
        dtypes.append(torch.float16)
    # bfloat16 only where the build rounds float32 to bfloat16 as torch does:
    # POWER and s390x round in software, aarch64 with BF16 in hardware (the
    # aarch64 build's bfloat16 kernels need the BF16 extension). oneDNN's check
    # reads cpuinfo's BF16 flag, as torch.cpu.get_capabilities() does, which
    # torch 2.10 and older (vLLM 0.19 and older) lack.
    rounds_bf16 = arch in (CpuArchEnum.POWERPC, CpuArchEnum.S390X) or (
        arch == CpuArchEnum.ARM and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    if arch == CpuArchEnum.X86:
        # _C_AVX512 and _C_AVX2 truncate (csrc/cpu/cpu_types_x86.hpp, 0.34.0),
        # a bias toward zero; _C rounds. import_kernels loads _C on this check.
        rounds_bf16 = torch.cpu._is_avx512_bf16_supported()
    if rounds_bf16:
        dtypes.append(torch.bfloat16)
    return tuple(dtypes)


def cpu_threads_shared() -> bool:
    """Returns whether this process's OpenMP team spans every CPU of the machine.

    The kernels open an OpenMP region on every call, even for one row, and wait
    for a team thread the engine process has descheduled, where native's small
    ATen ops run inline: measured slower at decode with two threads on a busy
    two-core machine (faster on a quiet one: native is never the slower side).
    A CPU worker's thread count is final before its model is built
    (OMP_NUM_THREADS from its binding at start-up; init_device disables
    torch.set_num_threads). The affinity would not do: vLLM's binding narrows
    the worker's to its team.
    """
    threads = torch.get_num_threads()
    return threads > 1 and threads >= (os.cpu_count() or 1)


class RMSNormForwardCpu:
    """``RMSNorm``'s CPU path, over ``RMSNorm``'s own attributes: what the
    CustomOp form writes into it and the provider's subclass runs."""

    def bind_cpu_ops(self) -> None:
        """The tail of ``RMSNorm.__init__``: its body is written there."""
        # The CPU kernels where they match forward_native: with a weight, no
        # variance size override, no batch invariance, a hidden size the kernels
        # vectorise (blocks of 8) and a core to spare.
        self.cpu_dtypes: tuple[torch.dtype, ...] = ()
        if (
            self.has_weight
            and self.variance_size_override is None
            and self.hidden_size % 8 == 0
            and not envs.VLLM_BATCH_INVARIANT
            and not cpu_threads_shared()
        ):
            self.cpu_dtypes = cpu_norm_dtypes()
        if self.cpu_dtypes:
            self.op = torch.ops._C.rms_norm
            self.add_op = torch.ops._C.fused_add_rms_norm

    def forward_cpu(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # The kernels read x and residual as contiguous rows of the weight's
        # dtype. Their width is the weight's wherever forward_native runs (it
        # multiplies by the weight), so it is not checked again per call.
        weight = self.weight
        dtype = x.dtype
        if dtype in self.cpu_dtypes and dtype == weight.dtype and x.is_contiguous():
            if residual is None:
                out = torch.empty_like(x)
                self.op(out, x, weight, self.variance_epsilon)
                return out
            if residual.dtype == dtype and residual.is_contiguous():
                self.add_op(x, residual, weight, self.variance_epsilon)
                return x, residual
        return self.forward_native(x, residual)


def expects_kernel(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    dtypes: tuple[torch.dtype, ...],
    residual: torch.Tensor | None = None,
) -> bool:
    """Returns whether the rule runs a kernel for this call, for tests to expect.

    Args:
        x: The input.
        weight: The weight the kernel would get (None: a weightless IR call).
        dtypes: The layer's ``cpu_dtypes`` (or ``()`` where it stays native).
        residual: The fused add's residual, if any.
    """
    return (
        weight is not None
        and x.dtype in dtypes
        and x.dtype == weight.dtype
        and x.shape[-1] == weight.shape[-1]
        and x.shape[-1] % 8 == 0
        and x.is_contiguous()
        and (
            residual is None
            or (residual.dtype == x.dtype and residual.is_contiguous())
        )
    )


def layer_dtypes(layer) -> tuple[torch.dtype, ...]:
    """The dtypes ``bind_cpu_ops`` gives ``layer`` (an ``RMSNorm``), restated
    from the rule for tests to check the layer against."""
    if (
        not layer.has_weight
        or layer.variance_size_override is not None
        or layer.hidden_size % 8
        or envs.VLLM_BATCH_INVARIANT
        or cpu_threads_shared()
    ):
        return ()
    return cpu_norm_dtypes()
