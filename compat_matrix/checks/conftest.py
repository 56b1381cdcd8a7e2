"""A cell's shared fixtures. Every fact the matrix shows is a test-suite property
(``fact``): ``compat_matrix.report`` reads nothing else."""

import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
from calls import COUNT_MODES

from patcher.patchset import select
from patcher.tree import open_tree
from patcher.version import read_version
from patches.cpu_fused_norms.identity import OPT_IN_ENV
from vllm_patch.runtime import machine

# The cell runs opted in: the provider's one switch, as a user sets it.
os.environ.setdefault(OPT_IN_ENV, "1")
DEPRECATION = re.compile(r"Deprecated: vLLM IR .*?(?=\n\s*\n|\"\"\")", re.DOTALL)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--vllm-wheel", help="PACKAGE==VERSION: this wheel, not vLLM here"
    )
    parser.addoption("--e2e", action="store_true", help="start vLLM's engine too")


@pytest.fixture(scope="session")
def tree(request):
    """The wheel asked for (fetched into the user cache), or the installed vLLM."""
    wanted = request.config.getoption("--vllm-wheel")
    if not wanted:
        return open_tree(None)
    from vllm_patch.runtime.cache import fetch_wheel

    return open_tree(fetch_wheel(*wanted.split("==")))


@pytest.fixture(scope="session")
def fact(record_testsuite_property):
    """Record one fact of the cell for the report (JSON-encoded)."""
    return lambda name, value: record_testsuite_property(name, json.dumps(value))


@pytest.fixture(scope="session")
def check_report(request, tree, fact) -> list[dict]:
    """``vllm-patch check --json`` on the tree (an error: the only entry)."""
    command = [sys.executable, "-m", "vllm_patch", "check", "--json", "--vllm"]
    proc = subprocess.run(
        [*command, str(tree.location)], capture_output=True, text=True
    )
    report = json.loads(proc.stdout)
    fact("torch", os.environ.get("VLLMPATCH_COMPAT_TORCH"))
    if not request.config.getoption("--vllm-wheel"):  # live: what ran, where
        fact("kernel_build", machine.kernel_build())
        fact("machine", machine.cpu()["model"])
    fact("vllm", str(read_version(tree)))
    if isinstance(report, dict):  # e.g. no patch is this tree's default (exit 3)
        fact("check_error", report["error"])
        return [{"patch": None, "status": "error", "error": report["error"]}]
    return report


@pytest.fixture(scope="session")
def form(check_report, fact) -> str | None:
    """The patch a plain check judges applicable or applied (or None)."""
    picked = [r for r in check_report if r["status"] in ("applicable", "applied")]
    name = picked[0]["patch"] if picked else None
    fact("form", name)
    fact("patch_status", {r["patch"]: r["status"] for r in check_report})
    return name


@pytest.fixture(scope="session")
def mechanism(tree, fact) -> str:
    """``IR``, ``IR deprecated`` (its words and their file) or ``no IR``."""
    found = "no IR"
    quote = None
    if tree.exists("vllm/ir/op.py"):
        found = "IR"
        for rel in ("vllm/config/kernel.py", "vllm/config/compilation.py"):
            text = tree.read_text(rel) if tree.exists(rel) else ""
            match = DEPRECATION.search(text)
            if match:
                found = "IR deprecated"
                quote = {"file": rel, "text": " ".join(match.group(0).split())}
                break
    fact("mechanism", found)
    fact("mechanism_quote", quote)
    return found


@pytest.fixture(scope="session", autouse=True)
def patched(request, form, fact):
    """``calls.count_modes`` started in a child on a patched copy (plugins off);
    yields a function that waits for it, reverts the copy and returns both."""
    if request.config.getoption("--vllm-wheel") or form is None:
        yield lambda: pytest.skip(
            "no form of the change applies (test_form_applies)"
        )
        return
    from vllm_patch.runtime import child
    from vllm_patch.runtime.patched_copy import patched_copy

    record: dict = {}
    with contextlib.ExitStack() as stack:
        copy = stack.enter_context(
            patched_copy(open_tree(None), select([form])[0], record=record)
        )
        counting = child.start(
            "compat_matrix.checks.calls:count_modes",
            pythonpath=[copy],
            env={"VLLM_PLUGINS": "none"},
            drop_env=[OPT_IN_ENV],
            timeout=900,
        )
        stack.callback(child.stop, counting)

        def finish() -> dict:
            if "counts" not in record:
                record["counts"] = child.finish(counting).value()  # or its log
                stack.close()  # revert the copy: record gets restored, ...
                fact(
                    "patched",
                    {m: record["counts"][m]["calls"] for m in COUNT_MODES},
                )
            return record

        yield finish
