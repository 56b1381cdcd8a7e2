"""One cell of the compatibility matrix: one vLLM version.

1. Read the wheel's pins (``pip install --dry-run --report``: metadata only).
2. Fetch the wheel into the user cache and run the static checks on it.
3. If its torch can be obtained from the configured indexes, build (or reuse) an
   environment with that vLLM, its torch and this project, and run the probe
   there. Otherwise the probe's checks are recorded as ``skip``.
4. Write ``compat_matrix/results/<package>-<version>.json``.

The steps live beside this module: ``pins`` (metadata and torch availability),
``environments`` (building or reusing the cell's venv under ``--env-root``,
default ``.nox/compat-envs``), ``probe_run`` and ``probe_reuse`` (running the
probe, or reusing the last one when nothing it depends on changed). This module
strings them together and writes the result.

Exit codes: 0 every check passed or skipped, 1 a check failed, 75 the registry
did not answer (the cell is ``unavailable``), 2 usage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from compat_matrix import versions
from compat_matrix.environments import (
    PROJECT,
    EnvError,
    ensure_env,
    env_dir,
    installed_torch,
    installer,
    read_stamp,
)
from compat_matrix.log import log
from compat_matrix.pins import (
    Unavailable,
    plain_build,
    read_pins,
    torch_available,
    torch_pin,
)
from compat_matrix.probe_reuse import (
    previous_probe,
    previous_static,
    probe_key,
    static_key,
)
from compat_matrix.probe_run import run_probe, skipped_probe
from patcher.cache import cache_dir, fetch_wheel
from patcher.errors import PatchError

RESULTS = Path(__file__).resolve().parent / "results"
# Not VLLM_*: vLLM warns about every VLLM_* variable it does not know, and
# --fail-on-environ-validation refuses to start.
TORCH_INDEX_ENV = "VLLMPATCH_TORCH_INDEX"
ENV_ROOT_ENV = "VLLMPATCH_COMPAT_ENVS"
FRESH_ENV = "VLLMPATCH_COMPAT_FRESH"
EX_UNAVAILABLE = 75


def run_cell(
    cell: versions.Cell,
    *,
    env_root: Path,
    results: Path = RESULTS,
    torch_index: str | None = None,
    probe_args: tuple[str, ...] | list[str] = (),
    probe_timeout: int = 900,
    fresh: bool = False,
) -> dict[str, Any]:
    started = time.perf_counter()
    timings: dict[str, float] = {}
    index_args = ["--extra-index-url", torch_index] if torch_index else []
    result: dict[str, Any] = {
        "schema": 1,
        "cell": cell.id,
        "package": cell.package,
        "version": cell.version,
        "mode": cell.mode,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "status": None,
        "reason": "",
        "torch": {"pin": None, "available": None, "stand_in": None, "used": None},
        "env": None,
        "static": None,
        "probe": None,
        "checks": [],
        "timings": timings,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
    }

    def lap(name: str, t0: float) -> None:
        timings[name] = round(time.perf_counter() - t0, 2)

    try:
        t0 = time.perf_counter()
        pins = read_pins(cell, index_args)
        pin = torch_pin(pins["requires_dist"])
        result["torch"]["pin"] = pin
        lap("pins", t0)

        t0 = time.perf_counter()
        wheel = fetch_wheel(cell.package, cell.version, *index_args)
        lap("wheel", t0)
    except (Unavailable, subprocess.CalledProcessError, FileNotFoundError) as exc:
        result.update(status="unavailable", reason=str(exc))
        result["checks"] = skipped_probe(f"unavailable: {exc}")
        return _finish(result, results, started, env_root)

    t0 = time.perf_counter()
    result["static_key"] = key = static_key(wheel)
    previous = None if fresh else previous_static(results / cell.result_name, key)
    result["static_reused"] = previous is not None
    if previous is None:
        # Imported only here: it brings LibCST, most of a warm cell's start-up.
        from compat_matrix import static

        try:
            previous = static.check_wheel(wheel)
        except PatchError as exc:  # not a vLLM wheel at all: say so, keep going
            previous = {
                "vllm": {"version": None, "location": wheel.name},
                "checks": [static._check("wheel_ir", "fail", exc.message)],
                "ok": False,
            }
    result["static"] = previous
    lap("static", t0)

    probe_checks: list[dict[str, Any]]
    if cell.mode != "full":
        probe_checks = skipped_probe(f"static only: {cell.package} is not a CPU build")
    elif pin is None:
        probe_checks = skipped_probe("the wheel pins no torch for this platform")
    else:
        t0 = time.perf_counter()
        try:
            torch_req, why = torch_choice(
                pin, env_dir(cell, env_root), torch_index, index_args
            )
        except Unavailable as exc:
            result.update(status="unavailable", reason=str(exc))
            torch_req, why = None, ""
        lap("torch_check", t0)
        stand_in = torch_req if torch_req and torch_req != pin else None
        result["torch"]["available"] = (
            torch_req == pin if result["status"] is None else None
        )
        result["torch"]["stand_in"] = stand_in
        if result["status"] == "unavailable":
            probe_checks = skipped_probe(f"unavailable: {result['reason']}")
        elif torch_req is None:
            torch = pin.removeprefix("torch==")
            probe_checks = skipped_probe(
                f"torch {torch} not available from the configured indexes, "
                "nor its plain build"
            )
            result["torch"]["why"] = why
        elif stand_in and installer() != "uv":
            probe_checks = skipped_probe(
                f"{pin} is not on the configured indexes; {stand_in} could stand "
                "in, but overriding the wheel's pin needs uv (pip has none)"
            )
        else:
            probe_checks = _probe_in_env(
                cell,
                wheel,
                pin,
                torch_req,
                env_root,
                torch_index,
                list(probe_args),
                probe_timeout,
                result,
                lap,
                results,
                fresh,
            )
    result["checks"] = probe_checks + result["static"]["checks"]
    return _finish(result, results, started, env_root)


def torch_choice(
    pin: str, env: Path, torch_index: str | None, index_args: list[str]
) -> tuple[str | None, str]:
    """(the torch requirement to install, "") -- the pin itself, or its plain
    build standing in when only that is on the indexes -- or (None, why not).
    An environment built for this pin and index answers without asking the
    registry."""
    stamp = read_stamp(env) or {}
    if (
        stamp.get("torch") == pin
        and stamp.get("torch_index") == torch_index
        and stamp.get("torch_installed")
    ):
        return stamp["torch_installed"], ""
    ok, why = torch_available(pin, index_args)
    if ok:
        return pin, ""
    plain = plain_build(pin)
    if plain and torch_available(plain, index_args)[0]:
        return plain, ""
    return None, why


def _probe_in_env(
    cell,
    wheel,
    pin,
    torch_req,
    env_root,
    torch_index,
    probe_args,
    timeout,
    result,
    lap,
    results,
    fresh,
):
    """The probe's checks for a cell whose torch is obtainable; fills ``result``'s
    env, torch, probe and probe_key entries on the way."""
    t0 = time.perf_counter()
    try:
        env, reused = ensure_env(
            cell,
            wheel,
            pin,
            env_root=env_root,
            torch_index=torch_index,
            torch_req=torch_req,
        )
    except EnvError as exc:
        lap("env", t0)
        return [
            {
                "name": "install",
                "status": "fail",
                "reason": str(exc)[:500],
                "seconds": round(time.perf_counter() - t0, 2),
                "details": {},
            }
        ] + skipped_probe("the environment could not be built")
    lap("env", t0)
    result["env"] = {
        "path": str(env),
        "reused": reused,
        "installer": installer(),
    }
    result["torch"]["used"] = installed_torch(env)
    t0 = time.perf_counter()
    key = probe_key(env, probe_args)
    result["probe_key"] = key
    previous = None if fresh else previous_probe(results / cell.result_name, key)
    if previous is not None:
        probe, error = previous["probe"], ""
        result["probe_reused_from"] = (
            previous.get("probe_reused_from") or previous["date"]
        )
    else:
        probe, error = run_probe(env, probe_args, timeout)
    lap("probe", t0)
    result["probe"] = probe
    if probe is None:
        return [
            {
                "name": "probe",
                "status": "fail",
                "reason": error,
                "seconds": 0.0,
                "details": {},
            }
        ] + skipped_probe("the probe gave no result")
    seen = {c["name"] for c in probe["checks"]}
    return probe["checks"] + [
        c
        for c in skipped_probe("the probe did not report it")
        if c["name"] not in seen and c["name"] != "e2e"
    ]


def portable(value: Any, places: dict[str, str]) -> Any:
    """``value`` with every absolute path under one of ``places`` (path ->
    placeholder) written relative to it: a committed result names no folder of
    the machine that made it."""
    if isinstance(value, dict):
        return {k: portable(v, places) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, places) for v in value]
    if isinstance(value, str):
        for path, placeholder in places.items():
            # The folder itself, not a longer name that starts with it.
            value = re.sub(re.escape(path) + r"(?![\w.-])", placeholder, value)
    return value


def _places(env_root: Path) -> dict[str, str]:
    """Folders a result may mention, most specific first."""
    found = {
        str(env_root.resolve()): "<envs>",
        str(PROJECT): ".",
        str(cache_dir().resolve()): "<vllm-patch cache>",
        str(Path(tempfile.gettempdir()).resolve()): "<tmp>",
        str(Path.home()): "~",
    }
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))


def _finish(
    result: dict[str, Any], results: Path, started: float, env_root: Path
) -> dict[str, Any]:
    result = portable(result, _places(env_root))
    if result["status"] is None:
        failed = [c["name"] for c in result["checks"] if c["status"] == "fail"]
        result["status"] = "fail" if failed else "pass"
        result["reason"] = f"failed: {', '.join(failed)}" if failed else ""
    result["timings"]["total"] = round(time.perf_counter() - started, 2)
    results.mkdir(parents=True, exist_ok=True)
    out = (
        results
        / versions.Cell(
            result["cell"], result["package"], result["version"], result["mode"]
        ).result_name
    )
    out.write_text(json.dumps(result, indent=1) + "\n", "utf-8")
    log(
        f"{result['cell']}: {result['status']} {result['reason']} "
        f"({result['timings']['total']} s) -> {out}"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compat_matrix.cell", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "cell",
        help="a cell id from versions.json (0.32.0, vllm==0.33.0) "
        "or any PACKAGE==VERSION",
    )
    parser.add_argument(
        "--torch-index",
        default=os.environ.get(TORCH_INDEX_ENV),
        help=f"extra index for +cpu torch builds (env {TORCH_INDEX_ENV}), "
        "e.g. https://download.pytorch.org/whl/cpu",
    )
    parser.add_argument(
        "--env-root",
        type=Path,
        default=Path(os.environ.get(ENV_ROOT_ENV, PROJECT / ".nox" / "compat-envs")),
    )
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--e2e", action="store_true", help="also start the engine (slow)"
    )
    parser.add_argument(
        "--probe-timeout",
        type=int,
        help="seconds (default: 900, or 5400 with --e2e: two engine runs)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        default=bool(os.environ.get(FRESH_ENV)),
        help="run the probe even when nothing it depends on changed "
        f"(env {FRESH_ENV}=1)",
    )
    args = parser.parse_args(argv)
    cell = versions.find(args.cell)
    result = run_cell(
        cell,
        env_root=args.env_root,
        results=args.results,
        torch_index=args.torch_index,
        probe_args=["--e2e"] if args.e2e else [],
        probe_timeout=args.probe_timeout or (5400 if args.e2e else 900),
        fresh=args.fresh,
    )
    return {"pass": 0, "fail": 1, "unavailable": EX_UNAVAILABLE}[result["status"]]


if __name__ == "__main__":
    sys.exit(main())
