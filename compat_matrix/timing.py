"""Measure what the matrix costs, against the naive way, side by side in one run,
and write the figures to ``compat_matrix/timing.md``, each next to its target.

Warm figures, in this project's own environments (``--env-root``; built first
when missing, which is not timed as a target):

- one live cell re-run after a change to the provider (a comment appended to
  ``patches/cpu_fused_norms/provider.py``, restored afterwards), without e2e;
- all live cells after such a change;
- all cells with nothing changed.

Cold figures, over ``--cold-cells``, one way after the other:

- matrix: ``python -m compat_matrix.cell V`` per cell with an empty uv cache,
  wheel cache and environment root;
- naive: per cell a fresh ``python -m venv``, ``pip install`` of that release
  (where its ``+cpu`` torch is not on the indexes: the plain torch first and the
  wheel with ``--no-deps``, since pip cannot override a pin), this project, and
  the same probe; an empty pip cache.

Disk is ``du`` over everything a way leaves behind (environments and caches
together, so hard-linked files count once); naive environments are measured,
then deleted. The machine's load (``/proc/loadavg``) is recorded beside every
timed step, since other jobs share the cores. Every figure in the output is
measured in the run that writes it.

    python -m compat_matrix.timing [--cold-cells 0.24.0,0.26.0,0.32.0]
                                    [--one 0.32.0] [--skip-naive] [--skip-warm]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.requirements import Requirement

from compat_matrix import pins, versions
from compat_matrix.cell_env import PROJECT, ensure_env, env_dir
from vllm_patch.runtime import machine
from vllm_patch.runtime.cache import CACHE_ENV, fetch_wheel
from vllm_patch.runtime.cpu_torch import BROKEN_BESIDE_CPU_TORCH

HERE = Path(__file__).resolve().parent
CHANGED_FILE = PROJECT / "patches" / "cpu_fused_norms" / "provider.py"
TARGETS = {
    "one_after_change": 20,
    "live_after_change": 300,
    "all_unchanged": 30,
}


def du(*paths: Path) -> int:
    """Bytes on disk for all paths together (hard links counted once)."""
    existing = [str(p) for p in paths if p.exists()]
    if not existing:
        return 0
    out = subprocess.run(
        ["du", "-s", "-c", "-B1", *existing], capture_output=True, text=True, check=True
    ).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def load_text() -> str:
    """The 1, 5 and 15 minute load averages, as ``/proc/loadavg`` writes them."""
    return " ".join(f"{x:.2f}" for x in machine.load_average() or [])


def timed(label: str, fn) -> dict:
    before, t0 = load_text(), time.perf_counter()
    fn()
    seconds = round(time.perf_counter() - t0, 1)
    out = {"seconds": seconds, "load": [before, load_text()]}
    print(
        f"{label}: {out['seconds']} s (load {before} -> {out['load'][1]})", flush=True
    )
    return out


def run_cells(
    cells: list[versions.Cell], env_root: Path, results: Path, env=None
) -> dict:
    """``python -m compat_matrix.cell`` per cell, one after the other."""
    per: dict[str, dict] = {}

    def each() -> None:
        for c in cells:
            per[c.id] = timed(
                f"  cell {c.id}",
                lambda c=c: subprocess.run(
                    [sys.executable, "-m", "compat_matrix.cell", c.id]
                    + ["--env-root", str(env_root), "--results", str(results)],
                    env=env,
                    cwd=PROJECT,
                    stderr=subprocess.DEVNULL,
                ),
            )
            r = json.loads((results / c.result_name).read_text("utf-8"))
            per[c.id].update(
                status=r["status"],
                probe_reused=bool(r.get("probe_reused_from")),
                timings=r["timings"],
            )

    whole = timed(f"{len(cells)} cells", each)
    return whole | {"cells": per}


class ChangedProvider:
    """A real change to the provider (one comment line), undone on exit (which
    is a change too)."""

    def __enter__(self):
        self.original = CHANGED_FILE.read_bytes()
        stamp = datetime.datetime.now().isoformat()
        CHANGED_FILE.write_bytes(self.original + f"# measure {stamp}\n".encode())

    def __exit__(self, *exc):
        CHANGED_FILE.write_bytes(self.original)


def prepare(c: versions.Cell, env_root: Path) -> None:
    """The cell's environment as ``compat_matrix.cell`` builds it, no probe."""
    from compat_matrix import cell

    pin = pins.torch_pin(pins.read_pins(c, [])["requires_dist"])
    torch_req, _ = cell.torch_choice(pin, env_dir(c, env_root), None, [])
    if torch_req:
        ensure_env(c, fetch_wheel(c.package, c.version), pin, env_root=env_root,
                   torch_index=None, torch_req=torch_req)  # fmt: skip


