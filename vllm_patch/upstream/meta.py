"""A patch's ``[upstream]`` table: its pull request and its CI wiring."""

from dataclasses import dataclass

from patcher.errors import PatchError, UsageError
from patcher.patchset import Patch, select
from vllm_patch.upstream.ci_yaml import DEPENDENCIES, CiWiring


@dataclass(frozen=True)
class Upstream:
    title: str  # commit and PR title, vLLM style: [Area][Area] Imperative summary
    branch: str  # default branch name in the user's checkout
    body: str  # the commit message's why (what the diff does is generated)
    rule: str  # the change's scope in one sentence, in the PR
    purpose: str  # the description's Purpose (Markdown, ``purpose_file``)
    tests: tuple[str, ...]  # vLLM's test files that cover the change
    model: str = "Qwen/Qwen3-0.6B"  # the Test Plan's commands use it
    ci: tuple[CiWiring, ...] = ()


def upstream_of(patch: Patch) -> Upstream:
    table = patch.meta.get("upstream", {})
    try:
        purpose_file = patch.folder / table.get("purpose_file", "upstream.md")
        purpose = purpose_file.read_text("utf-8").strip()
    except FileNotFoundError:
        purpose = "\n".join(f"- `{e.file}`: {e.summary}" for e in patch.edits)
    ci = table.get("ci", ())
    return Upstream(
        title=table.get("title", patch.title),
        branch=table.get("branch", f"vllm-patch/{patch.name}"),
        body=table.get("body", patch.title).strip(),
        rule=" ".join(table.get("rule", "").split()),
        purpose=purpose,
        tests=tuple(table.get("tests", ())),
        model=table.get("model", Upstream.model),
        ci=tuple(_wiring(t, patch) for t in ([ci] if isinstance(ci, dict) else ci)),
    )


def _wiring(table: dict, patch: Patch) -> CiWiring:
    """One ``[[upstream.ci]]`` table (a script's names the test to follow
    ``after``)."""
    try:
        script = table["file"].endswith(".sh")
        step = table["after" if script else "step"]
        deps = table.get(DEPENDENCIES, ()) if script else table[DEPENDENCIES]
        return CiWiring(table["file"], step, tuple(table["tests"]), tuple(deps))
    except (KeyError, TypeError, AttributeError) as exc:
        raise PatchError(
            "bad [upstream.ci] table",
            path=str(patch.folder / "patch.toml"),
            looked_for=(
                "file, tests, and step and source_file_dependencies or after"
            ),
            found=f"{type(exc).__name__}: {exc}",
        ) from exc


def main_form(name: str | None) -> Patch:
    """The patch ``pr`` sends: with ``[upstream]``, replaced by no other."""
    patches = [p for p in select(None) if "upstream" in p.meta]
    replaced = {p.replaces for p in patches}
    (form,) = [p for p in patches if p.name not in replaced]
    if name and select([name])[0] != form:
        raise UsageError(
            f"pr commits only the form of the change vLLM's main takes: --patch "
            f"{form.name} (it applies to vLLM {form.versions}); {name} is not sent "
            "upstream"
        )
    return form
