"""AddCpuIrOpPriority / RemoveCpuIrOpPriority on cpu.py, before and after."""

from __future__ import annotations

import textwrap

import pytest
from libcst.codemod import CodemodContext, CodemodTest

from patcher.codemod import TREE_READER, run_codemod
from patcher.errors import ShapeNotRecognised
from patches.cpu_fused_norms.cpu_priority import (
    AddCpuIrOpPriority,
    RemoveCpuIrOpPriority,
)

VLLM_C_027 = """
from vllm import ir
from vllm.platforms import current_platform

GPGPU_DEVICE = current_platform.is_cuda_alike() or current_platform.is_xpu()


CHECK = lambda x, weight, epsilon, variance_size=None: variance_size is None


@ir.ops.rms_norm.register_impl("vllm_c", supported=GPGPU_DEVICE, supports_args=CHECK)
def rms_norm(x, weight, epsilon, variance_size=None): ...


@ir.ops.fused_add_rms_norm.register_impl(
    "vllm_c", supported=GPGPU_DEVICE, supports_args=lambda x, r, weight, eps: True
)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...


@ir.ops.gelu_and_mul.register_impl("vllm_c", supported=current_platform.is_cuda())
def gelu_and_mul(x): ...
"""
VLLM_C_020 = """
from vllm import ir
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()


@ir.ops.rms_norm.register_impl(
    "vllm_c", supported=CUDA_ALIKE, supports_args=lambda x, weight, eps: True
)
def rms_norm(x, weight, epsilon, variance_size=None): ...
"""
KERNEL_CONFIG = """
class IrOpPriorityConfig:
    rms_norm: list[str] = Field(default_factory=list)
    fused_add_rms_norm: list[str] = Field(default_factory=list)
    gelu_and_mul: list[str] = Field(default_factory=list)

    @classmethod
    def with_default(cls, default, /, **kwargs): ...
"""
COMPILATION = "class CompilationMode(enum.IntEnum):\n    NONE = 0\n"

CPU_BEFORE = """
from typing import TYPE_CHECKING

from .interface import Platform

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.selector import AttentionSelectorConfig
else:
    VllmConfig = None


class CpuPlatform(Platform):
    device_name: str = "cpu"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        if vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE:
            backend = "eager" if envs.VLLM_CPU_CI_ENV else "inductor"


def after_the_class():
    pass
"""
METHOD = """
    @classmethod
    def get_default_ir_op_priority(
        cls, vllm_config: "VllmConfig"
    ) -> "IrOpPriorityConfig":
        from vllm.config.compilation import CompilationMode
        from vllm.config.kernel import IrOpPriorityConfig

        # Native used by default when compiling: Inductor fuses the native ops
        # into their neighbours, which an opaque kernel call would prevent.
        # Use the fused vLLM C kernels where available when there is no codegen.
        # Decided on the compilation settings check_and_update_config leaves,
        # which runs after this.
        cc = vllm_config.compilation_config
        backend, mode = cc.backend, cc.mode
        if mode == CompilationMode.VLLM_COMPILE:
            backend = "eager" if envs.VLLM_CPU_CI_ENV else "inductor"
        if vllm_config.lora_config is not None:
            mode = CompilationMode.NONE
        using_inductor = backend == "inductor" and mode != CompilationMode.NONE
        default = ["native"] if using_inductor else ["vllm_c", "native"]

{return_statement}
"""
CPU_AFTER = """
from typing import TYPE_CHECKING

from .interface import Platform

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kernel import IrOpPriorityConfig
    from vllm.v1.attention.selector import AttentionSelectorConfig
else:
    VllmConfig = None


class CpuPlatform(Platform):
    device_name: str = "cpu"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        if vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE:
            backend = "eager" if envs.VLLM_CPU_CI_ENV else "inductor"
{method}

def after_the_class():
    pass
"""
RETURN_BOTH = """\
        return IrOpPriorityConfig.with_default(
            ["native"], rms_norm=default, fused_add_rms_norm=default
        )"""
RETURN_RMS = """\
        return IrOpPriorityConfig.with_default(["native"], rms_norm=default)"""


def context(vllm_c: str) -> CodemodContext:
    files = {
        "vllm/kernels/vllm_c.py": textwrap.dedent(vllm_c),
        "vllm/config/kernel.py": KERNEL_CONFIG,
        "vllm/config/compilation.py": COMPILATION,
    }
    return CodemodContext(
        filename=AddCpuIrOpPriority.TARGET, scratch={TREE_READER: files.__getitem__}
    )


