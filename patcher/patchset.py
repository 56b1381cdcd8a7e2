"""The carried patches (``patches/<name>/patch.toml``) and which a tree gets:
``vllm`` is where a patch can apply, ``default`` where a plain ``apply`` picks it,
``replaces = "OTHER"`` makes it the default where OTHER is not (and exclusive)."""

import importlib
import sys
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from patcher.errors import PatchError, UsageError

PATCHES_PACKAGE = "patches"


def _load(ref: str) -> type:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Edit:
    """One file's change: its codemod and the inverse, as ``module:Class``."""

    file: str  # relative to the tree root (each codemod's ``TARGET``)
    apply_ref: str
    revert_ref: str
    # A test edit: left out (with why) where it cannot be made.
    optional: bool = False
    # The file may be absent: apply starts from an empty module; revert deletes
    # the file when it holds exactly what apply wrote.
    create: bool = False

    @property
    def apply(self) -> type:
        return _load(self.apply_ref)

    @property
    def revert(self) -> type:
        return _load(self.revert_ref)

    @property
    def summary(self) -> str:
        return self.apply.DESCRIPTION.strip().splitlines()[0]

    def to_json(self) -> dict[str, str]:
        return {"file": self.file, "summary": self.summary}


@dataclass(frozen=True)
class Patch:
    name: str
    title: str
    versions: SpecifierSet
    edits: tuple[Edit, ...]
    folder: Path
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # patch.toml
    test_edits: tuple[Edit, ...] = ()  # ``[[test_edits]]``, all optional
    default: SpecifierSet | None = None
    replaces: str | None = None

    def provider(self) -> dict[str, Any] | None:
        """``[provider]`` with what its ``identity`` module declares;
        None if absent."""
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

    @property
    def files(self) -> frozenset[str]:
        """Every file the patch edits (its test edits too)."""
        return frozenset(e.file for e in self.edits + self.test_edits)

    def covers(self, version: Version | None) -> bool:
        return version is None or self.versions.contains(version, prereleases=True)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "vllm": str(self.versions),
            "default": None if self.default is None else str(self.default),
            "replaces": self.replaces,
            "edits": [e.to_json() for e in self.edits],
            "test_edits": [e.to_json() for e in self.test_edits],
        }


def _edits(table: list[dict], optional: bool) -> tuple[Edit, ...]:
    """``[[edits]]`` or (``optional``) ``[[test_edits]]`` as ``Edit``s."""
    return tuple(
        Edit(e["file"], e["apply"], e["revert"], optional, e.get("create", False))
        for e in table
    )


@cache
def load_patch(folder: Path) -> Patch:
    meta = tomllib.loads((folder / "patch.toml").read_text("utf-8"))
    try:
        edits = _edits(meta.get("edits", ()), optional=False)
        test_edits = _edits(meta.get("test_edits", ()), optional=True)
        default = SpecifierSet(meta["default"]) if "default" in meta else None
        return Patch(
            name=folder.name,
            title=meta["title"],
            versions=SpecifierSet(meta["vllm"]),
            edits=edits,
            folder=folder,
            meta=meta,
            test_edits=test_edits,
            default=default,
            replaces=meta.get("replaces"),
        )
    except (KeyError, InvalidSpecifier, TypeError) as exc:
        message = f"a bad or missing entry: {type(exc).__name__}: {exc}"
        raise PatchError(message, str(folder / "patch.toml")) from exc


def declared_file(codemod: type) -> str | None:
    """The file ``codemod`` edits, from the ``patch.toml`` beside its module."""
    folder = Path(sys.modules[codemod.__module__].__file__ or "").parent
    if not (folder / "patch.toml").is_file():
        return None
    ref = f"{codemod.__module__}:{codemod.__qualname__}"
    edits = load_patch(folder).edits + load_patch(folder).test_edits
    return next((e.file for e in edits if ref in (e.apply_ref, e.revert_ref)), None)


def all_patches() -> list[Patch]:
    root = Path(str(resources.files(PATCHES_PACKAGE)))
    return [
        load_patch(d)
        for d in sorted(root.iterdir())
        if (d / "patch.toml").is_file()
    ]


def select(names: list[str] | None) -> list[Patch]:
    """The named patches (all without names); an unknown name is a usage error."""
    patches = all_patches()
    if not names:
        return patches
    by_name = {p.name: p for p in patches}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        known = ", ".join(by_name) or "none"
        raise UsageError(f"unknown patch {', '.join(unknown)}; known: {known}")
    return [by_name[n] for n in names]


def is_default(
    patch: Patch, version: Version | None, ranged: bool = True
) -> tuple[bool, str]:
    """Whether a plain ``apply`` picks ``patch`` for ``version`` (None: unknown),
    and why; ``ranged=False`` leaves its range out."""
    shown = f"vLLM {version}" if version else "an unknown vLLM version"
    if ranged and not patch.covers(version):
        return False, f"{shown} is outside its range {patch.versions}"
    if patch.default is not None:
        yes = version is None or patch.default.contains(version, prereleases=True)
        where = "in" if yes else "outside"
        return yes, f"{shown} is {where} its default {patch.default}"
    if patch.replaces:
        other = [p for p in all_patches() if p.name == patch.replaces]
        taken = any(is_default(p, version)[0] for p in other)
        why = "is" if taken else "is not"
        return not taken, f"{patch.replaces}, which it replaces, {why} the default"
    return True, f"{shown} is in its range {patch.versions}"


def defaults(version: Version | None) -> list[Patch]:
    """The patches a plain ``apply`` picks for ``version``; where none does,
    those that would but for their range (which then refuse it)."""
    patches = all_patches()
    return [p for p in patches if is_default(p, version)[0]] or [
        p for p in patches if is_default(p, version, ranged=False)[0]
    ]


def exclusive_with(patch: Patch) -> list[Patch]:
    """The patches that exclude ``patch``: the one it replaces,
    those replacing it."""
    return [
        p
        for p in all_patches()
        if p.replaces == patch.name or p.name == patch.replaces
    ]


def provider_specs() -> list[dict[str, Any]]:
    """:meth:`Patch.provider` of every patch that declares one."""
    return [spec for p in all_patches() if (spec := p.provider()) is not None]
