"""The CustomOp form's codemods (patches/rms_norm_forward_cpu/forward_cpu.py)
on small layernorm.py sources, and the rule they write (rule.py): no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patcher.codemod import run_codemod
from patcher.errors import VllmHasItsOwn
from patches.rms_norm_forward_cpu import rule
from patches.rms_norm_forward_cpu.forward_cpu import (
    AddRmsNormForwardCpu,
    RemoveRmsNormForwardCpu,
)

ROOT = Path(__file__).resolve().parent.parent

LAYERNORM = """\
import torch

from vllm import envs
from vllm.model_executor.custom_op import CustomOp


# --8<-- [start:rms_norm]
@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, has_weight: bool = True) -> None:
        super().__init__()
        self.has_weight = has_weight
        self.variance_size_override = None

    def forward_native(self, x, residual=None):
        return x
{own}
"""
OWN = """
    def forward_cpu(self, x, residual=None):
        return self.forward_native(x, residual)
"""
PER_ISA = "import vllm._C_AVX512  # noqa: F401\n"  # cpu.py from 0.19 on
ONE_BUILD = "import vllm._C  # noqa: F401\n"


def apply(source: str, cpu_py: str = PER_ISA) -> str:
    return run_codemod(AddRmsNormForwardCpu, source, lambda rel: cpu_py)


def revert(source: str, cpu_py: str = PER_ISA) -> str:
    return run_codemod(RemoveRmsNormForwardCpu, source, lambda rel: cpu_py)


def methods(source: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize(
    "cpu_py, x86_rounds",
    [(PER_ISA, True), (ONE_BUILD, False)],
    ids=["per-ISA", "one build"],
)
def test_apply_writes_the_rule_and_revert_takes_it_back(cpu_py, x86_rounds):
    before = LAYERNORM.format(own="")
    after = apply(before, cpu_py)
    assert "def cpu_fused_norm_dtypes()" in after
    assert after.index("def cpu_fused_norm_dtypes()") < after.index("# --8<--")
    assert ("_is_avx512_bf16_supported()" in after) is x86_rounds
    found = methods(after)
    assert ast.dump(found["forward_cpu"]) == ast.dump(
        ast.parse(rule.FORWARD_CPU).body[0]
    )
    init_tail = found["__init__"].body[-1]
    assert ast.dump(init_tail) == ast.dump(
        ast.parse(
            rule.INIT_LINES.format(batch_invariant="envs.VLLM_BATCH_INVARIANT")
        ).body[0]
    )
    assert apply(after, cpu_py) == after  # applied already
    assert revert(after, cpu_py) == before


@pytest.mark.parametrize("direction", [apply, revert], ids=["apply", "revert"])
def test_a_forward_cpu_of_vllms_own_is_left_alone(direction):
    """A vLLM that ships its own RMSNorm.forward_cpu: neither direction edits;
    the engine reports it (``VllmHasItsOwn``)."""
    with pytest.raises(VllmHasItsOwn, match="vLLM's own RMSNorm.forward_cpu"):
        direction(LAYERNORM.format(own=OWN))


def test_the_rule_as_python():
    """The per-call text compiles into the predicate the tests use; the x86
    rounding check only where vLLM loads a build per CPU class."""
    source = rule.call_checks("x", "w", "D", "r", weight_may_be_none=True)
    assert source.startswith("w is not None and x.dtype in D")
    assert "x.shape[-1] % 8 == 0" in source and "r.is_contiguous()" in source
    assert rule.X86_ROUNDS.strip() in rule.dtypes_function(PER_ISA)
    assert "X86 and" not in rule.dtypes_function(ONE_BUILD)
    ast.parse(rule.dtypes_function(ONE_BUILD))


def test_without_the_opt_in_the_provider_loads_nothing():
    """vLLM calls the plugin in every process: off, it imports neither torch
    nor vLLM."""
    code = textwrap.dedent(
        """
        import sys
        from patches.cpu_fused_norms import provider
        provider.register()
        print(sorted(m for m in ("torch", "vllm") if m in sys.modules))
        print(provider.status())
        """
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    imported, status = proc.stdout.splitlines()
    assert imported == "[]"
    assert "'opt_in': False" in status and "'route': None" in status
