"""One cell of the compatibility matrix: one vLLM version.

1. Read the wheel's pins (``pip install --dry-run --report``: metadata only).
2. Fetch the wheel into the user cache and run the static checks on it.
3. If its torch can be obtained from the configured indexes, build (or reuse) an
   environment with that vLLM, its torch and this project, and run the probe
   there. Otherwise the probe's checks are recorded as ``skip``.
4. Write ``compat_matrix/results/<package>-<version>.json``.

The steps live beside this module: ``pins`` (metadata and torch availability),
``cell_env`` (building or reusing the cell's venv under ``--env-root``,
default ``.nox/compat-envs``), ``probe_run`` and ``probe_reuse`` (running the
probe, or reusing the last passing one when nothing it depends on changed).
This module strings them together (``run_cell``: one named step each) and
writes the result.

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compat_matrix import versions
from compat_matrix.cell_env import (
    PROJECT,
    EnvError,
    ensure_env,
    env_dir,
    installed_torch,
    installer,
    read_stamp,
)
from compat_matrix.check_status import CheckStatus
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
from compat_matrix.probe_run import launch_probe, skipped_probe
from patcher.errors import PatchError
from vllm_patch.runtime.cache import cache_dir, fetch_wheel

RESULTS = Path(__file__).resolve().parent / "results"
# Not VLLM_*: vLLM warns about every VLLM_* variable it does not know, and
# --fail-on-environ-validation refuses to start.
TORCH_INDEX_ENV = "VLLMPATCH_TORCH_INDEX"
ENV_ROOT_ENV = "VLLMPATCH_COMPAT_ENVS"
FRESH_ENV = "VLLMPATCH_COMPAT_FRESH"
EX_UNAVAILABLE = 75
EXIT_CODES = {
    CheckStatus.PASS: 0,
    CheckStatus.FAIL: 1,
    CheckStatus.UNAVAILABLE: EX_UNAVAILABLE,
}


@dataclass(frozen=True)
class CellSettings:
    """How a cell runs: where its environment and its result go, the extra
    torch index it asks, and what the probe does."""

    env_root: Path
    results: Path = RESULTS
    torch_index: str | None = None
    e2e: bool = False
    """The probe also starts the engine (slow)."""
    probe_timeout: int = 900
    fresh: bool = False
    """Run the probe and the static checks even when a passing result under the
    same key could be reused."""

    @property
    def index_args(self) -> list[str]:
        return ["--extra-index-url", self.torch_index] if self.torch_index else []


@dataclass
class CellRun:
    """One cell under way: its result, filled in step by step, and the time
    each step took."""

    cell: versions.Cell
    settings: CellSettings
    started: float = field(default_factory=time.perf_counter)
    result: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.result = {
            "schema": 1,
            "cell": self.cell.id,
            "package": self.cell.package,
            "version": self.cell.version,
            "mode": self.cell.mode,
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
            "timings": {},
            "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        }

    @property
    def result_file(self) -> Path:
        return self.settings.results / self.cell.result_name

    @contextmanager
    def lap(self, step: str) -> Iterator[None]:
        """Time the block as ``timings[step]``, however it ends."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.result["timings"][step] = round(time.perf_counter() - t0, 2)

    def unavailable(self, reason: str) -> None:
        self.result.update(status=CheckStatus.UNAVAILABLE, reason=reason)


def run_cell(cell: versions.Cell, settings: CellSettings) -> dict[str, Any]:
    """Pins -> wheel -> static checks -> torch choice -> environment -> probe ->
    the result, written to ``settings.results``."""
    run = CellRun(cell, settings)
    try:
        with run.lap("pins"):
            pin = read_torch_pin(run)
        with run.lap("wheel"):
            wheel = fetch_wheel(cell.package, cell.version, *settings.index_args)
    except (Unavailable, subprocess.CalledProcessError, FileNotFoundError) as exc:
        run.unavailable(str(exc))
        run.result["checks"] = skipped_probe(f"unavailable: {exc}")
        return write_result(run)
    with run.lap("static"):
        run.result["static"] = static_checks(run, wheel)
    run.result["checks"] = (
        probe_checks(run, wheel, pin) + run.result["static"]["checks"]
    )
    return write_result(run)


def read_torch_pin(run: CellRun) -> str | None:
    """The torch the wheel pins for this platform (its metadata only)."""
    pins = read_pins(run.cell, run.settings.index_args)
    run.result["torch"]["pin"] = pin = torch_pin(pins["requires_dist"])
    return pin


def static_checks(run: CellRun, wheel: Path) -> dict[str, Any]:
    """The static checks on the wheel, or the last passing ones under the same
    key."""
    run.result["static_key"] = key = static_key(wheel)
    fresh = run.settings.fresh
    previous = None if fresh else previous_static(run.result_file, key)
    run.result["static_reused"] = previous is not None
    if previous is not None:
        return previous
    # Imported only here: it brings LibCST, most of a warm cell's start-up.
    from compat_matrix import static

    try:
        return static.check_wheel(wheel)
    except PatchError as exc:  # not a vLLM wheel at all: say so, keep going
        return {
            "vllm": {"version": None, "location": wheel.name},
            "checks": [static._check("wheel_ir", CheckStatus.FAIL, exc.message)],
            "ok": False,
        }