def warm_figures(every: list[versions.Cell], one: str, env_root: Path, work: Path):
    """``every``: the cells measured (all of versions.json unless told)."""
    live = [c for c in every if c.mode == "full"]
    results = work / "warm-results"
    f: dict = {"env_root": str(env_root)}
    f["priming"] = timed("environments built or reused (not a target)", lambda: [
        prepare(c, env_root) for c in live
    ])  # fmt: skip
    # Static cells have no environment: one run leaves the result they reuse.
    static_only = [c for c in every if c.mode != "full"]
    f["priming_static"] = run_cells(static_only, env_root, results)
    with ChangedProvider():
        f["live_after_change"] = run_cells(live, env_root, results)
        f["all_unchanged"] = run_cells(every, env_root, results)
    # Restoring the provider is a change again: the one cell probes afresh.
    f["one_after_change"] = run_cells([versions.find(one)], env_root, results)
    return f


def naive_cell(c: versions.Cell, work: Path, pip_env: dict) -> dict:
    """Fresh venv, pip install, this project, the probe: timed, then deleted."""
    venv = work / f"naive-{c.version}"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]

    def run(cmd: list[str]) -> None:
        subprocess.run(cmd, check=True, env=pip_env, cwd=PROJECT)

    def install() -> None:
        run([sys.executable, "-m", "venv", str(venv)])
        meta = pins.read_pins(c, [])
        pin = pins.torch_pin(meta["requires_dist"])
        if c.mode == "full" and pin and not pins.torch_available(pin, [])[0]:
            # pip cannot replace the wheel's pin: the plain torch and the other
            # requirements first, then the wheel without its dependencies.
            others = [
                r
                for r in meta["requires_dist"]
                if Requirement(r).name != "torch" and "extra" not in r
            ]
            run(pip + [pins.plain_build(pin), *others])
            run(pip + ["--no-deps", c.requirement])
        elif c.mode == "full":
            run(pip + [c.requirement])
        else:  # static cells: the wheel only, as the matrix does
            run(pip + ["--no-deps", c.requirement])
        if c.mode == "full":
            run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q"]
                + list(BROKEN_BESIDE_CPU_TORCH))  # fmt: skip
            run(pip + ["-e", str(PROJECT)])

    out = {"install": timed(f"  naive install {c.id}", install)}
    if c.mode == "full":
        ran: dict = {}

        def probe() -> None:
            proc = subprocess.run(
                [str(venv / "bin" / "python"), "-m", "compat_matrix.probe"],
                cwd=PROJECT,
                capture_output=True,
                text=True,
            )
            ran["returncode"] = proc.returncode
            try:  # what it found, so that a probe that broke is not timed as one
                ran["summary"] = json.loads(proc.stdout)["summary"]
            except (ValueError, KeyError):
                ran["summary"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]

        out["probe"] = timed(f"  naive probe {c.id}", probe) | ran
    out["disk"] = du(venv)
    shutil.rmtree(venv)  # disk is limited; the size is recorded
    return out


