"""What a patch says about its upstream pull request: the ``[upstream]`` table of
its ``patch.toml`` (with ``[upstream.ci]``, the CI step its tests join) and the
Markdown file that holds the PR's Purpose text.

Nothing here knows what a patch changes; every patch-specific word comes from
the patch folder.
"""

from __future__ import annotations

from dataclasses import dataclass

from patcher.errors import PatchError, UsageError
from patcher.patchset import Patch, select
from vllm_patch.upstream.ci_yaml import DEPENDENCIES, CiWiring

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
    ci: tuple[CiWiring, ...] = ()
    """``[[upstream.ci]]``: the CI entry points the patch's tests join."""


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
        ci=tuple(_ci_of(t, where) for t in _listed(table.get("ci", ()))),
    )


def _listed(tables: object) -> list:
    """``[[upstream.ci]]`` entries (a single ``[upstream.ci]`` table is one)."""
    return [tables] if isinstance(tables, dict) else list(tables)


def _ci_of(table: object, where: str) -> CiWiring:
    """One ``[[upstream.ci]]``: ``file`` and ``tests``; for Buildkite YAML
    ``step`` (part of the step's label) and ``source_file_dependencies``, for a
    shell script ``after`` (the test whose ``pytest`` line the new ones follow)."""
    script = isinstance(table, dict) and str(table.get("file", "")).endswith(".sh")
    keys = ("file", "tests", *(("after",) if script else ("step", DEPENDENCIES)))
    if not isinstance(table, dict) or any(k not in table for k in keys):
        raise PatchError(
            "bad [upstream.ci] table",
            path=where,
            looked_for=", ".join(keys),
            found=", ".join(table) if isinstance(table, dict) else type(table).__name__,
        )
    return CiWiring(
        file=table["file"],
        step=table.get("step", table.get("after", "")),
        tests=tuple(table["tests"]),
        dependencies=tuple(table.get(DEPENDENCIES, ())),
    )


def main_form(name: str | None) -> Patch:
    """The form of the change vLLM's main takes: the patch with an
    ``[upstream]`` table that no other patch replaces (the one ``pr`` sends);
    a named patch must be it."""
    patches = [p for p in select(None) if TABLE in p.meta]
    replaced = {p.replaces for p in patches}
    (form,) = [p for p in patches if p.name not in replaced]
    if name and select([name])[0] != form:
        raise UsageError(
            f"pr commits only the form of the change vLLM's main takes: --patch "
            f"{form.name} (it applies to vLLM {form.versions}); {name} is not sent "
            "upstream"
        )
    return form