def probe_checks(run: CellRun, wheel: Path, pin: str | None) -> list[dict[str, Any]]:
    """The probe's checks: from a probe in the cell's environment (run, or the
    last passing one reused), or every one skipped with the reason."""
    cell = run.cell
    if cell.mode != "full":
        return skipped_probe(f"static only: {cell.package} is not a CPU build")
    if pin is None:
        return skipped_probe("the wheel pins no torch for this platform")
    with run.lap("torch_check"):
        torch_req, why_not = choose_torch(run, pin)
    if torch_req is None:
        return skipped_probe(why_not)
    with run.lap("env"):
        env, error = cell_environment(run, wheel, pin, torch_req)
    if env is None:
        install = check_record("install", error[:500], run.result["timings"]["env"])
        return [install] + skipped_probe("the environment could not be built")
    with run.lap("probe"):
        probe, error = probe_in(run, env)
    run.result["probe"] = probe
    if probe is None:
        return [check_record("probe", error)] + skipped_probe(
            "the probe gave no result"
        )
    seen = {c["name"] for c in probe["checks"]}
    return probe["checks"] + [
        c
        for c in skipped_probe("the probe did not report it")
        if c["name"] not in seen and c["name"] != "e2e"
    ]


def check_record(name: str, reason: str, seconds: float = 0.0) -> dict[str, Any]:
    """A failed check the cell records itself (the probe's are in its document)."""
    return {
        "name": name,
        "status": CheckStatus.FAIL,
        "reason": reason,
        "seconds": seconds,
        "details": {},
    }


def choose_torch(run: CellRun, pin: str) -> tuple[str | None, str]:
    """(the torch to install: the pin or a stand-in, "") or (None, why the probe
    cannot run), recorded in the result's ``torch`` entry."""
    settings, torch = run.settings, run.result["torch"]
    try:
        torch_req, why = torch_choice(
            pin,
            env_dir(run.cell, settings.env_root),
            settings.torch_index,
            settings.index_args,
        )
    except Unavailable as exc:
        run.unavailable(str(exc))
        return None, f"unavailable: {exc}"
    stand_in = torch_req if torch_req and torch_req != pin else None
    torch["available"] = torch_req == pin
    torch["stand_in"] = stand_in
    if torch_req is None:
        torch["why"] = why
        version = pin.removeprefix("torch==")
        return None, (
            f"torch {version} not available from the configured indexes, "
            "nor its plain build"
        )
    if stand_in and installer() != "uv":
        return None, (
            f"{pin} is not on the configured indexes; {stand_in} could stand "
            "in, but overriding the wheel's pin needs uv (pip has none)"
        )
    return torch_req, ""


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


def cell_environment(
    run: CellRun, wheel: Path, pin: str, torch_req: str
) -> tuple[Path | None, str]:
    """(the cell's environment, built or reused, "") or (None, why not)."""
    try:
        env, reused = ensure_env(
            run.cell,
            wheel,
            pin,
            env_root=run.settings.env_root,
            torch_index=run.settings.torch_index,
            torch_req=torch_req,
        )
    except EnvError as exc:
        return None, str(exc)
    run.result["env"] = {"path": str(env), "reused": reused, "installer": installer()}
    run.result["torch"]["used"] = installed_torch(env)
    return env, ""


def probe_in(run: CellRun, env: Path) -> tuple[dict | None, str]:
    """(the probe's document, "") -- the last passing one when nothing it
    depends on changed, else a new one -- or (None, why there is none)."""
    settings = run.settings
    probe_kwargs = {"e2e": settings.e2e}
    run.result["probe_key"] = key = probe_key(env, probe_kwargs)
    previous = None if settings.fresh else previous_probe(run.result_file, key)
    if previous is None:
        return launch_probe(env, probe_kwargs, settings.probe_timeout)
    run.result["probe_reused_from"] = (
        previous.get("probe_reused_from") or previous["date"]
    )
    return previous["probe"], ""


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


def write_result(run: CellRun) -> dict[str, Any]:
    """The cell's status from its checks (unless already ``unavailable``), the
    result written without the machine's folders, and logged."""
    result = portable(run.result, _places(run.settings.env_root))
    if result["status"] is None:
        failed = [
            c["name"] for c in result["checks"] if c["status"] == CheckStatus.FAIL
        ]
        result["status"] = CheckStatus.FAIL if failed else CheckStatus.PASS
        result["reason"] = f"failed: {', '.join(failed)}" if failed else ""
    result["timings"]["total"] = round(time.perf_counter() - run.started, 2)
    out = run.result_file
    out.parent.mkdir(parents=True, exist_ok=True)
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
    settings = CellSettings(
        env_root=args.env_root,
        results=args.results,
        torch_index=args.torch_index,
        e2e=args.e2e,
        probe_timeout=args.probe_timeout or (5400 if args.e2e else 900),
        fresh=args.fresh,
    )
    result = run_cell(versions.find(args.cell), settings)
    return EXIT_CODES[result["status"]]


if __name__ == "__main__":
    sys.exit(main())