def cold_figures(cells: list[versions.Cell], work: Path, skip_naive: bool) -> dict:
    f: dict = {}
    uv_cache, wheels, env_root = work / "uv-cache", work / "vp-cache", work / "envs"
    env = os.environ | {"UV_CACHE_DIR": str(uv_cache), CACHE_ENV: str(wheels)}
    f["matrix"] = run_cells(cells, env_root, work / "cold-results", env)
    f["matrix_disk"] = {
        "envs": du(env_root),
        "uv_cache": du(uv_cache),
        "wheel_cache": du(wheels),
        "all": du(env_root, uv_cache, wheels),
    }
    shutil.rmtree(env_root, ignore_errors=True)
    shutil.rmtree(uv_cache, ignore_errors=True)
    if not skip_naive:
        pip_cache = work / "pip-cache"
        pip_env = os.environ | {"PIP_CACHE_DIR": str(pip_cache)}
        per: dict = {}
        f["naive"] = timed(
            f"naive {len(cells)} cells",
            lambda: per.update({c.id: naive_cell(c, work, pip_env) for c in cells}),
        )
        f["naive"]["cells"] = per
        f["naive_disk"] = {
            "envs": sum(p["disk"] for p in per.values()),
            "pip_cache": du(pip_cache),
        }
        shutil.rmtree(pip_cache, ignore_errors=True)
    return f


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compat_matrix.timing")
    parser.add_argument("--cold-cells", default="0.24.0,0.26.0,0.32.0")
    parser.add_argument("--one", default="0.32.0", help="the one-cell re-run")
    parser.add_argument(
        "--warm-cells", help="comma-separated cell ids (default: every cell)"
    )
    parser.add_argument(
        "--env-root", type=Path, default=PROJECT / ".nox" / "compat-envs"
    )
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--skip-warm", action="store_true")
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--work", type=Path, help="scratch folder (default: temp)")
    parser.add_argument("--out", type=Path, default=HERE / "timing.md")
    parser.add_argument("--render", type=Path, help="only re-render a figures.json")
    args = parser.parse_args(argv)
    if args.render:
        args.out.write_text(
            render_timing_md(json.loads(args.render.read_text("utf-8"))), "utf-8"
        )
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="compat-measure-"))
    work.mkdir(parents=True, exist_ok=True)
    save = work / "figures.json"
    every = (
        [versions.find(x) for x in args.warm_cells.split(",")]
        if args.warm_cells
        else versions.load()
    )
    here = machine.facts()  # figures differ several times between CPUs
    figures: dict = {
        "date": datetime.date.today().isoformat(),
        "cores": os.cpu_count(),
        "machine": machine.summary(here),
        "cpu_flags": here["key_flags"],
        "python": platform.python_version(),
        "cells": [c.id for c in every],
        "cold_cells": args.cold_cells.split(","),
    }
    if not args.skip_warm:
        run = provenance()
        figures["warm"] = warm_figures(every, args.one, args.env_root, work)
        figures["warm"]["run"] = run
        save.write_text(json.dumps(figures, indent=1), "utf-8")
        args.out.write_text(
            render_timing_md(figures), "utf-8"
        )  # what is measured so far
    if not args.skip_cold:
        cold = [versions.find(x) for x in figures["cold_cells"]]
        run = provenance()
        figures["cold"] = cold_figures(cold, work, args.skip_naive)
        figures["cold"]["run"] = run
        save.write_text(json.dumps(figures, indent=1), "utf-8")
    args.out.write_text(render_timing_md(figures), "utf-8")
    print(f"figures: {save}; report: {args.out}")
    return 0


def _verdict(seconds: float, target: float) -> str:
    return "met" if seconds <= target else "missed"


