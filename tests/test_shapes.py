"""The rule on every source shape vLLM 0.20 - 0.32 ship, by running the patched code.

On CPU exactly rms_norm and fused_add_rms_norm change; on every other platform,
and for every other op, nothing changes. ``fixtures/vllm_tree`` has the 0.27 -
0.32 shape; ``fixtures/shapes/<shape>`` are overlays on it in the shapes of
0.20 and 0.24 - 0.26. The tree is patched with the engine, and its
``vllm_c.py`` and ``CpuPlatform`` are executed, before and after, against
stand-in ``torch``/``vllm`` modules that answer ``current_platform.is_*()`` as
CPU, CUDA, ROCm or XPU would and record every ``register_impl``.
"""

from __future__ import annotations

import ast
import enum
import shutil
import sys
import types
from functools import cache
from pathlib import Path

import git
import pytest
from vllm_ruff import touched_lines_ruff_moves

from patcher import engine
from patcher.backup import BACKUP_DIR
from patcher.patchset import select
from patcher.tree import open_tree
from vllm_patch.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
BASE = FIXTURES / "vllm_tree"
SHAPES = FIXTURES / "shapes"
PATCH = select(["cpu_fused_norms"])[0]
VLLM_C = "vllm/kernels/vllm_c.py"
CPU = "vllm/platforms/cpu.py"
BOTH = ("rms_norm", "fused_add_rms_norm")

# shape: the norms it has
ACCEPTED = {"v0_27": BOTH, "v0_24": BOTH, "v0_20": ("rms_norm",)}
PLATFORMS = {  # what each platform's current_platform.is_*() says yes to
    "cpu": {"is_cpu"},
    "cuda": {"is_cuda", "is_cuda_alike"},
    "rocm": {"is_rocm", "is_cuda_alike"},
    "xpu": {"is_xpu"},
}


def build(shape: str, dest: Path) -> Path:
    shutil.copytree(BASE, dest)
    if (SHAPES / shape).is_dir():
        shutil.copytree(SHAPES / shape, dest, dirs_exist_ok=True)
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
    def __init__(self, contiguous=True, dtype="float32", hidden=16) -> None:
        self.contiguous, self.dtype, self.shape = contiguous, dtype, (4, hidden)

    def is_contiguous(self) -> bool:
        return self.contiguous


class Platform:
    def __init__(self, name: str) -> None:
        self.name = name

    def import_kernels(self) -> None:  # vllm_c.py 0.20 calls it on import
        pass

    def get_cpu_architecture(self):
        return sys.modules["vllm.platforms"].CpuArchEnum.X86

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
        def register(
            provider, *, supported=True, supports_args=None, inplace=False
        ):
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
    for dtype in ("float32", "float16", "bfloat16"):
        setattr(modules["torch"], dtype, dtype)
    modules["torch"].ops = types.SimpleNamespace(
        _C=types.SimpleNamespace(rms_norm=None),
        mkldnn=types.SimpleNamespace(_is_mkldnn_bf16_supported=lambda: False),
    )
    modules["torch"].get_num_threads = lambda: 1  # the kernels' thread layout
    modules["torch"].cpu = types.SimpleNamespace(
        _is_avx512_bf16_supported=lambda: False  # as _C_AVX2 here: bf16 truncates
    )
    modules["vllm.platforms"].CpuArchEnum = enum.Enum(
        "CpuArchEnum", "X86 ARM POWERPC S390X"
    )
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
        method = getattr(
            namespace["CpuPlatform"], "get_default_ir_op_priority", None
        )
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
    """supports_args arguments: what the kernel takes ("eligible"), and each
    way it does not: a strided tensor, a hidden size not a multiple of 8, a
    residual of another dtype, a bf16 fused add on a build that truncates."""
    w, bf16 = Tensor(), Tensor(dtype="bfloat16")
    if op == "rms_norm":
        return {
            "eligible": (Tensor(), w, 1e-6),
            "x strided": (Tensor(False), w, 1e-6),
            "hidden 12": (Tensor(hidden=12), w, 1e-6),
            "no weight": (Tensor(), None, 1e-6),
        }
    return {
        "eligible": (Tensor(), Tensor(), w, 1e-6),
        "x strided": (Tensor(False), Tensor(), w, 1e-6),
        "residual strided": (Tensor(), Tensor(False), w, 1e-6),
        "hidden 4100": (Tensor(hidden=4100), Tensor(hidden=4100), w, 1e-6),
        "bf16 residual beside fp32 x": (Tensor(), bf16, w, 1e-6),
        "bf16 on a truncating build": (bf16, bf16, bf16, 1e-6),
    }


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
    before, after = patched(shape, tmp_path_factory.getbasetemp())
    was = observed(run(before[VLLM_C], platform, monkeypatch))
    now = observed(run(after[VLLM_C], platform, monkeypatch))
    assert sorted(was) == sorted(ACCEPTED[shape])
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
    """Off CPU nothing changes; on CPU only the norms do: supported where the
    kernel matches native, refusing every input where it does not."""
    assert sorted(was) == sorted(now)
    if platform != "cpu":
        assert now == was
        return
    for op in set(was) - set(BOTH):
        assert now[op] == was[op]
    for op in set(was) & set(BOTH):
        supported, checks = now[op]
        assert supported
        assert checks["eligible"] == was[op][1]["eligible"] is True
        assert not any(v for k, v in checks.items() if k != "eligible"), checks


