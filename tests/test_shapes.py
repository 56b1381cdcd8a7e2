"""The rule on every source shape the patch accepts, by running the patched code.

On CPU exactly rms_norm and fused_add_rms_norm change; on every other platform,
and for every other op, nothing changes. Each shape is a hand-built overlay on
``fixtures/vllm_tree`` (``fixtures/shapes/<shape>/before``, with the expected
``vllm_c.py`` in ``after``). The tree is patched with the engine, and its
``vllm_c.py`` and ``CpuPlatform`` are executed, before and after, against
stand-in ``torch``/``vllm`` modules that answer ``current_platform.is_*()`` as
CPU, CUDA, ROCm or XPU would and record every ``register_impl``.
"""

from __future__ import annotations

import difflib
import enum
import shutil
import sys
import types
from functools import cache
from pathlib import Path

import git
import pytest
from libcst.codemod import CodemodTest

from patcher import engine
from patcher.patchset import select
from patcher.ruff_format import LINE_LENGTH, format_source
from patcher.tree import open_tree
from patches.cpu_fused_norms.enable_vllm_c import DisableVllmCOnCpu, EnableVllmCOnCpu
from vllm_patch.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
BASE = FIXTURES / "vllm_tree"
SHAPES = FIXTURES / "shapes"
PATCH = select(["cpu_fused_norms"])[0]
VLLM_C = "vllm/kernels/vllm_c.py"
CPU = "vllm/platforms/cpu.py"
BOTH = ("rms_norm", "fused_add_rms_norm")
# Only a backup tells a CPU gate made by hand from the one apply adds, or gives
# back a statement apply laid out anew (it was not in the pinned ruff's layout).
INVERSE_IS_AMBIGUOUS = {"hand_gate", "long_lines_fork", "older_ruff_layout"}

# shape: (the norms it has, its other vllm_c ops, where vllm_c.py and cpu.py are)
ACCEPTED = {
    "base 0.27 shape": (BOTH, (), (VLLM_C, CPU)),
    "shared_gate_silu": (BOTH, ("silu_and_mul",), (VLLM_C, CPU)),
    "cpu_gate_gelu_new": (BOTH, ("gelu_new",), (VLLM_C, CPU)),
    "renamed_params": (("rms_norm",), (), (VLLM_C, CPU)),
    "def_predicate": (BOTH, (), (VLLM_C, CPU)),
    "cpu_in_middle": (BOTH, (), (VLLM_C, CPU)),
    "not_cpu": (BOTH, (), (VLLM_C, CPU)),
    "hand_gate": (BOTH, (), (VLLM_C, CPU)),
    "long_lines_fork": (BOTH, (), (VLLM_C, CPU)),
    "older_ruff_layout": (BOTH, (), (VLLM_C, CPU)),
}
PLATFORMS = {  # what each platform's current_platform.is_*() says yes to
    "cpu": {"is_cpu"},
    "cuda": {"is_cuda", "is_cuda_alike"},
    "rocm": {"is_rocm", "is_cuda_alike"},
    "xpu": {"is_xpu"},
}


def build(shape: str, dest: Path) -> Path:
    shutil.copytree(BASE, dest)
    if (SHAPES / shape).is_dir():
        shutil.copytree(SHAPES / shape / "before", dest, dirs_exist_ok=True)
    return dest


