"""EnableVllmCOnCpu / DisableVllmCOnCpu on the shapes of vllm_c.py vLLM 0.20 -
0.32 ship, before and after."""

from __future__ import annotations

import ast

import libcst as cst
import pytest
from libcst.codemod import CodemodContext, CodemodTest
from vllm_ruff import touched_lines_ruff_moves

from patcher.codemod import TREE_READER, run_codemod
from patcher.errors import ShapeNotRecognised
from patches import cpu_norm_source
from patches.cpu_fused_norms.enable_vllm_c import (
    DisableVllmCOnCpu,
    EnableVllmCOnCpu,
)

CASES = [
    pytest.param(
        '''
import torch

from vllm import ir
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
"""Most kernels in this file are supported on all CUDA-alike platforms."""
IS_ROCM = current_platform.is_rocm()
"""ROCm needs shape normalization before calling some vLLM C kernels."""
GPGPU_DEVICE = CUDA_ALIKE or current_platform.is_xpu()

rms_no_var_size = lambda x, weight, epsilon, variance_size=None: (
    variance_size is None and (weight is None or weight.dtype == x.dtype)
)
"""vLLM kernel requires no variance_size override and matching input/weight dtype."""


@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=rms_no_var_size, supported=GPGPU_DEVICE
)
def rms_norm(x, weight, epsilon, variance_size=None): ...


rms_add_no_var_size = lambda x, x_residual, weight, epsilon, variance_size=None: (
    variance_size is None and (weight is None or weight.dtype == x.dtype)
)


@ir.ops.fused_add_rms_norm.register_impl(
    "vllm_c",
    supports_args=rms_add_no_var_size,
    supported=GPGPU_DEVICE,
    inplace=True,
)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...
''',
        '''
import functools
import os

import torch

from vllm import ir
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
"""Most kernels in this file are supported on all CUDA-alike platforms."""
IS_ROCM = current_platform.is_rocm()
"""ROCm needs shape normalization before calling some vLLM C kernels."""
IS_CPU = current_platform.is_cpu()
GPGPU_DEVICE = CUDA_ALIKE or current_platform.is_xpu() or IS_CPU


# <the rule's functions>


CPU_DTYPES = () if cpu_threads_shared() else cpu_norm_dtypes()
"""The dtypes in which the CPU kernels match native here, once per process."""

rms_no_var_size = lambda x, weight, epsilon, variance_size=None: (
    variance_size is None
    and (weight is None or weight.dtype == x.dtype)
    and (
        not IS_CPU
        or (
            weight is not None
            and x.dtype in CPU_DTYPES
            and weight.dtype == x.dtype
            and x.shape[-1] % 8 == 0
            and x.is_contiguous()
        )
    )
)
"""vLLM kernel requires no variance_size override and matching input/weight dtype."""


@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=rms_no_var_size, supported=GPGPU_DEVICE
)
def rms_norm(x, weight, epsilon, variance_size=None): ...


rms_add_no_var_size = lambda x, x_residual, weight, epsilon, variance_size=None: (
    variance_size is None
    and (weight is None or weight.dtype == x.dtype)
    and (
        not IS_CPU
        or (
            weight is not None
            and x.dtype in CPU_DTYPES
            and weight.dtype == x.dtype
            and x.shape[-1] % 8 == 0
            and x.is_contiguous()
            and x_residual.dtype == x.dtype
            and x_residual.is_contiguous()
        )
    )
)


@ir.ops.fused_add_rms_norm.register_impl(
    "vllm_c",
    supports_args=rms_add_no_var_size,
    supported=GPGPU_DEVICE,
    inplace=True,
)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...
''',
        id="0.27-0.32: GPGPU_DEVICE, which only the norms use, gains `or IS_CPU`",
    ),
    pytest.param(
        '''
import torch

from vllm import ir
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
"""Most kernels in this file are supported on all CUDA-alike platforms."""
IS_ROCM = current_platform.is_rocm()
"""ROCm needs shape normalization before calling some vLLM C kernels."""

rms_no_var_size = lambda x, weight, epsilon, variance_size=None: (
    variance_size is None and (weight is None or weight.dtype == x.dtype)
)


@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=rms_no_var_size, supported=CUDA_ALIKE
)
def rms_norm(x, weight, epsilon, variance_size=None): ...


rms_add_no_var_size = lambda x, x_residual, weight, epsilon, variance_size=None: (
    variance_size is None and (weight is None or weight.dtype == x.dtype)
)


@ir.ops.fused_add_rms_norm.register_impl(
    "vllm_c",
    supports_args=rms_add_no_var_size,
    supported=CUDA_ALIKE,
    inplace=True,
)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...
''',
        '''
import functools
import os

import torch

from vllm import ir
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
"""Most kernels in this file are supported on all CUDA-alike platforms."""
IS_ROCM = current_platform.is_rocm()
"""ROCm needs shape normalization before calling some vLLM C kernels."""
IS_CPU = current_platform.is_cpu()


# <the rule's functions>


CPU_DTYPES = () if cpu_threads_shared() else cpu_norm_dtypes()
"""The dtypes in which the CPU kernels match native here, once per process."""

rms_no_var_size = lambda x, weight, epsilon, variance_size=None: (
    variance_size is None
    and (weight is None or weight.dtype == x.dtype)
    and (
        not IS_CPU
        or (
            weight is not None
            and x.dtype in CPU_DTYPES
            and weight.dtype == x.dtype
            and x.shape[-1] % 8 == 0
            and x.is_contiguous()
        )
    )
)


RMS_NORM_DEVICE = CUDA_ALIKE or IS_CPU


@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=rms_no_var_size, supported=RMS_NORM_DEVICE
)
def rms_norm(x, weight, epsilon, variance_size=None): ...


rms_add_no_var_size = lambda x, x_residual, weight, epsilon, variance_size=None: (
    variance_size is None
    and (weight is None or weight.dtype == x.dtype)
    and (
        not IS_CPU
        or (
            weight is not None
            and x.dtype in CPU_DTYPES
            and weight.dtype == x.dtype
            and x.shape[-1] % 8 == 0
            and x.is_contiguous()
            and x_residual.dtype == x.dtype
            and x_residual.is_contiguous()
        )
    )
)


@ir.ops.fused_add_rms_norm.register_impl(
    "vllm_c",
    supports_args=rms_add_no_var_size,
    supported=RMS_NORM_DEVICE,
    inplace=True,
)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...
''',
        id="0.24-0.26: CUDA_ALIKE keeps its meaning, the norms get their own gate",
    ),
    pytest.param(
        '''
import torch

from vllm import ir
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
"""Most kernels in this file are supported on all CUDA-alike platforms."""

rms_no_var_size = (
    lambda x, weight, epsilon, variance_size=None: variance_size is None
    and (weight is None or weight.dtype == x.dtype)
)


@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=rms_no_var_size, supported=CUDA_ALIKE
)
def rms_norm(x, weight, epsilon, variance_size=None): ...
''',
        '''
import functools
import os

import torch

from vllm import ir
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
"""Most kernels in this file are supported on all CUDA-alike platforms."""
IS_CPU = current_platform.is_cpu()


# <the rule's functions>


CPU_DTYPES = () if cpu_threads_shared() else cpu_norm_dtypes()
"""The dtypes in which the CPU kernels match native here, once per process."""

rms_no_var_size = lambda x, weight, epsilon, variance_size=None: (
    variance_size is None
    and (weight is None or weight.dtype == x.dtype)
    and (
        not IS_CPU
        or (
            weight is not None
            and x.dtype in CPU_DTYPES
            and weight.dtype == x.dtype
            and x.shape[-1] % 8 == 0
            and x.is_contiguous()
        )
    )
)


RMS_NORM_DEVICE = CUDA_ALIKE or IS_CPU


@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=rms_no_var_size, supported=RMS_NORM_DEVICE
)
def rms_norm(x, weight, epsilon, variance_size=None): ...
''',
        id="0.20: rms_norm only; an older ruff's predicate comes out in ruff's layout",
    ),
]


