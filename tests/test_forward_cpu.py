"""The CustomOp form's codemods (patches/rms_norm_forward_cpu/forward_cpu.py)
on small layernorm.py sources, and the rule they write (cpu_norm_rule.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patcher.codemod import run_codemod
from patcher.errors import VllmHasItsOwn
from patches import cpu_norm_source as rule
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
    for name in rule.FUNCTIONS:
        assert after.index(f"def {name}()") < after.index("# --8<--")
    assert after.startswith("import functools\nimport os\n\nimport torch\n")
    x86 = "rounds_bf16 = torch.cpu._is_avx512_bf16_supported()"
    assert (x86 in after) is x86_rounds
    found = methods(after)
    assert ast.dump(found["forward_cpu"]) == ast.dump(_rule_def("forward_cpu"))
    bind = _rule_def("bind_cpu_ops").body[1:]  # its docstring stays behind
    assert [ast.dump(s) for s in found["__init__"].body[-len(bind) :]] == [
        ast.dump(s) for s in bind
    ]
    assert apply(after, cpu_py) == after  # applied already
    assert revert(after, cpu_py) == before


def _rule_def(name: str) -> ast.FunctionDef:
    tree = ast.parse(rule.RULE_FILE.read_text())
    mixin = next(n for n in tree.body if getattr(n, "name", "") == rule.MIXIN)
    return next(n for n in mixin.body if getattr(n, "name", "") == name)


def test_batch_invariance_is_spelled_as_the_tree_imports_it():
    source = LAYERNORM.format(own="").replace(
        "from vllm import envs\n",
        "from vllm.model_executor.layers.batch_invariant import (\n"
        "    vllm_is_batch_invariant,\n)\n",
    )
    after = apply(source)
    assert "and not vllm_is_batch_invariant()" in after
    assert "envs." not in after
    assert revert(after) == source


OWN_FORMS = {
    "def": OWN,
    "assignment after": "\n    forward_cpu = forward_native\n",
    "annotated": "\n    forward_cpu: Callable = forward_native\n",
    "annotation only": "\n    forward_cpu: Callable\n",
    "import": "\n    from vllm.cpu_norms import forward_cpu\n",
    "decorated def": "\n    @staticmethod\n    def forward_cpu(x, residual=None):\n"
    "        return x\n",
    "in an if": "\n    if True:\n        forward_cpu = forward_native\n",
}


@pytest.mark.parametrize("own", OWN_FORMS.values(), ids=OWN_FORMS.keys())
@pytest.mark.parametrize("direction", [apply, revert], ids=["apply", "revert"])
def test_a_forward_cpu_of_vllms_own_is_left_alone(direction, own):
    """Any binding of forward_cpu in RMSNorm's body is vLLM's own: neither
    direction edits; the engine reports it (``VllmHasItsOwn``, check exits 0)."""
    with pytest.raises(VllmHasItsOwn, match="vLLM's own RMSNorm.forward_cpu"):
        direction(LAYERNORM.format(own=own))


def test_vllms_own_binding_before_forward_native_is_left_alone():
    source = LAYERNORM.format(own="").replace(
        "    def forward_native", "    forward_cpu = None\n\n    def forward_native"
    )
    with pytest.raises(VllmHasItsOwn):
        apply(source)


def test_ours_beside_vllms_own_assignment_is_vllms_own():
    """Applied, then vLLM's own assignment added after: the assignment wins at
    run time, so the file is vLLM's, and revert leaves it too."""
    after = apply(LAYERNORM.format(own="")) + "    forward_cpu = forward_native\n"
    with pytest.raises(VllmHasItsOwn):
        revert(after)


@pytest.mark.parametrize("own", OWN_FORMS.values(), ids=OWN_FORMS.keys())
def test_the_provider_agrees_on_vllms_own(own):
    """The provider's run-time criterion on the class each form builds."""
    from patches.cpu_fused_norms.provider import has_own_forward_cpu

    code = (
        "import sys, types\n"
        "from typing import Callable\n"
        'sys.modules["vllm.cpu_norms"] = types.SimpleNamespace(forward_cpu=None)\n'
        "class RMSNorm:\n"
        "    def forward_native(self, x, residual=None):\n"
        "        return x\n"
    ) + own
    namespace: dict = {}
    exec(code, namespace)  # the test's own fixture source: each form as a class
    assert has_own_forward_cpu(namespace["RMSNorm"])
    assert not has_own_forward_cpu(type("RMSNorm", (), {}))


def test_the_ir_checks_as_python():
    """The IR form's per-call text: weight first (IR passes None), then the
    input; a residual's checks only with one."""
    source = rule.call_checks("x", "w", "D", "r")
    assert source.startswith("w is not None and x.dtype in D")
    assert "x.shape[-1] % 8 == 0" in source and "r.is_contiguous()" in source
    assert "r." not in rule.call_checks("x", "w", "D")


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


IMPORT_GROUPS = [
    # (the layernorm.py's first lines, what apply makes of them)
    ("import torch\n", "import functools\nimport os\n\nimport torch\n"),
    (
        "import os\n\nimport torch\n",
        "import functools\nimport os\n\nimport torch\n",
    ),
    (
        "import functools\n\nimport torch\n",
        "import functools\nimport os\n\nimport torch\n",
    ),
    (
        '"""Doc."""\n\nimport math\n\nimport torch\n',
        '"""Doc."""\n\nimport functools\nimport math\nimport os\n\nimport torch\n',
    ),
]


@pytest.mark.parametrize("head, applied", IMPORT_GROUPS)
def test_the_imports_join_the_stdlib_group_and_leave_with_the_change(head, applied):
    """``functools`` and ``os`` in sorted place, a group of their own where the
    file has none; revert takes back only what it added (what the file imported
    it also uses)."""
    source = LAYERNORM.format(own="").replace("import torch\n", head, 1)
    uses = [
        f"{n}.__name__"
        for n in ("functools", "math", "os")
        if f"import {n}\n" in head
    ]
    source += f"\n\nNAMES = ({', '.join(uses)},)\n" if uses else ""
    after = apply(source)
    assert after.startswith(applied)
    assert revert(after) == source
