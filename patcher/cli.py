"""The ``vllm-patch`` command line.

Exit codes are ``patcher.errors.ExitCode``. Every error, bad command lines
included, is one message on stderr and, under ``--json``, one JSON document on
stdout (``{"error": {"code": ..., "message": ..., "path": ...}}``); never a
traceback. Subcommands of the packages above the engine (``bench``) come from
the ``vllm_patch.commands`` entry points: nothing here imports them.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from patcher import doctor, engine, pr
from patcher.errors import ExitCode, PatchError, UsageError, shown
from patcher.patchset import all_patches, select
from patcher.status import PlanStatus
from patcher.tree import VllmTree, open_tree

# The verbs that read a wheel (apply and revert refuse one: it is an archive).
WHEEL_VERBS = ("check", "diff")
COMMANDS_GROUP = "vllm_patch.commands"
"""Entry points that add subcommands from packages above the engine (the bench):
each names a function that takes argparse's subparsers and adds its own."""


def _own_version() -> str:
    try:
        return metadata.version("vllm-patch")
    except metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "(not installed)"


def _warn(message: str) -> None:
    print(f"vllm-patch: warning: {shown(message)}", file=sys.stderr)


def cmd_list(args: argparse.Namespace) -> int:
    patches = all_patches()
    if args.json:
        print(json.dumps([p.to_json() for p in patches], indent=2))
        return ExitCode.OK
    for p in patches:
        print(f"{p.name}  (vLLM {p.versions})\n  {p.title}")
        for e in p.edits + p.test_edits:
            print(f"  - {e.file}: {e.summary}")
    return ExitCode.OK


def _open(args: argparse.Namespace, writing: str | None = None) -> VllmTree:
    """The tree, after finishing or rolling back what a kill interrupted there."""
    tree = open_tree(args.vllm, writing=writing)
    for note in engine.recover(tree, select(args.patch)):
        _warn(note)
    return tree


def _plans(
    args: argparse.Namespace, writing: str | None = None
) -> tuple[VllmTree, list[engine.PatchPlan]]:
    """Every selected patch planned under a shared lock on the tree: never on a
    tree another vllm-patch is half-way through writing."""
    tree = open_tree(args.vllm, writing=writing)
    patches = select(args.patch)
    with engine.reading(tree, patches) as notes:
        plans = [engine.plan(tree, p, force=args.force) for p in patches]
    for note in notes:
        _warn(note)
    for p in plans:
        for w in p.warnings:
            _warn(w)
    return tree, plans


def cmd_check(args: argparse.Namespace) -> int:
    tree, plans = _plans(args)
    if args.json:
        print(json.dumps([p.to_json() for p in plans], indent=2))
    else:
        for p in plans:
            version = p.version or "unknown version"
            where = shown(tree.location)
            print(f"{p.patch.name}: {p.status}  [{where}, vLLM {version}]")
            if p.error:
                print("  " + str(p.error).replace("\n", "\n  "))
            for e in p.edits:
                via = f" (via the shim {e.via})" if e.via else ""
                print(f"  {e.file}{via}: {e.status()}")
                if e.error or e.skipped:
                    print("    " + str(e.error or e.skipped).replace("\n", "\n    "))
    statuses = {p.status for p in plans}
    if PlanStatus.NOT_APPLICABLE in statuses:
        return ExitCode.CANNOT_APPLY
    return ExitCode.PENDING if PlanStatus.APPLICABLE in statuses else ExitCode.OK


def cmd_diff(args: argparse.Namespace) -> int:
    _, plans = _plans(args)
    for p in plans:
        if p.errors:
            raise p.errors[0]
    if args.json:
        doc = [
            {"patch": p.patch.name, "status": p.status, "diff": p.diff()} for p in plans
        ]
        print(json.dumps(doc, indent=2))
        return ExitCode.OK
    for p in plans:
        if p.status is PlanStatus.APPLIED:
            print(f"{p.patch.name}: already applied, no diff", file=sys.stderr)
        sys.stdout.write(p.diff())
    return ExitCode.OK


def _report(outcome: engine.Outcome) -> None:
    for note in outcome.notes:
        _warn(note)
    print(outcome)


