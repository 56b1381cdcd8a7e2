"""The layers of ARCHITECTURE.md: each package imports only from the ones
below it, and the engine and the PR tooling load without torch, vLLM or git."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_patch.runtime import child

ROOT = Path(__file__).resolve().parent.parent
# Bottom to top: each layer imports only from the ones before it (those on one
# line are side by side: neither imports the other).
LAYERS = (
    ("patcher",),
    ("vllm_patch.runtime",),
    ("patches",),
    ("vllm_patch.bench",),
    ("compat_matrix",),
    ("vllm_patch.doctor", "vllm_patch.upstream", "vllm_patch.vllm_cli"),
    ("vllm_patch.cli",),
    ("vllm_patch.__main__",),
)
ALL = [name for layer in LAYERS for name in layer]


def _imported_modules(path: Path) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _within(module: str, name: str) -> bool:
    return module == name or module.startswith(name + ".")


def _files(name: str) -> list[Path]:
    path = ROOT.joinpath(*name.split("."))
    return (
        sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    )


@pytest.mark.parametrize("name", ALL)
def test_no_package_imports_from_a_layer_above_or_beside_it(name):
    level = next(i for i, layer in enumerate(LAYERS) if name in layer)
    others = {n for i, layer in enumerate(LAYERS) for n in layer if i >= level} - {
        name
    }
    wrong = {
        str(path.relative_to(ROOT)): sorted(
            m for m in _imported_modules(path) if any(_within(m, o) for o in others)
        )
        for path in _files(name)
    }
    assert {k: v for k, v in wrong.items() if v} == {}


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    packages |= {
        f"vllm_patch.{p.parent.name}" for p in ROOT.glob("vllm_patch/*/__init__.py")
    }
    packages |= {f"vllm_patch.{p.stem}" for p in ROOT.glob("vllm_patch/*.py")}
    packages -= {"vllm_patch", "vllm_patch.__init__"}
    assert packages == set(ALL)


def test_the_engine_imports_no_torch(targets):
    """``vllm-patch`` runs where torch is broken or absent: no module of the
    engine imports torch, vLLM, git or a layer above it at import (the bench's
    children import what they measure themselves; the runtime layer is the
    child runner's own, so the static layer test above covers it)."""
    heavy = child.run(
        "toolkit_targets:import_all",
        {"package": "patcher", "heavy": ["torch", "vllm", "git", *ALL[2:]]},
        pythonpath=[targets],
    ).value()
    assert heavy == []


def test_pr_and_the_providers_identity_import_no_torch(targets):
    """`vllm-patch pr` runs from a plain install, where torch may be absent:
    the PR tooling and the provider's identity (read from its torch-free
    module) import neither torch nor vLLM."""
    found = child.run("toolkit_targets:pr_alone", {}, pythonpath=[targets]).value()
    assert found == {
        "upstream": "vllm_c",
        "ops": ["rms_norm", "fused_add_rms_norm"],
        "imported": [],
    }
