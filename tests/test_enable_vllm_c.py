"""EnableVllmCOnCpu / DisableVllmCOnCpu on every source shape of vllm_c.py, before and after."""

from __future__ import annotations

import pytest
from libcst.codemod import CodemodTest

from patcher.codemod import run_codemod
from patcher.errors import ShapeNotRecognised
from patches.cpu_fused_norms.enable_vllm_c import DisableVllmCOnCpu, EnableVllmCOnCpu

HEADER = """
from vllm import ir
from vllm.platforms import current_platform

CUDA_ALIKE = current_platform.is_cuda_alike()
"""
# What apply adds after the module's last platform fact (CUDA_ALIKE here).
HEADER_CPU = (
    HEADER
    + """IS_CPU = current_platform.is_cpu()
\"\"\"CPU kernels ignore strides: they only take contiguous inputs.\"\"\"
"""
)
CHECK = """
rms_no_var_size = lambda x, weight, epsilon, variance_size=None: (
    variance_size is None and (weight is None or weight.dtype == x.dtype)
)
"""
CHECK_CPU = """
rms_no_var_size = lambda x, weight, epsilon, variance_size=None: (
    variance_size is None
    and (weight is None or weight.dtype == x.dtype)
    and (not IS_CPU or x.is_contiguous())
)
"""
ADD_CHECK = """
rms_add_no_var_size = lambda x, x_residual, weight, epsilon, variance_size=None: (
    variance_size is None and weight is None
)
\"\"\"No variance_size, no weight.\"\"\"
"""
ADD_CHECK_CPU = """
rms_add_no_var_size = lambda x, x_residual, weight, epsilon, variance_size=None: (
    variance_size is None
    and weight is None
    and (not IS_CPU or (x.is_contiguous() and x_residual.is_contiguous()))
)
\"\"\"No variance_size, no weight. On CPU, x and x_residual must also be contiguous.\"\"\"
"""
RMS_NORM = """

@ir.ops.rms_norm.register_impl("vllm_c", supported=GPGPU_DEVICE, supports_args=rms_no_var_size)
def rms_norm(x, weight, epsilon, variance_size=None): ...
"""

