"""AddCpuIrOpPriority / RemoveCpuIrOpPriority on cpu.py, before and after."""

from __future__ import annotations

import pytest
from libcst.codemod import CodemodContext, CodemodTest
from vllm_ruff import touched_lines_ruff_moves

from patcher.codemod import TREE_READER, run_codemod
from patcher.errors import ShapeNotRecognised, VllmHasItsOwn
from patches.cpu_fused_norms.cpu_priority import (
    AddCpuIrOpPriority,
    RemoveCpuIrOpPriority,
)

KERNEL = """class IrOpPriorityConfig:
    rms_norm: list[str] = Field(default_factory=list)
    fused_add_rms_norm: list[str] = Field(default_factory=list)

    @classmethod
    def with_default(cls, default, /, **kwargs): ...
"""
VLLM_C_027 = """@ir.ops.rms_norm.register_impl("vllm_c")
def rms_norm(x): ...
@ir.ops.fused_add_rms_norm.register_impl("vllm_c")
def f(x): ...
"""
VLLM_C_020 = """@ir.ops.rms_norm.register_impl("vllm_c")
def rms_norm(x): ...
"""
COMPILATION = "class CompilationMode: ...\n"


def files(vllm_c: str = VLLM_C_027, kernel: str = KERNEL) -> dict[str, str]:
    return {
        "vllm/kernels/vllm_c.py": vllm_c,
        "vllm/config/kernel.py": kernel,
        "vllm/config/compilation.py": COMPILATION,
    }


CASES = [
    pytest.param(
        VLLM_C_027,
        """
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
    def check_and_update_config(cls, vllm_config) -> None:
        if vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE:
            backend = "eager" if envs.VLLM_CPU_CI_ENV else "inductor"


def after_the_class():
    pass
""",
        """
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
    def check_and_update_config(cls, vllm_config) -> None:
        if vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE:
            backend = "eager" if envs.VLLM_CPU_CI_ENV else "inductor"

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

        return IrOpPriorityConfig.with_default(
            ["native"], rms_norm=default, fused_add_rms_norm=default
        )


def after_the_class():
    pass
""",
        id="0.24-0.32: both norms; envs.VLLM_CPU_CI_ENV",
    ),
    pytest.param(
        VLLM_C_020,
        """
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
    def check_and_update_config(cls, vllm_config) -> None:
        if vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE:
            backend = "eager" if envs.VLLM_CPU_CI_ENV else "inductor"


def after_the_class():
    pass
""",
        """
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
    def check_and_update_config(cls, vllm_config) -> None:
        if vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE:
            backend = "eager" if envs.VLLM_CPU_CI_ENV else "inductor"

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

        return IrOpPriorityConfig.with_default(["native"], rms_norm=default)


def after_the_class():
    pass
""",
        id="0.20: only rms_norm has a vllm_c impl",
    ),
    pytest.param(
        VLLM_C_027,
        """
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
    def check_and_update_config(cls, vllm_config) -> None:
        if vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE:
            backend = "eager" if os.environ.get("VLLM_CPU_CI_ENV", "0") != "0" else "inductor"


def after_the_class():
    pass
""",
        """
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
    def check_and_update_config(cls, vllm_config) -> None:
        if vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE:
            backend = "eager" if os.environ.get("VLLM_CPU_CI_ENV", "0") != "0" else "inductor"

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
            backend = (
                "eager" if os.environ.get("VLLM_CPU_CI_ENV", "0") != "0" else "inductor"
            )
        if vllm_config.lora_config is not None:
            mode = CompilationMode.NONE
        using_inductor = backend == "inductor" and mode != CompilationMode.NONE
        default = ["native"] if using_inductor else ["vllm_c", "native"]

        return IrOpPriorityConfig.with_default(
            ["native"], rms_norm=default, fused_add_rms_norm=default
        )


def after_the_class():
    pass
""",
        id="0.20-0.27: the CI check spelled with os.environ",
    ),
]


class TestPriority(CodemodTest):
    TRANSFORM = AddCpuIrOpPriority