@cache
def patched(shape: str, tmp: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(files before, files after) of the shape's tree, patched by the engine."""
    plan = engine.plan(open_tree(build(shape, tmp / shape)), PATCH)
    assert not plan.errors, plan.errors
    changes = plan.file_changes()
    return {r: a for r, (a, _) in changes.items()}, {
        r: b for r, (_, b) in changes.items()
    }


# --- stand-ins: just enough of torch and vllm to run vllm_c.py and CpuPlatform ---


class Tensor:
    def __init__(self, contiguous: bool = True, dtype: str = "bf16") -> None:
        self.contiguous, self.dtype = contiguous, dtype

    def is_contiguous(self) -> bool:
        return self.contiguous


class Platform:
    def __init__(self, name: str) -> None:
        self.name = name

    def import_kernels(self) -> None:  # vllm_c.py 0.20 calls it on import
        pass

    def __getattr__(self, check: str):
        if not check.startswith("is_"):
            raise AttributeError(check)
        return lambda: check in PLATFORMS[self.name]


class CompilationMode(enum.IntEnum):
    NONE = 0
    VLLM_COMPILE = 3


class IrOpPriorityConfig:
    @classmethod
    def with_default(cls, default, /, **per_op):
        return {"default": default, **per_op}


def stand_ins(platform: str, registry: dict) -> dict[str, types.ModuleType]:
    def register_impl(op):
        def register(provider, *, supported=True, supports_args=None, inplace=False):
            def record(fn):
                registry[op] = (bool(supported), supports_args)
                return fn

            return record

        return types.SimpleNamespace(register_impl=register)

    modules = {
        name: types.ModuleType(name)
        for name in (
            "torch",
            "vllm",
            "vllm.ir",
            "vllm.platforms",
            "vllm.config",
            "vllm.config.compilation",
            "vllm.config.kernel",
        )
    }
    modules["torch"].Tensor = Tensor
    modules["vllm.ir"].ops = types.SimpleNamespace(
        **{op: register_impl(op) for op in (*BOTH, "silu_and_mul", "gelu_new")}
    )
    modules["vllm"].ir = modules["vllm.ir"]
    modules["vllm.platforms"].current_platform = Platform(platform)
    modules["vllm.config.compilation"].CompilationMode = CompilationMode
    modules["vllm.config.kernel"].IrOpPriorityConfig = IrOpPriorityConfig
    return modules


def run(source: str, platform: str, monkeypatch) -> dict:
    """op -> (supported, supports_args) as executing ``source`` registers them."""
    registry: dict = {}
    with monkeypatch.context() as patch:
        for name, module in stand_ins(platform, registry).items():
            patch.setitem(sys.modules, name, module)
        exec(compile(source, "vllm_c.py", "exec"), {"__name__": "vllm_c"})
    return registry


def priority(source: str, monkeypatch) -> dict[str, dict]:
    """CpuPlatform.get_default_ir_op_priority, eager and under Inductor."""
    namespace: dict = {"__name__": "cpu"}
    with monkeypatch.context() as patch:
        for name, module in stand_ins("cpu", {}).items():
            patch.setitem(sys.modules, name, module)
        exec(compile(source, "cpu.py", "exec"), namespace)
        method = getattr(namespace["CpuPlatform"], "get_default_ir_op_priority", None)
        if method is None:
            return {}
        return {
            mode.name: method(
                types.SimpleNamespace(
                    compilation_config=types.SimpleNamespace(
                        backend="inductor", mode=mode
                    ),
                    lora_config=None,
                )
            )
            for mode in CompilationMode
        }


def calls(op: str) -> dict[str, tuple]:
    """supports_args arguments: all contiguous, and each tensor not."""
    w = Tensor()
    if op == "rms_norm":
        return {
            "contiguous": (Tensor(), w, 1e-6),
            "x strided": (Tensor(False), w, 1e-6),
        }
    if op == "fused_add_rms_norm":
        return {
            "contiguous": (Tensor(), Tensor(), w, 1e-6),
            "x strided": (Tensor(False), Tensor(), w, 1e-6),
            "residual strided": (Tensor(), Tensor(False), w, 1e-6),
        }
    return {"contiguous": (Tensor(),), "x strided": (Tensor(False),)}


def observed(registry: dict) -> dict:
    """op -> (supported, {input: supports_args result})."""
    return {
        op: (
            supported,
            {k: bool(check(*a)) if check else True for k, a in calls(op).items()},
        )
        for op, (supported, check) in registry.items()
    }


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", ACCEPTED)
def test_only_the_norms_change_and_only_on_cpu(
    shape, platform, tmp_path_factory, monkeypatch
):
    norms, others, (vllm_c, _) = ACCEPTED[shape]
    before, after = patched(shape, tmp_path_factory.getbasetemp())
    was = observed(run(before[vllm_c], platform, monkeypatch))
    now = observed(run(after[vllm_c], platform, monkeypatch))
    assert sorted(was) == sorted((*norms, *others))
    assert_the_rule(was, now, platform)


@pytest.mark.integration
@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_rule_holds_on_every_real_wheel(real_wheel, platform, monkeypatch):
    """The same, on each real vllm_c.py the patch is rendered for."""
    changes = engine.plan(open_tree(real_wheel), PATCH).file_changes()
    before, after = changes[VLLM_C]
    was = observed(run(before, platform, monkeypatch))
    now = observed(run(after, platform, monkeypatch))
    assert set(BOTH) & set(was)
    assert_the_rule(was, now, platform)


def assert_the_rule(was: dict, now: dict, platform: str) -> None:
    """Off CPU nothing changes; on CPU only the norms do: supported, and
    refusing a non-contiguous tensor, with their other conditions as they were."""
    assert sorted(was) == sorted(now)
    if platform != "cpu":
        assert now == was
        return
    for op in set(was) - set(BOTH):
        assert now[op] == was[op]
    for op in set(was) & set(BOTH):
        supported, checks = now[op]
        assert supported
        assert checks["contiguous"] == was[op][1]["contiguous"]
        assert not any(v for k, v in checks.items() if k != "contiguous")


@pytest.mark.parametrize("shape", ACCEPTED)
def test_the_cpu_priority_names_exactly_the_norms(shape, tmp_path_factory, monkeypatch):
    norms, _, (_, cpu) = ACCEPTED[shape]
    before, after = patched(shape, tmp_path_factory.getbasetemp())
    assert priority(before[cpu], monkeypatch) == {}
    assert priority(after[cpu], monkeypatch) == {
        "NONE": {"default": ["native"], **{op: ["vllm_c", "native"] for op in norms}},
        "VLLM_COMPILE": {"default": ["native"], **{op: ["native"] for op in norms}},
    }


@pytest.mark.parametrize("shape", ACCEPTED)
def test_every_line_the_edit_writes_is_the_pinned_ruffs(shape, tmp_path_factory):
    """It fits 88 columns and is as ruff lays the patched file out, also in a
    fork whose statements were not in ruff's layout (long lines, hand-wrapped)."""
    before, after = patched(shape, tmp_path_factory.getbasetemp())
    for rel, new in after.items():
        old = before[rel].splitlines()
        written = [
            line[1:]
            for line in difflib.unified_diff(old, new.splitlines(), lineterm="")
            if line.startswith("+") and not line.startswith("+++")
        ]
        ruffs = set(format_source(new).splitlines())
        assert written and all(len(line) <= LINE_LENGTH for line in written)
        assert [line for line in written if line not in ruffs] == []


@pytest.mark.parametrize("kind", ["directory", "checkout", "installed"])
@pytest.mark.parametrize("shape", ACCEPTED)
def test_apply_then_revert_restores_every_byte(shape, kind, tmp_path):
    """By the inverse edit (a directory, a checkout) or from the backup (an
    installed tree, and any tree where the inverse edit would not give the
    bytes back: a CPU gate someone added by hand, as apply would have)."""
    root = build(shape, tmp_path / "tree")
    if kind == "checkout":
        git.Repo.init(root)
    if kind == "installed":
        (root / "vllm-0.27.0.dist-info").mkdir()
        (root / "vllm-0.27.0.dist-info" / "METADATA").write_text("Version: 0.27.0\n")
    files = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert main(["apply", "--vllm", str(root)]) == 0
    assert main(["check", "--vllm", str(root)]) == 0  # applied
    assert main(["revert", "--vllm", str(root)]) == 0
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == files


class TestShapes(CodemodTest):
    """The edit itself, before and after, on each hand-built vllm_c.py."""

    TRANSFORM = EnableVllmCOnCpu

    def pairs(self):
        for shape in sorted(p.name for p in SHAPES.iterdir()):
            for after in (SHAPES / shape / "after").rglob("vllm_c.py"):
                rel = after.relative_to(SHAPES / shape / "after")
                before = SHAPES / shape / "before" / rel
                if not before.is_file():
                    before = BASE / rel
                yield shape, before.read_text(), after.read_text()

    def test_apply(self) -> None:
        for shape, before, after in self.pairs():
            with self.subTest(shape):
                self.assertCodemod(before, after)

    def test_revert(self) -> None:
        self.TRANSFORM = DisableVllmCOnCpu
        for shape, before, after in self.pairs():
            if shape in INVERSE_IS_AMBIGUOUS:
                continue
            with self.subTest(shape):
                self.assertCodemod(after, before)

    def test_apply_again_changes_nothing(self) -> None:
        for shape, _, after in self.pairs():
            with self.subTest(shape):
                self.assertCodemod(after, after)
