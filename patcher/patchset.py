"""The carried patches: one folder each under ``patches/``, described by its
``patch.toml``. Nothing here knows what a patch changes."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from patcher.errors import PatchError, UsageError

if TYPE_CHECKING:  # the codemods import LibCST only when a plan runs them
    from patcher.codemod import TreeCodemod

PATCHES_PACKAGE = "patches"


def _load_object(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Edit:
    """One file's change: the codemod that makes it and the one that undoes it,
    named as ``module:Class`` and imported (with LibCST) only when used."""

    file: str
    """The file it edits, relative to the tree root: ``patch.toml`` is its one
    home, and each of the two codemods takes it as its ``TARGET``."""
    apply_ref: str
    revert_ref: str
    optional: bool = False
    """An edit to vLLM's own tests: made only where the tree has them (a
    checkout), and skipped, with the reason, where its file is missing or has a
    shape the codemod does not recognise. The source edits never are."""

    @property
    def apply(self) -> type[TreeCodemod]:
        return _load_object(self.apply_ref)

    @property
    def revert(self) -> type[TreeCodemod]:
        return _load_object(self.revert_ref)

    @property
    def summary(self) -> str:
        return self.apply.DESCRIPTION.strip().splitlines()[0]


@dataclass(frozen=True)
class Patch:
    name: str
    title: str
    versions: SpecifierSet
    edits: tuple[Edit, ...]
    folder: Path
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    """The whole ``patch.toml``, for the tools that need more (provider, PR text)."""
    test_edits: tuple[Edit, ...] = ()
    """Edits to vLLM's own tests (``[[test_edits]]``), all optional."""

    def provider(self) -> dict[str, Any] | None:
        """The out-of-tree provider this patch declares in its ``[provider]``
        table, or None: the table (``module``, and the ``reference`` provider
        module the bench times it against), ``patch``, and the identity the
        ``identity`` module (default: ``module``) declares (``name`` from
        ``PROVIDER``, ``ops``, ``opt_in_env``, ``upstream`` from
        ``UPSTREAM_PROVIDER``). That module is imported; a torch-free one keeps
        this working where torch is not installed."""
        table = self.meta.get("provider")
        if not (isinstance(table, dict) and table.get("module")):
            return None
        module = importlib.import_module(table.get("identity", table["module"]))
        return {
            **table,
            "patch": self.name,
            "name": module.PROVIDER,
            "ops": list(getattr(module, "OPS", ())),
            "opt_in_env": getattr(module, "OPT_IN_ENV", None),
            "upstream": getattr(module, "UPSTREAM_PROVIDER", None),
        }

    def covers(self, version: Version) -> bool:
        return self.versions.contains(version, prereleases=True)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "vllm": str(self.versions),
            "edits": [{"file": e.file, "summary": e.summary} for e in self.edits],
            "test_edits": [
                {"file": e.file, "summary": e.summary} for e in self.test_edits
            ],
        }


def load_patch(folder: Path) -> Patch:
    meta_file = folder / "patch.toml"
    meta = tomllib.loads(meta_file.read_text("utf-8"))
    try:
        versions = SpecifierSet(meta["vllm"])
    except (KeyError, InvalidSpecifier) as exc:
        raise PatchError(
            f"bad or missing 'vllm' specifier: {exc}", path=str(meta_file)
        ) from exc
    try:
        edits, test_edits = (
            tuple(
                Edit(e["file"], e["apply"], e["revert"], optional)
                for e in meta.get(table, ())
            )
            for table, optional in (("edits", False), ("test_edits", True))
        )
    except KeyError as exc:
        raise PatchError(
            f"an edit without {exc.args[0]!r}", path=str(meta_file)
        ) from exc
    return Patch(
        name=folder.name,
        title=meta["title"],
        versions=versions,
        edits=edits,
        folder=folder,
        meta=meta,
        test_edits=test_edits,
    )


def declared_file(codemod: type) -> str | None:
    """The file ``codemod`` edits, from the ``patch.toml`` beside its module
    (None for a class no patch lists, e.g. a shared base class)."""
    module = sys.modules[codemod.__module__]
    ref = f"{codemod.__module__}:{codemod.__qualname__}"
    meta_file = Path(module.__file__ or "").with_name("patch.toml")
    return _edit_files(meta_file).get(ref) if meta_file.is_file() else None


@cache
def _edit_files(meta_file: Path) -> dict[str, str]:
    """``module:Class`` -> file, for every codemod a ``patch.toml`` lists."""
    meta = tomllib.loads(meta_file.read_text("utf-8"))
    edits = [*meta.get("edits", ()), *meta.get("test_edits", ())]
    return {e[key]: e["file"] for e in edits for key in ("apply", "revert")}


def all_patches() -> list[Patch]:
    root = Path(str(resources.files(PATCHES_PACKAGE)))
    return [
        load_patch(d) for d in sorted(root.iterdir()) if (d / "patch.toml").is_file()
    ]


def select(names: list[str] | None) -> list[Patch]:
    patches = all_patches()
    if not names:
        return patches
    by_name = {p.name: p for p in patches}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise UsageError(
            f"unknown patch {', '.join(unknown)}; known: {', '.join(by_name) or 'none'}"
        )
    return [by_name[n] for n in names]


def provider_specs(patches: list[Patch] | None = None) -> list[dict[str, Any]]:
    """:meth:`Patch.provider` of every patch (default: all) that declares one."""
    found = (p.provider() for p in (all_patches() if patches is None else patches))
    return [spec for spec in found if spec is not None]