def cpu_after(return_statement: str) -> str:
    return CPU_AFTER.format(method=METHOD.format(return_statement=return_statement))


class TestAdd(CodemodTest):
    TRANSFORM = AddCpuIrOpPriority

    def test_gpgpu_gated_norms_get_vllm_c_and_the_rest_native(self) -> None:
        # gelu_and_mul's vllm_c impl is CUDA-only: it must not be named.
        self.assertCodemod(
            CPU_BEFORE, cpu_after(RETURN_BOTH), context_override=context(VLLM_C_027)
        )

    def test_020_tree_names_only_rms_norm(self) -> None:
        self.assertCodemod(
            CPU_BEFORE, cpu_after(RETURN_RMS), context_override=context(VLLM_C_020)
        )

    def test_020_to_027_spelling_of_the_ci_check(self) -> None:
        # vLLM 0.20-0.27 read the variable in check_and_update_config itself.
        spelled = 'os.environ.get("VLLM_CPU_CI_ENV", "0") != "0"'
        self.assertCodemod(
            CPU_BEFORE.replace("envs.VLLM_CPU_CI_ENV", spelled),
            cpu_after(RETURN_BOTH)
            .replace("envs.VLLM_CPU_CI_ENV", spelled, 1)
            .replace(
                'backend = "eager" if envs.VLLM_CPU_CI_ENV else "inductor"\n',
                f'backend = (\n                "eager" if {spelled} else "inductor"\n'
                "            )\n",
            ),
            context_override=context(VLLM_C_027),
        )

    def test_existing_method_is_left_alone(self) -> None:
        after = cpu_after(RETURN_BOTH)
        self.assertCodemod(after, after, context_override=context(VLLM_C_027))


class TestRemove(CodemodTest):
    TRANSFORM = RemoveCpuIrOpPriority

    def test_removes_method_and_type_import(self) -> None:
        self.assertCodemod(cpu_after(RETURN_BOTH), CPU_BEFORE)

    def test_nothing_to_remove(self) -> None:
        self.assertCodemod(CPU_BEFORE, CPU_BEFORE)


def test_crlf_and_tab_indented_cpu_py_round_trip() -> None:
    source = textwrap.dedent(CPU_BEFORE).replace("    ", "\t").replace("\n", "\r\n")
    patched = run_codemod(
        AddCpuIrOpPriority, source, context(VLLM_C_027).scratch[TREE_READER]
    )
    assert "\r\n" in patched and "\n" not in patched.replace("\r\n", "")
    assert "\tdef get_default_ir_op_priority(" in patched
    compile(patched, "cpu.py", "exec")
    assert run_codemod(RemoveCpuIrOpPriority, patched, None) == source


@pytest.mark.parametrize(
    "cpu,kernel,looked_for",
    [
        ("class XpuPlatform:\n    pass\n", KERNEL_CONFIG, "class CpuPlatform"),
        (
            CPU_BEFORE,
            "class IrOpPriorityConfig:\n    rms_norm: list[str]\n",
            "with_default",
        ),
        (CPU_BEFORE, "class Other:\n    pass\n", "with_default"),
        (
            CPU_BEFORE.replace("envs.VLLM_CPU_CI_ENV", "False"),
            KERNEL_CONFIG,
            "check_and_update_config testing VLLM_CPU_CI_ENV",
        ),
        (
            CPU_BEFORE,
            KERNEL_CONFIG.replace("rms_norm", "norm"),
            "fields of IrOpPriorityConfig",
        ),
    ],
    ids=[
        "no CpuPlatform",
        "no with_default",
        "no config class",
        "no CI check",
        "ops not in config",
    ],
)
def test_unknown_shapes(cpu: str, kernel: str, looked_for: str) -> None:
    files = {
        "vllm/kernels/vllm_c.py": VLLM_C_027,
        "vllm/config/kernel.py": kernel,
        "vllm/config/compilation.py": COMPILATION,
    }
    with pytest.raises(ShapeNotRecognised) as exc:
        run_codemod(AddCpuIrOpPriority, textwrap.dedent(cpu), files.__getitem__)
    assert looked_for in exc.value.looked_for