# (name, before, after, reverted): every test below runs them both ways. The
# revert gives ``before`` back where it was in ruff's layout, else ``reverted``
# (ruff's layout of it: the engine restores the bytes from its backup then).
CASES = [
    (
        "0.20: the one norm gets its own gate; an older ruff's lambda layout "
        "becomes the pinned ruff's",
        HEADER
        + """
rms_no_var_size = (
    lambda x, weight, epsilon, variance_size=None: variance_size is None
    and (weight is None or weight.dtype == x.dtype)
)


@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=rms_no_var_size, supported=CUDA_ALIKE
)
def rms_norm(x, weight, epsilon, variance_size=None): ...
""",
        HEADER_CPU
        + CHECK_CPU
        + """

RMS_NORM_DEVICE = CUDA_ALIKE or IS_CPU


@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=rms_no_var_size, supported=RMS_NORM_DEVICE
)
def rms_norm(x, weight, epsilon, variance_size=None): ...
""",
        HEADER
        + CHECK
        + """

@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=rms_no_var_size, supported=CUDA_ALIKE
)
def rms_norm(x, weight, epsilon, variance_size=None): ...
""",
    ),
    (
        "0.24: CUDA_ALIKE also gates gelu_and_mul: the norms get their own gate",
        HEADER
        + CHECK
        + ADD_CHECK
        + """

@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=rms_no_var_size, supported=CUDA_ALIKE
)
def rms_norm(x, weight, epsilon, variance_size=None): ...


@ir.ops.fused_add_rms_norm.register_impl(
    "vllm_c",
    supports_args=rms_add_no_var_size,
    supported=CUDA_ALIKE,
    inplace=True,
)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...


@ir.ops.gelu_and_mul.register_impl("vllm_c", supports_args=rms_no_var_size, supported=CUDA_ALIKE)
def gelu_and_mul(x): ...
""",
        HEADER_CPU
        + CHECK_CPU
        + ADD_CHECK_CPU
        + """

RMS_NORM_DEVICE = CUDA_ALIKE or IS_CPU


@ir.ops.rms_norm.register_impl(
    "vllm_c", supports_args=rms_no_var_size, supported=RMS_NORM_DEVICE
)
def rms_norm(x, weight, epsilon, variance_size=None): ...


@ir.ops.fused_add_rms_norm.register_impl(
    "vllm_c",
    supports_args=rms_add_no_var_size,
    supported=RMS_NORM_DEVICE,
    inplace=True,
)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...


@ir.ops.gelu_and_mul.register_impl("vllm_c", supports_args=rms_no_var_size, supported=CUDA_ALIKE)
def gelu_and_mul(x): ...
""",
        None,
    ),
    (
        "0.27+: GPGPU_DEVICE gains IS_CPU, XPU-only quant impl stays",
        HEADER
        + "GPGPU_DEVICE = CUDA_ALIKE or current_platform.is_xpu()\n"
        + CHECK
        + ADD_CHECK
        + """

@ir.ops.fused_add_rms_norm.register_impl(
    "vllm_c", supports_args=rms_add_no_var_size, supported=GPGPU_DEVICE, inplace=True
)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...


@ir.ops.static_scaled_fp8_quant.register_impl(
    "vllm_c", supported=current_platform.is_xpu()
)
def static_scaled_fp8_quant(x, scale): ...
"""
        + RMS_NORM,
        HEADER_CPU
        + "GPGPU_DEVICE = CUDA_ALIKE or current_platform.is_xpu() or IS_CPU\n"
        + CHECK_CPU
        + ADD_CHECK_CPU
        + """

@ir.ops.fused_add_rms_norm.register_impl(
    "vllm_c", supports_args=rms_add_no_var_size, supported=GPGPU_DEVICE, inplace=True
)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...


@ir.ops.static_scaled_fp8_quant.register_impl(
    "vllm_c", supported=current_platform.is_xpu()
)
def static_scaled_fp8_quant(x, scale): ...
"""
        + RMS_NORM,
        None,
    ),
    (
        "multi-line GPGPU_DEVICE keeps each comment on its line; the decorator "
        "holding the lambda is laid out as ruff does",
        HEADER
        + """
GPGPU_DEVICE = (
    CUDA_ALIKE  # CUDA and ROCm
    or current_platform.is_xpu()  # Intel GPUs
)


@ir.ops.rms_norm.register_impl("vllm_c", supported=GPGPU_DEVICE, supports_args=lambda x, weight, eps: True,)
def rms_norm(x, weight, epsilon, variance_size=None): ...
""",
        HEADER_CPU
        + """
GPGPU_DEVICE = (
    CUDA_ALIKE  # CUDA and ROCm
    or current_platform.is_xpu()  # Intel GPUs
    or IS_CPU
)


@ir.ops.rms_norm.register_impl(
    "vllm_c",
    supported=GPGPU_DEVICE,
    supports_args=lambda x, weight, eps: True and (not IS_CPU or x.is_contiguous()),
)
def rms_norm(x, weight, epsilon, variance_size=None): ...
""",
        HEADER
        + """
GPGPU_DEVICE = (
    CUDA_ALIKE  # CUDA and ROCm
    or current_platform.is_xpu()  # Intel GPUs
)


@ir.ops.rms_norm.register_impl(
    "vllm_c",
    supported=GPGPU_DEVICE,
    supports_args=lambda x, weight, eps: True,
)
def rms_norm(x, weight, epsilon, variance_size=None): ...
""",
    ),
    (
        "statements not in ruff's layout (redundant parentheses, one operand "
        "over lines, a line over 88 columns) come out in ruff's",
        HEADER
        + """GPGPU_DEVICE = (
    CUDA_ALIKE
)
check = lambda x, weight, eps: (eps > 0)
add_check = lambda x, x_residual, weight, epsilon, variance_size=None: variance_size is None


@ir.ops.rms_norm.register_impl('vllm_c', supported=GPGPU_DEVICE, supports_args=check)
def rms_norm(x, weight, epsilon, variance_size=None): ...


@ir.ops.fused_add_rms_norm.register_impl('vllm_c', supported=GPGPU_DEVICE, supports_args=add_check)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...
""",
        HEADER_CPU
        + """GPGPU_DEVICE = CUDA_ALIKE or IS_CPU
check = lambda x, weight, eps: eps > 0 and (not IS_CPU or x.is_contiguous())
add_check = lambda x, x_residual, weight, epsilon, variance_size=None: (
    variance_size is None
    and (not IS_CPU or (x.is_contiguous() and x_residual.is_contiguous()))
)


@ir.ops.rms_norm.register_impl('vllm_c', supported=GPGPU_DEVICE, supports_args=check)
def rms_norm(x, weight, epsilon, variance_size=None): ...


@ir.ops.fused_add_rms_norm.register_impl('vllm_c', supported=GPGPU_DEVICE, supports_args=add_check)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...
""",
        HEADER
        + """GPGPU_DEVICE = CUDA_ALIKE
check = lambda x, weight, eps: eps > 0
add_check = lambda x, x_residual, weight, epsilon, variance_size=None: (
    variance_size is None
)


@ir.ops.rms_norm.register_impl('vllm_c', supported=GPGPU_DEVICE, supports_args=check)
def rms_norm(x, weight, epsilon, variance_size=None): ...


@ir.ops.fused_add_rms_norm.register_impl('vllm_c', supported=GPGPU_DEVICE, supports_args=add_check)
def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None): ...
""",
    ),
]
IDS = [c[0] for c in CASES]