def cmd_apply(args: argparse.Namespace) -> int:
    tree, plans = _plans(args, writing="apply to")
    for p in plans:  # refuse before the first patch is written, not after
        if p.errors:
            raise p.errors[0]
    for p in plans:  # each written as checked (its warnings shown by _plans)
        _report(engine.apply(tree, p.patch, force=args.force, planned=p))
    return ExitCode.OK


def cmd_revert(args: argparse.Namespace) -> int:
    tree = _open(args, writing="revert")
    for patch in select(args.patch):
        _report(engine.revert(tree, patch))
    return ExitCode.OK


class _Parser(argparse.ArgumentParser):
    """A bad command line raises ``UsageError``, so ``main`` reports it like any
    other error (as JSON under ``--json``)."""

    def error(self, message: str):
        raise UsageError(f"{message}\n{self.format_usage().rstrip()}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vllm-patch",
        description="Apply, check and upstream carried changes to a vLLM source tree.",
        epilog="Exit codes: " + "; ".join(f"{c.value} {c.short}" for c in ExitCode),
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_own_version()}"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def verb(name: str, func, help: str, *, tree: bool = True, json_out: bool = False):
        p = sub.add_parser(name, help=help, description=help)
        if tree:
            wheel = ", or a .whl file" if name in WHEEL_VERBS else ""
            p.add_argument(
                "--vllm",
                metavar="PATH",
                help="directory containing the vllm/ package (checkout root or "
                f"site-packages){wheel}; default: the vLLM installed for this Python",
            )
            p.add_argument(
                "--patch",
                metavar="NAME",
                action="append",
                help="only this patch (repeatable); default: all",
            )
        if json_out:
            p.add_argument(
                "--json", action="store_true", help="machine-readable output"
            )
        p.set_defaults(func=func)
        return p

    verb("list", cmd_list, "list the carried patches", tree=False, json_out=True)
    for name, func, help, force in [
        (
            "check",
            cmd_check,
            "show, per patch and edit, applied/applicable/not applicable",
            "judge the tree by its shape",
        ),
        (
            "diff",
            cmd_diff,
            "print the unified diff (git apply format); write nothing",
            "print the diff",
        ),
        ("apply", cmd_apply, "apply the patches (atomic; idempotent)", "apply"),
    ]:
        p = verb(name, func, help, json_out=name in ("check", "diff"))
        p.add_argument(
            "--force",
            action="store_true",
            help=f"{force} even if the tree's vLLM version is outside the patch's "
            "range",
        )
    verb("revert", cmd_revert, "undo the patches (byte-identical)")

    summary = pr.__doc__.split("\n\n")[0]
    p = sub.add_parser(
        "pr", help="commit a patch on a branch of a vLLM checkout", description=summary
    )
    pr.add_arguments(p)
    p.set_defaults(func=pr.run)

    for entry in command_entry_points():
        try:
            register = entry.load()
        except Exception as exc:  # one broken package must not take the CLI down
            _warn(f"command {entry.name} ({entry.value}) unavailable: {exc}")
            continue
        register(sub)

    p = verb(
        "doctor",
        doctor.run,
        "check this environment: vLLM, its imports, the patches and their providers",
        tree=False,
    )
    doctor.add_arguments(p)
    return parser


def command_entry_points() -> list[metadata.EntryPoint]:
    """The ``COMMANDS_GROUP`` entry points: from this project's pyproject.toml
    when running from a source checkout (an editable or no install, whose
    metadata may be older or absent), else from the installed metadata."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text("utf-8")).get("project", {})
        if project.get("name") == "vllm-patch":
            table = project.get("entry-points", {}).get(COMMANDS_GROUP, {})
            return [
                metadata.EntryPoint(name, value, COMMANDS_GROUP)
                for name, value in table.items()
            ]
    return list(metadata.entry_points(group=COMMANDS_GROUP))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except PatchError as exc:
        return _fail(exc, "--json" in argv)
    except OSError as exc:  # unforeseen I/O trouble: still a message, not a traceback
        error = PatchError(exc.strerror or str(exc), path=exc.filename)
        return _fail(error, "--json" in argv)


def _fail(exc: PatchError, as_json: bool) -> int:
    print(f"vllm-patch: error: {exc}", file=sys.stderr)
    if as_json:
        print(json.dumps(exc.to_json(), indent=2))
    return int(exc.exit_code)
