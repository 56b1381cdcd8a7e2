"""The carried patches: one folder each under ``patches/``, described by its
``patch.toml``. Nothing here knows what a patch changes."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from patcher.codemod import TreeCodemod
from patcher.errors import PatchError, UsageError

PATCHES_PACKAGE = "patches"


def _load_object(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Edit:
    """One file's change: the codemod that makes it and the one that undoes it."""

    apply: type[TreeCodemod]
    revert: type[TreeCodemod]
    optional: bool = False
    """An edit to vLLM's own tests: made only where the tree has them (a
    checkout), and skipped, with the reason, where its file is missing or has a
    shape the codemod does not recognise. The source edits never are."""

    @property
    def file(self) -> str:
        return self.apply.TARGET

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
    edits, test_edits = (
        tuple(
            Edit(
                apply=_load_object(e["apply"]),
                revert=_load_object(e["revert"]),
                optional=optional,
            )
            for e in meta.get(table, ())
        )
        for table, optional in (("edits", False), ("test_edits", True))
    )
    return Patch(
        name=folder.name,
        title=meta["title"],
        versions=versions,
        edits=edits,
        folder=folder,
        meta=meta,
        test_edits=test_edits,
    )


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