class TestEnable(CodemodTest):
    TRANSFORM = EnableVllmCOnCpu

    def test_cases(self) -> None:
        for name, before, after, _ in CASES:
            with self.subTest(name):
                self.assertCodemod(before, after)

    def test_half_patched_file_is_completed_not_doubled(self) -> None:
        _, before, after, _ = CASES[1]  # 0.24: two norms, each with its own check
        half = after.replace(ADD_CHECK_CPU, ADD_CHECK)
        assert half not in (before, after)
        self.assertCodemod(half, after)

    def test_already_patched_is_unchanged(self) -> None:
        for name, _, after, _ in CASES:
            with self.subTest(name):
                self.assertCodemod(after, after)


class TestDisable(CodemodTest):
    TRANSFORM = DisableVllmCOnCpu

    def test_cases_reverse(self) -> None:
        for name, before, after, reverted in CASES:
            with self.subTest(name):
                self.assertCodemod(after, reverted or before)

    def test_unpatched_is_unchanged(self) -> None:
        for name, before, _, _ in CASES:
            with self.subTest(name):
                self.assertCodemod(before, before)


@pytest.mark.parametrize("before,after,reverted", [c[1:] for c in CASES], ids=IDS)
def test_crlf_files_stay_crlf_and_round_trip(before, after, reverted) -> None:
    def crlf(text: str) -> str:
        return text.replace("\n", "\r\n")

    patched = run_codemod(EnableVllmCOnCpu, crlf(before), read_tree_file=None)
    assert patched == crlf(after)
    back = run_codemod(DisableVllmCOnCpu, patched, read_tree_file=None)
    assert back == crlf(reverted or before)