# The tree's cpu.py (here without vLLM's per-CPU-class x86 builds), which the
# rule's per-process function reads.
READ = {"vllm/platforms/cpu.py": "class CpuPlatform:\n    pass\n"}.__getitem__
# The rule's two functions as the codemod writes them for this cpu.py (one x86
# build), read from patches/cpu_norm_rule.py: the cases mark their place.
FUNCTIONS = "\n\n".join(
    cst.Module([]).code_for_node(f)
    for f in cpu_norm_source.functions(READ("vllm/platforms/cpu.py"))
)
CASES = [
    pytest.param(
        before, after.replace("# <the rule's functions>\n", FUNCTIONS), id=case.id
    )
    for case in CASES
    for before, after in [case.values]
]


def same_code(a: str, b: str) -> bool:
    return ast.dump(ast.parse(a)) == ast.dump(ast.parse(b))


class TestEnable(CodemodTest):
    TRANSFORM = EnableVllmCOnCpu


class TestDisable(CodemodTest):
    TRANSFORM = DisableVllmCOnCpu


def context() -> CodemodContext:
    return CodemodContext(scratch={TREE_READER: READ})


@pytest.mark.parametrize("before,after", CASES)
def test_apply(before: str, after: str) -> None:
    TestEnable().assertCodemod(before, after, context_override=context())


@pytest.mark.parametrize("before,after", CASES)
def test_apply_again_changes_nothing(before: str, after: str) -> None:
    TestEnable().assertCodemod(after, after, context_override=context())


@pytest.mark.parametrize("before,after", CASES)
def test_revert_gives_the_same_code_back(before: str, after: str) -> None:
    """The same bytes where the tree was in ruff's layout; the same Python
    always (the engine restores the bytes from its backup)."""
    reverted = run_codemod(DisableVllmCOnCpu, after, READ)
    assert same_code(reverted, before)
    assert run_codemod(EnableVllmCOnCpu, reverted, READ) == after


