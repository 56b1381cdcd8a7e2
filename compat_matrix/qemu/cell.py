"""The aarch64 cell under qemu-user, as root (docs/compat.md): per side, the
cases (a new process after one that killed it), then its eager conformance
table, written as JUnit XML like the other cells'."""

import argparse
import contextlib
import itertools
import json
import os
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from xml.etree import ElementTree

from compat_matrix.checks.calls import BF16_RTOL, NORM_KERNELS
from compat_matrix.conformance_table import DIMENSIONS, thread_layouts
from compat_matrix.qemu import chroot
from compat_matrix.report import result_file
from patcher.errors import PatchError
from patcher.files import kind, write_output
from patches.cpu_fused_norms.identity import OPS, OPT_IN_ENV
from vllm_patch.runtime.cache import cache_dir

# QEMU_CPU -> has BF16, what it stands for. The build is -march=armv8.2-a+bf16+...:
# its bfloat16 kernels need BF16 (and round with it); float32 runs them everywhere.
MACHINES = {
    "neoverse-n1": (
        False,
        "Armv8.2 without BF16: the Graviton2 / Ampere Altra class",
    ),
    "max": (True, "every extension qemu emulates, BF16 included"),
}
# Per dtype, how far from native a kernel may be: float32 measured 3e-7 here;
# bfloat16 rounds once (rms_norm) or twice (the fused add).
TOLERANCE = {"float32": 1e-5, "bfloat16": BF16_RTOL}
CASES = [f"{dtype}/{op}" for dtype in TOLERANCE for op in OPS]
# Per side: its table's form and chroot environment (/opt/cell: calls.py, the
# table): the patched tree (the project last, for the rule; no plugin), or the
# plugin opted in.
TABLE_FORMS = {"patched": "custom_op", "provider": "provider"}
SIDE_ENV = {
    "patched": {
        "PYTHONPATH": "/opt/cell:/opt/patched:/opt/sp:/opt/project",
        "VLLM_PLUGINS": "none",
    },
    "provider": {"PYTHONPATH": "/opt/cell:/opt/project:/opt/sp", OPT_IN_ENV: "1"},
}


CELLS_PER_DTYPE = len(list(itertools.product(*DIMENSIONS.values())))


def result_path(cpu: str) -> Path:
    return result_file(chroot.RELEASE, f"-aarch64-{cpu}")


def parse_run(output: str, returncode: int, asked: list[str]) -> dict:
    """A process's JSON lines: ``setup``, and ``cases`` (case -> result). It died
    in the case started but not finished, else (in setup) in every case asked."""
    setup, cases, started = None, {}, None
    for line in output.splitlines():
        doc = json.loads(line) if line.startswith("{") else {}
        if "setup" in doc:
            setup = doc["setup"]
        elif doc.pop("started", False):
            started = doc["case"]
        elif doc:
            cases[doc.pop("case")] = doc
            started = None
    if returncode:
        for case in [started] if started else asked:
            cases[case] = {"died": death(returncode), "in_setup": started is None}
    return {"setup": setup, "cases": cases}


def judge(cpu: str, dtype: str, cases: dict) -> list[str]:
    """Why the side fails in ``dtype`` (a death, an exception, calls, numerics)."""
    bf16, failures = MACHINES[cpu][0], []
    for op in OPS:
        case = cases[f"{dtype}/{op}"]
        if "died" in case or "error" in case:
            why = f"the process died ({case['died']})" if "died" in case else None
            failures.append(f"{op}: {why or 'raised ' + case['error']}")
            continue
        wanted = dtype != "bfloat16" or bf16
        expected = {k: int(wanted and k == f"_C::{op}") for k in NORM_KERNELS}
        if case["calls"] != expected:
            failures.append(
                f"{op}: kernel calls {case['calls']}, the rule expects {expected} "
                f"({'a' if bf16 else 'no'} BF16 on QEMU_CPU={cpu})"
            )
        far, bound = case["rtol_vs_native"], TOLERANCE[dtype]
        if far > bound:
            failures.append(f"{op}: {far:.3g} from native (tolerance {bound})")
    return failures


def junit(tests: list[tuple[str, float, list[str]]], facts: dict, seconds: float):
    """JUnit XML as pytest writes it, the facts as JSON-encoded properties."""
    add = ElementTree.SubElement
    failed = sum(bool(f) for *_, f in tests)
    suites = ElementTree.Element("testsuites", name="pytest tests")
    suite = add(
        suites,
        "testsuite",
        name="pytest",
        errors="0",
        skipped="0",
        failures=str(failed),
        tests=str(len(tests)),
        time=f"{seconds:.3f}",
        hostname="qemu-aarch64",
    )
    suite.set("timestamp", datetime.now(timezone.utc).isoformat())
    props = add(suite, "properties")
    for name, value in facts.items():
        add(props, "property", name=name, value=json.dumps(value))
    for name, spent, failures in tests:
        case = add(suite, "testcase", classname="qemu_aarch64", name=name)
        case.set("time", f"{spent:.3f}")
        if failures:
            failure = add(case, "failure", message="; ".join(failures))
            failure.text = "\n".join(failures)
    return ElementTree.tostring(suites, encoding="unicode", xml_declaration=True)