@pytest.mark.parametrize("shape", ACCEPTED)
def test_the_cpu_priority_names_exactly_the_norms(
    shape, tmp_path_factory, monkeypatch
):
    norms = ACCEPTED[shape]
    before, after = patched(shape, tmp_path_factory.getbasetemp())
    assert priority(before[CPU], monkeypatch) == {}
    assert priority(after[CPU], monkeypatch) == {
        "NONE": {
            "default": ["native"],
            **{op: ["vllm_c", "native"] for op in norms},
        },
        "VLLM_COMPILE": {"default": ["native"], **{op: ["native"] for op in norms}},
    }


@pytest.mark.parametrize("shape", ACCEPTED)
def test_every_line_the_edit_writes_is_the_pinned_ruffs(shape, tmp_path_factory):
    """It fits 88 columns and is as ruff lays the patched file out, also where
    the tree's statement was in an older ruff's layout (0.20's predicate)."""
    before, after = patched(shape, tmp_path_factory.getbasetemp())
    assert sorted(after) == sorted([CPU, VLLM_C])
    for rel, new in after.items():
        assert touched_lines_ruff_moves(before[rel], new) == [], rel


@pytest.mark.parametrize("kind", ["directory", "checkout", "installed"])
@pytest.mark.parametrize("shape", ACCEPTED)
def test_apply_then_revert_restores_every_byte(shape, kind, tmp_path):
    """From the backup every tree keeps (in a checkout's .git), also where the
    inverse edit gives the statement back in ruff's layout (0.20)."""
    root = build(shape, tmp_path / "tree")
    if kind == "checkout":
        git.Repo.init(root)
    if kind == "installed":
        (root / "vllm-0.27.0.dist-info").mkdir()
        (root / "vllm-0.27.0.dist-info" / "METADATA").write_text(
            "Version: 0.27.0\n"
        )
    files = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert main(["apply", "--vllm", str(root)]) == 0
    assert all(
        (root / rel).read_bytes() != files[root / rel] for rel in (VLLM_C, CPU)
    )
    assert main(["check", "--vllm", str(root)]) == 0  # applied
    assert main(["revert", "--vllm", str(root)]) == 0
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == files


@pytest.mark.parametrize("shape", ACCEPTED)
def test_the_inverse_edit_alone_gives_the_same_code_back(shape, tmp_path):
    """Without the backup (deleted), revert's inverse edits are right in
    meaning: the same Python, whatever the layout; what they write is laid out
    as vLLM's ruff lays it out."""
    root = build(shape, tmp_path / "tree")
    original = {rel: (root / rel).read_text() for rel in (VLLM_C, CPU)}
    assert main(["apply", "--vllm", str(root)]) == 0
    patched = {rel: (root / rel).read_text() for rel in (VLLM_C, CPU)}
    assert all(patched[rel] != text for rel, text in original.items())
    shutil.rmtree(root / BACKUP_DIR)
    assert main(["revert", "--vllm", str(root)]) == 0
    for rel, text in original.items():
        reverted = (root / rel).read_text()
        assert ast.dump(ast.parse(reverted)) == ast.dump(ast.parse(text))
        assert touched_lines_ruff_moves(patched[rel], reverted) == [], rel