def context(vllm_c: str) -> CodemodContext:
    return CodemodContext(
        filename=AddCpuIrOpPriority.TARGET,
        scratch={TREE_READER: files(vllm_c).__getitem__},
    )


@pytest.mark.parametrize("vllm_c,before,after", CASES)
def test_add(vllm_c: str, before: str, after: str) -> None:
    TestPriority().assertCodemod(before, after, context_override=context(vllm_c))


@pytest.mark.parametrize("vllm_c,before,after", CASES)
def test_add_again_changes_nothing(vllm_c: str, before: str, after: str) -> None:
    TestPriority().assertCodemod(after, after, context_override=context(vllm_c))


@pytest.mark.parametrize("vllm_c,before,after", CASES)
def test_remove(vllm_c: str, before: str, after: str) -> None:
    read = files(vllm_c).__getitem__
    assert run_codemod(RemoveCpuIrOpPriority, after, read) == before
    assert run_codemod(RemoveCpuIrOpPriority, before, read) == before


@pytest.mark.parametrize("vllm_c,before,after", CASES)
def test_the_method_is_laid_out_as_vllms_ruff_lays_it_out(vllm_c, before, after):
    """Written without a formatter: ruff would move none of its lines."""
    patched = run_codemod(AddCpuIrOpPriority, before, files(vllm_c).__getitem__)
    assert patched != before
    assert touched_lines_ruff_moves(before, patched) == []


VLLMS_OWN = """
from typing import TYPE_CHECKING

from .interface import Platform

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kernel import IrOpPriorityConfig


class CpuPlatform(Platform):
    @classmethod
    def get_default_ir_op_priority(cls, vllm_config) -> "IrOpPriorityConfig":
        return IrOpPriorityConfig.with_default(["vllm_c", "native"])

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        if vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE:
            backend = "eager" if envs.VLLM_CPU_CI_ENV else "inductor"
"""


@pytest.mark.parametrize("codemod", [AddCpuIrOpPriority, RemoveCpuIrOpPriority])
def test_vllms_own_method_is_said_and_left_alone(codemod) -> None:
    """Neither apply nor revert touches a method that is not this tool's."""
    with pytest.raises(VllmHasItsOwn, match="vLLM's own CpuPlatform"):
        run_codemod(codemod, VLLMS_OWN, files().__getitem__)


def test_crlf_and_tab_indented_cpu_py_round_trip() -> None:
    source = CASES[0].values[1].replace("    ", "\t").replace("\n", "\r\n")
    patched = run_codemod(AddCpuIrOpPriority, source, files().__getitem__)
    assert "\r\n" in patched and "\n" not in patched.replace("\r\n", "")
    assert "\tdef get_default_ir_op_priority(" in patched
    compile(patched, "cpu.py", "exec")
    assert (
        run_codemod(RemoveCpuIrOpPriority, patched, files().__getitem__) == source
    )


@pytest.mark.parametrize(
    "cpu,kernel,looked_for",
    [
        pytest.param(
            "class XpuPlatform:\n    pass\n",
            KERNEL,
            "class CpuPlatform",
            id="no CpuPlatform",
        ),
        pytest.param(
            CASES[0].values[1],
            "class IrOpPriorityConfig:\n    rms_norm: list[str]\n",
            "with_default",
            id="no with_default",
        ),
        pytest.param(
            CASES[0].values[1],
            "class Other:\n    pass\n",
            "with_default",
            id="no config class",
        ),
        pytest.param(
            CASES[0].values[1].replace("envs.VLLM_CPU_CI_ENV", "False"),
            KERNEL,
            "check_and_update_config testing VLLM_CPU_CI_ENV",
            id="no CI check",
        ),
        pytest.param(
            CASES[0].values[1],
            KERNEL.replace("rms_norm", "norm"),
            "fields of IrOpPriorityConfig",
            id="ops not in config",
        ),
    ],
)
def test_unknown_shapes(cpu: str, kernel: str, looked_for: str) -> None:
    with pytest.raises(ShapeNotRecognised) as exc:
        run_codemod(AddCpuIrOpPriority, cpu, files(kernel=kernel).__getitem__)
    assert looked_for in exc.value.looked_for