@pytest.mark.parametrize(
    "source,looked_for,found",
    [
        (
            HEADER + "IS_CPU = False\n"
            "@ir.ops.rms_norm.register_impl(\n"
            '    "vllm_c", supported=CUDA_ALIKE, supports_args=lambda x, w: True\n)\n'
            "def rms_norm(x): ...\n",
            "IS_CPU unassigned, or `IS_CPU = current_platform.is_cpu()`",
            "IS_CPU = False",
        ),
        (HEADER + "X = 1\n", 'register_impl("vllm_c"', "no @ir.ops"),
        (
            HEADER
            + '@ir.ops.gelu_and_mul.register_impl("vllm_c", supported=CUDA_ALIKE)\n'
            "def gelu_and_mul(x): ...\n",
            "rms_norm",
            "vllm_c impls for gelu_and_mul",
        ),
        (
            HEADER + '@ir.ops.rms_norm.register_impl("vllm_c")\ndef rms_norm(x): ...\n',
            "supported= in",
            "without supported=",
        ),
        (
            '@ir.ops.rms_norm.register_impl("vllm_c", supported=True)\n'
            "def rms_norm(x): ...\n",
            "current_platform",
            "no current_platform",
        ),
        (
            HEADER + '@ir.ops.rms_norm.register_impl("vllm_c", supported=CUDA_ALIKE)\n'
            "def rms_norm(x): ...\n",
            "supports_args= in",
            "without supports_args=",
        ),
        (
            HEADER + "@ir.ops.rms_norm.register_impl(\n"
            '    "vllm_c", supported=CUDA_ALIKE, supports_args=make_check()\n)\n'
            "def rms_norm(x): ...\n",
            "a lambda or def as the rms_norm impl's supports_args",
            "make_check()",
        ),
        (
            HEADER + "@ir.ops.fused_add_rms_norm.register_impl(\n"
            '    "vllm_c", supported=CUDA_ALIKE, supports_args=lambda x: True\n)\n'
            "def fused_add_rms_norm(x): ...\n",
            "taking its 2 input tensor(s) first",
            "parameters ['x']",
        ),
        (
            HEADER + "@ir.ops.rms_norm.register_impl(\n"
            '    "vllm_c", supported=CUDA_ALIKE, supports_args=lambda x, w: True\n)\n'
            "def rms_norm(x): ...\n"
            "@ir.ops.fused_add_rms_norm.register_impl(\n"
            '    "vllm_c", supported=current_platform.is_cuda(), supports_args=lambda x, r: True\n)\n'
            "def fused_add_rms_norm(x): ...\n",
            "norms sharing one gate",
            "rms_norm: CUDA_ALIKE, fused_add_rms_norm: current_platform.is_cuda()",
        ),
        (
            HEADER + "check = lambda x, w: True\n"
            '@ir.ops.rms_norm.register_impl("vllm_c", supported=CUDA_ALIKE, supports_args=check)\n'
            "def rms_norm(x): ...\n"
            '@ir.ops.gelu_new.register_impl("vllm_c", supported=current_platform.is_cpu(), supports_args=check)\n'
            "def gelu_new(x): ...\n",
            "that no impl supported on CPU shares",
            "check is also the supports_args of gelu_new",
        ),
        (
            HEADER
            + "def check(x, w):\n    if x:\n        return False\n    return True\n"
            '@ir.ops.rms_norm.register_impl("vllm_c", supported=CUDA_ALIKE, supports_args=check)\n'
            "def rms_norm(x): ...\n",
            "def check (the rms_norm impl's supports_args) returning one expression",
            "a body of 2 statement(s)",
        ),
        (
            HEADER + "@ir.ops.rms_norm.register_impl(\n"
            '    "vllm_c", supported=CUDA_ALIKE, supports_args=lambda x, weight: a or b\n)\n'
            "def rms_norm(x): ...\n",
            "to extend: `... and X`",
            "a or b",
        ),
    ],
    ids=[
        "IS_CPU is something else",
        "no vllm_c impls",
        "no norm impls",
        "no supported=",
        "no current_platform",
        "no supports_args=",
        "supports_args not a lambda",
        "too few tensor parameters",
        "norms behind different gates",
        "check shared with an impl on CPU",
        "def check with more than a return",
        "`or` body would bind wrong",
    ],
)
def test_unknown_shapes_name_what_was_looked_for(source, looked_for, found) -> None:
    with pytest.raises(ShapeNotRecognised) as exc:
        run_codemod(EnableVllmCOnCpu, source, read_tree_file=None)
    assert exc.value.path == "vllm/kernels/vllm_c.py"
    assert looked_for in exc.value.looked_for
    assert found in exc.value.found


def test_a_gate_that_is_not_only_platform_checks_gets_the_cpu_gate_too() -> None:
    """flag() may say anything on CPU; ``flag() or current_platform.is_cpu()``
    is flag() everywhere else."""
    source = HEADER + (
        "@ir.ops.rms_norm.register_impl(\n"
        '    "vllm_c",\n'
        "    supported=flag(),\n"
        "    supports_args=lambda x, w: True,\n"
        ")\n"
        "def rms_norm(x): ...\n"
    )
    patched = run_codemod(EnableVllmCOnCpu, source, read_tree_file=None)
    assert "RMS_NORM_DEVICE = flag() or IS_CPU\n" in patched
    assert run_codemod(DisableVllmCOnCpu, patched, read_tree_file=None) == source


def test_revert_leaves_a_cpu_gate_it_did_not_add() -> None:
    source = HEADER + (
        "GPGPU_DEVICE = current_platform.is_cpu() or CUDA_ALIKE\n\n\n"
        "@ir.ops.rms_norm.register_impl(\n"
        '    "vllm_c", supported=GPGPU_DEVICE, supports_args=lambda x, weight: True\n)\n'
        "def rms_norm(x): ...\n"
    )
    assert run_codemod(DisableVllmCOnCpu, source, read_tree_file=None) == source