def provenance() -> dict:
    """When a part of the measurement started, and on which commit."""
    proc = subprocess.run(
        ["git", "-C", str(PROJECT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    )
    return {
        "started": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        "commit": proc.stdout.strip() or None,
    }


def _run_line(part: dict) -> list[str]:
    run = part.get("run")
    if not run:
        return []
    return [f"Started {run['started']}, at commit `{run['commit']}`.", ""]


def _machine_text(f: dict) -> str:
    if "machine" not in f:  # figures saved before the machine was recorded
        return f"{f['cores']} cores, Python {f['python']}"
    flags = ", ".join(f["cpu_flags"])
    python = f"Python {f['python']}"
    return f"{f['machine']}, {python}; CPU flags vLLM's kernels use: {flags}"


def render_timing_md(f: dict) -> str:
    lines = [
        "# Compatibility matrix: time and disk",
        "",
        f"Measured {f['date']} by `python -m compat_matrix.timing` on this "
        f"project's machine ({_machine_text(f)}). The load "
        "average (1, 5, 15 min, from `/proc/loadavg` before and after each step) "
        "is given beside every figure: other jobs on the same cores make every "
        "figure several times what it is on an idle machine. Re-run the script "
        "to compare.",
        "",
    ]
    if f.get("warm"):
        lines += _warm_section(f["warm"])
    if f.get("cold"):
        lines += _cold_section(f, f["cold"])
    return "\n".join(lines)


def _warm_section(warm: dict) -> list[str]:
    lines = ["## After a change, and with nothing changed", ""]
    lines += _run_line(warm)
    lines += [
        "In this project's own environments, each step after the one before "
        "(`python -m compat_matrix.cell V` per cell, without e2e). A change is "
        "one comment line appended to `patches/cpu_fused_norms/provider.py` "
        "(restored afterwards): every live cell's probe must run again.",
        "",
        "| step | target | measured | load before -> after |",
        "|---|---|---|---|",
    ]
    every = versions.load()
    n_live = len([c for c in every if c.mode == "full"])
    live, cells = warm["live_after_change"]["cells"], warm["all_unchanged"]["cells"]

    def of(n: int, total: int) -> str:
        return f"all {n}" if n == total else f"{n} of the {total} (target: all)"

    rows = (
        ("one live cell re-run after a change", "one_after_change"),
        (f"{of(len(live), n_live)} live cells after a change", "live_after_change"),
        (f"{of(len(cells), len(every))} cells, nothing changed", "all_unchanged"),
    )
    for label, key in rows:
        got, target = warm[key], TARGETS[key]
        lines.append(
            f"| {label} | <= {target} s | {got['seconds']} s, "
            f"{_verdict(got['seconds'], target)} | {' -> '.join(got['load'])} |"
        )
    lines += ["", "Per cell, seconds (probe part in brackets):", ""]
    lines += [
        "| cell | after a change | nothing changed |",
        "|---|---|---|",
    ]
    for cell, after in live.items():
        same = cells[cell]
        lines.append(
            f"| {cell} | {after['seconds']} ({after['timings'].get('probe')}) | "
            f"{same['seconds']}{' (probe reused)' if same['probe_reused'] else ''}"
            " |"
        )
    lines.append("")
    return lines


def _cold_section(f: dict, cold: dict) -> list[str]:
    m, md = cold["matrix"], cold["matrix_disk"]
    lines = [
        "## Cold: the matrix against the naive way",
        "",
        *_run_line(cold),
        f"Over {', '.join(f['cold_cells'])}, one way after the other. **matrix**: "
        "`python -m compat_matrix.cell V` per cell with an empty uv cache, wheel "
        "cache and environment root. **naive**: per cell a fresh venv, `pip install` "
        "of the release (the plain torch first where its `+cpu` pin is not on the "
        "indexes), this project, the same probe; an empty pip cache.",
        "",
        "| way | wall | load before -> after | disk after all cells |",
        "|---|---|---|---|",
    ]
    if "naive" in cold:
        n, nd = cold["naive"], cold["naive_disk"]
        lines.append(
            f"| naive | {n['seconds']} s | {' -> '.join(n['load'])} | "
            f"{gb(nd['envs'] + nd['pip_cache'])} (venvs {gb(nd['envs'])}, pip "
            f"cache {gb(nd['pip_cache'])}) |"
        )
    lines.append(
        f"| matrix | {m['seconds']} s | {' -> '.join(m['load'])} | "
        f"{gb(md['all'])} (envs {gb(md['envs'])}, uv cache {gb(md['uv_cache'])}, "
        f"wheels {gb(md['wheel_cache'])}; hard links counted once) |"
    )
    if "naive" in cold:
        lines += _against_naive(f, cold)
    lines.append("")
    return lines


def _against_naive(f: dict, cold: dict) -> list[str]:
    """The cold target's verdict, then the two ways cell by cell."""
    m, md = cold["matrix"], cold["matrix_disk"]
    n, nd = cold["naive"], cold["naive_disk"]
    ratio = n["seconds"] / m["seconds"]
    lines = [
        "",
        f"Target: cold matrix at least 2x faster than naive: {ratio:.2f}x, "
        f"{'met' if ratio >= 2 else 'missed'}. Disk: matrix "
        f"{gb(md['all'])} against naive {gb(nd['envs'] + nd['pip_cache'])}.",
        "",
        "| cell | naive install / probe | matrix whole cell (environment "
        "/ probe) | what the naive probe found | the matrix cell |",
        "|---|---|---|---|---|",
    ]
    for c in f["cold_cells"]:
        nc, mc = n["cells"][c], m["cells"][c]
        probe = nc.get("probe", {}).get("seconds", "–")
        found = nc.get("probe", {}).get("summary", "not recorded by this run")
        lines.append(
            f"| {c} | {nc['install']['seconds']} / {probe} | {mc['seconds']} "
            f"({mc['timings'].get('env')} / {mc['timings'].get('probe')}) | "
            f"{found} | {mc.get('status')} |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