@pytest.mark.parametrize("before,after", CASES)
def test_what_apply_and_revert_write_is_laid_out_as_vllms_ruff(before, after):
    """Written without a formatter: ruff would move none of the lines apply
    writes or revert writes back (in a file that starts with its first line)."""
    patched = run_codemod(EnableVllmCOnCpu, before.lstrip(), READ)
    assert patched != before.lstrip()
    assert touched_lines_ruff_moves(before.lstrip(), patched) == []
    reverted = run_codemod(DisableVllmCOnCpu, patched, READ)
    assert touched_lines_ruff_moves(patched, reverted) == []


def test_revert_of_an_unpatched_file_changes_nothing() -> None:
    before = CASES[0].values[0]
    TestDisable().assertCodemod(before, before)


def test_crlf_round_trips() -> None:
    before, after = (text.replace("\n", "\r\n") for text in CASES[0].values)
    assert run_codemod(EnableVllmCOnCpu, before, READ) == after
    assert run_codemod(DisableVllmCOnCpu, after, READ) == before


@pytest.mark.parametrize(
    "source,looked_for,found",
    [
        pytest.param(
            """import torch
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
IS_CPU = False
check = lambda x, w: True


@ir.ops.rms_norm.register_impl("vllm_c", supports_args=check, supported=CUDA_ALIKE)
def rms_norm(x): ...
""",
            "IS_CPU unassigned, or `IS_CPU = current_platform.is_cpu()`",
            "IS_CPU = False",
            id="IS_CPU is something else",
        ),
        pytest.param(
            """import torch
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
""",
            'register_impl("vllm_c"',
            "no such impl",
            id="no norm impls",
        ),
        pytest.param(
            """import torch
from vllm.platforms import current_platform

check = lambda x, w: True


@ir.ops.rms_norm.register_impl("vllm_c", supports_args=check)
def rms_norm(x): ...
""",
            "supported=NAME in",
            "none",
            id="no supported=",
        ),
        pytest.param(
            """import torch

check = lambda x, w: True


@ir.ops.rms_norm.register_impl("vllm_c", supports_args=check, supported=True)
def rms_norm(x): ...
""",
            "current_platform",
            "none",
            id="no current_platform",
        ),
        pytest.param(
            """import torch
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()


@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=lambda x, w: True, supported=CUDA_ALIKE
)
def rms_norm(x): ...
""",
            "supports_args=NAME in",
            "lambda x, w: True",
            id="supports_args written in the decorator",
        ),
        pytest.param(
            """import torch
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
check = make_check()


@ir.ops.rms_norm.register_impl("vllm_c", supports_args=check, supported=CUDA_ALIKE)
def rms_norm(x): ...
""",
            "rms_norm's supports_args a module-level lambda",
            "check",
            id="supports_args not a lambda",
        ),
        pytest.param(
            """import torch
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
check = lambda x: True


@ir.ops.fused_add_rms_norm.register_impl(
    "vllm_c", supports_args=check, supported=CUDA_ALIKE
)
def fused_add_rms_norm(x): ...
""",
            "taking its input tensors, then the weight",
            "x",
            id="too few tensor parameters",
        ),
        pytest.param(
            """import torch
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
IS_CUDA = current_platform.is_cuda()
check = lambda x, w: True
add_check = lambda x, r, w: True


@ir.ops.rms_norm.register_impl("vllm_c", supports_args=check, supported=CUDA_ALIKE)
def rms_norm(x): ...


@ir.ops.fused_add_rms_norm.register_impl(
    "vllm_c", supports_args=add_check, supported=IS_CUDA
)
def fused_add_rms_norm(x): ...
""",
            "the norms gated by one name",
            "CUDA_ALIKE, IS_CUDA",
            id="norms behind different gates",
        ),
        pytest.param(
            """import torch
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
GPGPU_DEVICE = CUDA_ALIKE
check = lambda x, w: True


@ir.ops.rms_norm.register_impl("vllm_c", supports_args=check, supported=GPGPU_DEVICE)
def rms_norm(x): ...


@ir.ops.silu_and_mul.register_impl("vllm_c", supported=GPGPU_DEVICE)
def silu_and_mul(x): ...
""",
            "GPGPU_DEVICE gating only the norms",
            "3 uses",
            id="GPGPU_DEVICE also gates a kernel the CPU build lacks",
        ),
    ],
)
def test_unknown_shapes_name_what_was_looked_for(source, looked_for, found) -> None:
    with pytest.raises(ShapeNotRecognised) as exc:
        run_codemod(EnableVllmCOnCpu, source, READ)
    assert exc.value.path == "vllm/kernels/vllm_c.py"
    assert looked_for in exc.value.looked_for
    assert found in exc.value.found
