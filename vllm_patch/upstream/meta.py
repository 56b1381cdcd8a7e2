"""What a patch says about its upstream pull request: the ``[upstream]`` table of
its ``patch.toml`` (with ``[upstream.ci]``, the CI step its tests join) and the
Markdown file that holds the PR's Purpose text.

Nothing here knows what a patch changes; every patch-specific word comes from
the patch folder.
"""

from __future__ import annotations

from dataclasses import dataclass

from patcher import engine
from patcher.errors import PatchError, UsageError
from patcher.patchset import Patch, select
from patcher.tree import VllmTree
from vllm_patch.upstream.ci_yaml import CiWiring

TABLE = "upstream"


@dataclass(frozen=True)
class Upstream:
    title: str
    """Commit and PR title, vLLM style: ``[Area][Area] Imperative summary``."""
    branch: str
    """Default branch name in the user's checkout."""
    body: str
    """Commit message body: why, plain text (what the diff does is generated
    from the edit, see ``engine.PatchPlan.described``)."""
    rule: str
    """The change's scope in one sentence, stated in the commit and the PR."""
    purpose: str
    """The PR description's Purpose section (Markdown)."""
    tests: tuple[str, ...]
    """Upstream test files (paths in vLLM's repo) that cover the change."""
    rendered_for: tuple[str, ...]
    """``package==version`` wheels the patch is rendered against."""
    model: str = "Qwen/Qwen3-0.6B"
    """The small model the Test Plan's accuracy and speed commands use."""
    numerics_note: str = ""
    """Optional Markdown: how the change's numerics differ from the reference
    (e.g. how a kernel's rounding is handled), with figures; the PR's Details
    carry it, and leave the paragraph out when it is empty."""
    ci: CiWiring | None = None
    """Optional ``[upstream.ci]``: the CI step the patch's tests join."""
    quote: tuple[str, str] | None = None
    """Optional ``quote = {file, says}``: the paragraph of the checkout's
    ``file`` holding ``says``, quoted in the PR's Details (read at run time:
    vLLM's own words for why the change takes its form)."""


def upstream_of(patch: Patch) -> Upstream:
    table = patch.meta.get(TABLE, {})
    where = str(patch.folder / "patch.toml")
    purpose_file = patch.folder / table.get("purpose_file", "upstream.md")
    try:
        purpose = purpose_file.read_text("utf-8").strip()
    except FileNotFoundError:
        purpose = "\n".join(f"- `{e.file}`: {e.summary}" for e in patch.edits)
    rendered_for = tuple(table.get("rendered_for", ()))
    for spec in rendered_for:
        if "==" not in spec:
            raise PatchError(
                "bad [upstream] rendered_for entry",
                path=where,
                looked_for="package==version",
                found=spec,
            )
    return Upstream(
        title=table.get("title", patch.title),
        branch=table.get("branch", f"vllm-patch/{patch.name}"),
        body=table.get("body", patch.title).strip(),
        rule=" ".join(table.get("rule", "").split()),
        purpose=purpose,
        tests=tuple(table.get("tests", ())),
        rendered_for=rendered_for,
        model=table.get("model", Upstream.model),
        numerics_note=table.get("numerics_note", "").strip(),
        ci=_ci_of(table.get("ci"), where),
        quote=_quote_of(table.get("quote"), where),
    )


def _quote_of(table: object, where: str) -> tuple[str, str] | None:
    if table is None:
        return None
    if not (isinstance(table, dict) and {"file", "says"} <= table.keys()):
        raise PatchError(
            "bad [upstream] quote",
            path=where,
            looked_for="{file, says}",
            found=str(table),
        )
    return str(table["file"]), str(table["says"])


def _ci_of(table: object, where: str) -> CiWiring | None:
    """``[upstream.ci]``: ``file``, ``step`` (part of the step's label),
    ``tests`` and ``source_file_dependencies`` (lists of repository paths)."""
    if table is None:
        return None
    keys = ("file", "step", "tests", "source_file_dependencies")
    if not isinstance(table, dict) or any(k not in table for k in keys):
        raise PatchError(
            "bad [upstream.ci] table",
            path=where,
            looked_for=", ".join(keys),
            found=", ".join(table) if isinstance(table, dict) else type(table).__name__,
        )
    return CiWiring(
        file=table["file"],
        step=table["step"],
        tests=tuple(table["tests"]),
        dependencies=tuple(table["source_file_dependencies"]),
    )


def pick_patch(name: str | None, tree: VllmTree | None = None) -> Patch:
    """The named patch, or the tree's default one (``engine.choose``: the form
    of the change this release needs) that has an ``[upstream]`` table."""
    if name:
        return select([name])[0]
    candidates = [p for p in engine.choose(tree, None) if TABLE in p.meta]
    if len(candidates) != 1:
        names = ", ".join(p.name for p in candidates) or "none"
        raise UsageError(f"more than one patch could be meant; pass --patch ({names})")
    return candidates[0]