def cell_tests(cpu: str, runs: dict) -> list[tuple[str, float, list[str]]]:
    tests = []
    for side, dtype in itertools.product(TABLE_FORMS, TOLERANCE):
        ran = runs[side]["cases"]
        spent = sum(
            v.get("seconds", 0) for k, v in ran.items() if k.startswith(dtype)
        )
        tests.append((f"test_{side}_{dtype}", spent, judge(cpu, dtype, ran)))
    return tests


def death(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def log_folder(root: Path) -> Path:
    """``<root>-logs``, made if missing; a link or another user's folder refused."""
    logs = root.parent / f"{root.name}-logs"
    with contextlib.suppress(FileExistsError):
        os.mkdir(logs, 0o755)
    found = os.lstat(logs)
    if stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid():
        return logs
    what = kind(found.st_mode)
    if stat.S_ISDIR(found.st_mode):
        what = f"a folder owned by uid {found.st_uid}"
    looked_for = "a folder of yours for the cell's logs"
    raise PatchError("not a log folder", str(logs), looked_for, what)


def append_log(logs: Path, name: str, text: str) -> None:
    """``text`` appended to ``logs/name``, never through a link, FIFO or device
    planted there (O_NOFOLLOW, O_NONBLOCK, a regular file checked)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    folder = os.open(logs, flags)
    try:
        flags = (
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        )
        try:
            fd = os.open(name, flags, 0o644, dir_fd=folder)
        except OSError as exc:
            found = f"{exc.strerror} (a link or special file)"
            raise PatchError(
                "refused", str(logs / name), "a log file", found
            ) from None
    finally:
        os.close(folder)
    with open(fd, "a", closefd=True) as out:
        mode = os.fstat(out.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise PatchError("refused", str(logs / name), "a log file", kind(mode))
        out.write(text)


# The chroot processes running now: stopped when the cell is (a signal, an
# error), so nothing holds /proc or /sys when they are unmounted.
RUNNING: set[subprocess.Popen] = set()


@contextlib.contextmanager
def children_stopped():
    """Every chroot process still running killed on leaving the block early."""
    try:
        yield
    finally:
        for proc in list(RUNNING):
            proc.kill()


def in_cell(root: Path, cpu: str, side: str, command: tuple, logs: Path):
    """``command`` in the chroot, only the side's environment; output to its log."""
    env = {
        "PATH": "/usr/bin:/bin",
        "QEMU_CPU": cpu,
        "OMP_NUM_THREADS": "1",
        "HOME": "/root",
        **SIDE_ENV[side],
    }
    cmd = ["chroot", str(root), "env", "-i", *(f"{k}={v}" for k, v in env.items())]
    with subprocess.Popen(
        [*cmd, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        RUNNING.add(proc)
        try:
            out = proc.communicate()[0]
        finally:
            RUNNING.discard(proc)
    append_log(logs, f"{cpu}-{side}.log", out)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def run_table(root: Path, cpu: str, side: str, threads: int, logs: Path) -> dict:
    """The side's eager conformance table's summary at an OpenMP team of
    ``threads``, or how it died."""
    script = "/opt/cell/conformance_table.py"
    command = ("python3", script, TABLE_FORMS[side], str(threads))
    proc = in_cell(root, cpu, side, command, logs)
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not last:
        return {"died": death(proc.returncode) if proc.returncode else "no summary"}
    return json.loads(last[-1])


def table_tests(tables: dict) -> list[tuple[str, float, list[str]]]:
    """A test per form and thread layout: it lived, every cell counted, none
    wrong (a bias native lacks included), the stream's norm within 1%."""
    tests = []
    for (form, threads), found in tables.items():
        name = f"test_{form}_table_{threads}_threads"
        if "died" in found:
            tests.append((name, 0.0, [f"died: {found['died']}"]))
            continue
        counted = [c["kernel"] + c["native"] for c in found["eager"].values()]
        failures = [] if counted == [CELLS_PER_DTYPE] * 3 else [f"cells {counted}"]
        wrong = sum(c["wrong"] for c in found["eager"].values())
        failures += [f"{wrong} cells against the rule"] if wrong else []
        refuted = [
            f"{dtype} {op}"
            for dtype, ops in found["probe"].items()
            for op, b in ops.items()
            if b.get("matches") is False
            and found["eager"][dtype]["bias"][op]["cells"]
        ]
        if refuted:
            failures.append(
                f"the kernel runs where its bias is native's+: {refuted}"
            )
        if abs(found["drift"]["ratio"] - 1) >= 0.01:
            failures.append(f"residual stream drifted: {found['drift']}")
        tests.append((name, 0.0, failures))
    return tests


def table_facts(cpu: str, tables: dict, vllm: str | None) -> dict:
    """The ``conformance`` property as the x86 tables have it (eager only), a
    table per thread layout."""
    built = []
    for threads in sorted({t for _, t in tables}):
        lived = {
            form: found
            for (form, t), found in tables.items()
            if t == threads and "died" not in found
        }
        first = next(iter(lived.values()), {})
        table = {
            "build": first.get("drift", {}).get("build", []),
            "forced": False,
            "threads": threads,
            "cpus": first.get("threads", {}).get("cpus"),
            "probe": first.get("probe", {}),
            "forms": lived,
        }
        built.append(table)
    where = f"aarch64 under qemu-user, QEMU_CPU={cpu} ({MACHINES[cpu][1]})"
    return {"conformance": {"machine": where, "vllm": vllm, "tables": built}}


def run_side(root: Path, cpu: str, side: str, logs: Path) -> dict:
    """Every case of one side on one CPU, a process again after each death."""
    remaining, cases, processes = list(CASES), {}, []
    setup, began = None, time.monotonic()
    command = ("python3", "/opt/cell/calls.py", side)
    while remaining:
        started = time.monotonic()
        proc = in_cell(root, cpu, side, (*command, *remaining), logs)
        parsed = parse_run(proc.stdout, proc.returncode, remaining)
        setup = setup or parsed["setup"]
        cases.update(parsed["cases"])
        spent = round(time.monotonic() - started, 1)
        processes.append(
            {"cases": remaining, "returncode": proc.returncode, "seconds": spent}
        )
        if not parsed["cases"]:
            break
        remaining = [c for c in remaining if c not in cases]
    spent = round(time.monotonic() - began, 1)
    return {
        "setup": setup,
        "cases": cases,
        "processes": processes,
        "seconds": spent,
    }


def bf16_calls(cases: dict) -> dict:
    """The bfloat16 cases' kernel calls, summed as the other cells count."""
    found = [cases[f"bfloat16/{op}"].get("calls", {}) for op in OPS]
    return {"eager": {k: sum(c.get(k, 0) for c in found) for k in NORM_KERNELS}}


def cell_facts(cpu: str, runs: dict, applied: dict[str, str]) -> dict:
    """The facts the report shows, and every case and process in ``runs``."""
    setup = runs["provider"]["setup"] or runs["patched"]["setup"] or {}
    provider = (runs["provider"]["setup"] or {}).get("provider_status") or {}
    return {
        "label": f"{chroot.RELEASE.partition('==')[2]} aarch64, QEMU_CPU={cpu}",
        "kernel_build": "aarch64",
        "machine": f"qemu-user, QEMU_CPU={cpu} ({MACHINES[cpu][1]})",
        "torch": setup.get("torch"),
        "vllm": setup.get("vllm"),
        "form": next(iter(applied), None),
        "patch_status": applied,
        "mechanism": "no IR",
        "route": provider.get("route"),
        "provider": bf16_calls(runs["provider"]["cases"]),
        "patched": bf16_calls(runs["patched"]["cases"]),
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
    cpus = parser.parse_args(argv).cpu
    root = Path(os.environ.get("VLLMPATCH_ARM_ROOT") or cache_dir() / "arm64-root")
    applied = chroot.prepare(root)
    logs = log_folder(root)
    jobs = list(itertools.product(cpus, TABLE_FORMS))
    with (
        chroot.proc_mounted(root),
        ThreadPoolExecutor(len(jobs)) as pool,
        children_stopped(),
    ):
        futures = {job: pool.submit(run_side, root, *job, logs) for job in jobs}
        done = {job: f.result() for job, f in futures.items()}
        began = time.monotonic()
        table_jobs = list(itertools.product(cpus, TABLE_FORMS, thread_layouts()))
        futures = {
            job: pool.submit(run_table, root, *job, logs) for job in table_jobs
        }
        tables = {job: f.result() for job, f in futures.items()}
        table_seconds = time.monotonic() - began
    for cpu in cpus:
        runs = {side: done[cpu, side] for side in TABLE_FORMS}
        facts = cell_facts(cpu, runs, applied)
        seconds = max(r["seconds"] for r in runs.values())
        write_output(result_path(cpu), junit(cell_tests(cpu, runs), facts, seconds))
        found = {
            (TABLE_FORMS[side], threads): table
            for (c, side, threads), table in tables.items()
            if c == cpu
        }
        table = table_facts(cpu, found, facts["vllm"])
        kept = result_file("conformance", f"-aarch64-{cpu}")
        write_output(kept, junit(table_tests(found), table, table_seconds))
        print(f"wrote {result_path(cpu)} and {kept}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except PatchError as exc:  # a result's name holds a link, FIFO or folder
        print(f"compat_matrix.qemu.cell: error: {exc}", file=sys.stderr)
        raise SystemExit(int(exc.exit_code)) from None
