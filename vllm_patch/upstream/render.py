"""Render a patch against real vLLM wheels into ``git apply``-able files.

    python -m vllm_patch.upstream.render [--patch NAME] [--out DIR] [--check]

For each ``package==version`` in the patch's ``[upstream] rendered_for``, the
wheel comes from the user cache (``pip download`` on a miss, honouring pip's
configuration), and the engine's plan on it gives the diff, written as
``<out>/<package>-<version>.patch`` (default out: ``<patch>/rendered``). Files
there that no listed wheel produces are removed. ``--check`` writes nothing and
exits 1 when a file is missing, stale or extra.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from patcher import engine, known
from patcher.errors import PatchError
from patcher.patchset import Patch, select
from patcher.tree import open_tree
from vllm_patch.runtime.cache import fetch_wheel
from vllm_patch.upstream.meta import upstream_of

HEADER = (
    "Rendered against the {package} {version} wheel ({patch});\n"
    "regenerate with `nox -s render`, do not edit. Apply in a vLLM {version}\n"
    "checkout with `git apply`.\n\n"
)


def file_name(spec: str) -> str:
    package, _, version = spec.partition("==")
    return f"{package}-{version}.patch"


def render_one(patch: Patch, spec: str) -> tuple[str, dict]:
    """The rendered file's text for one ``package==version``, and the judged
    tree it adds to ``known.json``."""
    package, _, version = spec.partition("==")
    plan = engine.plan(open_tree(fetch_wheel(package, version)), patch)
    if plan.errors:
        raise plan.errors[0]
    header = HEADER.format(patch=patch.name, package=package, version=version)
    judged = known.entry(spec, plan.sources, plan.file_changes())
    return header + plan.diff(), judged


def rendered(patch: Patch) -> dict[str, str]:
    """File name -> text, for every wheel the patch lists, and ``known.json``."""
    specs = upstream_of(patch).rendered_for
    done = {s: render_one(patch, s) for s in specs}
    files = {file_name(s): text for s, (text, _) in done.items()}
    files[known.FILE_NAME] = known.document(
        patch.folder, [judged for _, judged in done.values()]
    )
    return files


def sync(out: Path, wanted: dict[str, str], *, check: bool) -> list[str]:
    """Make ``out`` hold exactly ``wanted`` (name -> text), or with ``check`` only
    compare; the names that differed."""
    present = (
        {p.name for p in [*out.glob("*.patch"), out / known.FILE_NAME] if p.is_file()}
        if out.is_dir()
        else set()
    )
    differ = sorted(
        name
        for name in wanted.keys() | present
        if name not in wanted
        or name not in present
        or (out / name).read_text("utf-8") != wanted[name]
    )
    if not check:
        out.mkdir(parents=True, exist_ok=True)
        for name in differ:
            if name in wanted:
                (out / name).write_text(wanted[name], "utf-8")
            else:
                (out / name).unlink()
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_patch.upstream.render",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--patch", action="append", metavar="NAME")
    parser.add_argument("--out", type=Path, help="only with a single patch")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    patches = [p for p in select(args.patch) if upstream_of(p).rendered_for]
    if args.out and len(patches) != 1:
        parser.error("--out needs exactly one patch with [upstream] rendered_for")
    stale = False
    try:
        for patch in patches:
            out = args.out or patch.folder / "rendered"
            differ = sync(out, rendered(patch), check=args.check)
            verb = "stale" if args.check else "updated"
            for name in differ:
                print(f"{out / name}: {verb}")
            if not differ:
                print(f"{out}: up to date")
            stale |= bool(differ)
    except PatchError as exc:
        print(f"render: error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
