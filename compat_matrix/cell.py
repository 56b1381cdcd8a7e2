"""One cell of the compatibility matrix: one vLLM version.

1. Read the wheel's pins (``pip install --dry-run --report``: metadata only).
2. Fetch the wheel into the user cache and run the static checks on it.
3. If its torch can be obtained from the configured indexes, build (or reuse) an
   environment with that vLLM, its torch and this project, and run the probe
   there. Otherwise the probe's checks are recorded as ``skip``.
4. Write ``compat_matrix/results/<package>-<version>.json``.

Environments live under ``--env-root`` (default ``.nox/compat-envs``), one per
version, built with uv when it is installed (hard links from uv's cache, so
every cell shares one copy of torch on disk) and plain venv + pip otherwise.
A stamp file in each environment says what was installed; a matching stamp
means the environment is reused as is (the project is installed editable, so
code changes need no reinstall; a changed ``pyproject.toml`` does).

Exit codes: 0 every check passed or skipped, 1 a check failed, 75 the registry
did not answer (the cell is ``unavailable``), 2 usage.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tomllib
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement

from compat_matrix import static, versions
from patcher.cache import cache_dir, fetch_wheel
from patcher.errors import PatchError

PROJECT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
PROBE_CHECKS = (
    "ir_present",
    "provider_registers",
    "plugin_entry_point",
    "kernels_supported",
    "numerics",
    "dispatch",
    "kernel_config",
    "upstream_patch",
    "e2e",
)
# PyPI's torchvision and friends fail to import beside a +cpu torch (and take
# transformers and the engine down with them); text models need none of them.
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
TORCH_INDEX_ENV = "VLLM_PATCH_TORCH_INDEX"
ENV_ROOT_ENV = "VLLM_PATCH_COMPAT_ENVS"
STAMP = "compat-stamp.json"
EX_UNAVAILABLE = 75
# pip's words for "the registry did not answer", as opposed to "no such version".
NETWORK_ERRORS = (
    "NewConnectionError",
    "Max retries exceeded",
    "Failed to establish",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Connection refused",
    "Read timed out",
    "ConnectTimeout",
    "ProxyError",
)


class Unavailable(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[compat] {msg}", file=sys.stderr, flush=True)


# --- pip's configuration, for uv (which does not read it) ----------------------


def pip_config() -> dict[str, str]:
    """``pip config list`` as key -> value, the environment over [install] over
    [global], as pip itself ranks them."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    rank = {":env:": 3, "install": 2, "global": 1}
    best: dict[str, tuple[int, str]] = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.partition(".")
        if not sep or section not in rank:
            continue
        value = value.strip().strip("'\"")
        if name not in best or rank[section] >= best[name][0]:
            best[name] = (rank[section], value)
    return {k: v for k, (_, v) in best.items()}


def uv_args_from_pip(config: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv command-line options and environment that carry pip's configuration."""
    args: list[str] = []
    env: dict[str, str] = {}
    if url := config.get("index-url"):
        args += ["--index-url", url]
    for url in config.get("extra-index-url", "").split():
        args += ["--extra-index-url", url]
    for link in config.get("find-links", "").split():
        args += ["--find-links", link]
    for constraint in config.get("constraint", "").split():
        args += ["--constraint", constraint]
    for host in config.get("trusted-host", "").split():
        args += ["--allow-insecure-host", host]
    if config.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    if cert := config.get("cert"):
        env["SSL_CERT_FILE"] = cert
    if args:
        # pip picks the best version across all indexes; uv's default takes the
        # first index that has the name at all, which would hide a +cpu torch.
        args += ["--index-strategy", "unsafe-best-match"]
    return args, env


def find_uv() -> str | None:
    try:
        from uv import find_uv_bin  # the uv wheel ships its binary

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


# --- pins and availability -----------------------------------------------------


def _pip(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"{shlex.join(cmd)}: no answer in {timeout} s") from exc
    if "No module named pip" in proc.stderr:
        # Not the registry's fault: say so instead of calling torch unavailable.
        raise RuntimeError(
            f"{sys.executable} has no pip; install pip beside this project"
        )
    return proc


def _network_error(stderr: str) -> bool:
    return any(marker in stderr for marker in NETWORK_ERRORS)


def read_pins(cell: versions.Cell, index_args: list[str]) -> dict[str, Any]:
    """The wheel's metadata (requires_dist, download URL) without downloading it.

    Cached per package version: a release's metadata never changes.
    """
    cache = cache_dir() / "compat" / "pins" / f"{cell.package}-{cell.version}.json"
    if cache.is_file():
        return json.loads(cache.read_text("utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = _pip(
            "install",
            "--dry-run",
            "--no-deps",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            cell.requirement,
            *index_args,
        )
        if proc.returncode != 0 or not report.is_file():
            # The version is listed in versions.json, so a failure here means the
            # registry did not answer, not that the release is missing.
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise Unavailable(
                f"pip could not read {cell.requirement}'s metadata: {tail}"
            )
        item = json.loads(report.read_text("utf-8"))["install"][0]
    pins = {
        "requires_dist": item["metadata"].get("requires_dist", []),
        "url": item.get("download_info", {}).get("url"),
    }
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(pins, indent=1), "utf-8")
    return pins


def torch_pin(requires_dist: list[str]) -> str | None:
    """The torch requirement that applies here, e.g. ``torch==2.13.0+cpu``."""
    env = default_environment()
    for text in requires_dist:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (
            req.marker is None or req.marker.evaluate(env | {"extra": ""})
        ):
            return f"torch{req.specifier}"
    return None


def torch_available(pin: str, index_args: list[str]) -> tuple[bool, str]:
    proc = _pip(
        "install",
        "--dry-run",
        "--no-deps",
        "--ignore-installed",
        "--quiet",
        pin,
        *index_args,
    )
    if proc.returncode == 0:
        return True, ""
    if _network_error(proc.stderr):
        raise Unavailable(f"registry did not answer while resolving {pin}")
    return False, (proc.stderr.strip().splitlines() or ["not found"])[-1]


# --- the environment -----------------------------------------------------------


def project_requirements() -> list[str]:
    meta = tomllib.loads((PROJECT / "pyproject.toml").read_text("utf-8"))
    return list(meta["project"].get("dependencies", []))


def _stamp(
    cell: versions.Cell, pin: str, torch_index: str | None, installer: str
) -> dict:
    pyproject = (PROJECT / "pyproject.toml").read_bytes()
    return {
        "requirement": cell.requirement,
        "torch": pin,
        "torch_index": torch_index,
        "installer": installer,
        "python": platform.python_version(),
        "project": str(PROJECT),
        "pyproject": hashlib.sha256(pyproject).hexdigest()[:16],
    }


def env_python(env: Path) -> Path:
    return env / "bin" / "python"


def ensure_env(
    cell: versions.Cell,
    wheel: Path,
    pin: str,
    *,
    env_root: Path,
    torch_index: str | None,
) -> tuple[Path, bool]:
    """The cell's environment, reused when its stamp matches; (env, reused)."""
    uv = find_uv()
    installer = "uv" if uv else "pip"
    env = env_root / f"{cell.package}-{cell.version}"
    stamp = _stamp(cell, pin, torch_index, installer)
    stamp_file = env / STAMP
    if stamp_file.is_file() and env_python(env).exists():
        if json.loads(stamp_file.read_text("utf-8")) == stamp:
            return env, True
    if env.exists():
        shutil.rmtree(env)
    env_root.mkdir(parents=True, exist_ok=True)
    extra = ["--extra-index-url", torch_index] if torch_index else []
    # The wheel already fetched for the static checks, so it is not downloaded twice.
    wanted = [str(wheel), pin, *project_requirements()]
    if uv:
        args, uv_env = uv_args_from_pip(pip_config())
        if torch_index and "--index-strategy" not in args:
            # uv would otherwise take every package the torch index also lists
            # (numpy, requests, ...) from that index alone, at its old versions.
            args += ["--index-strategy", "unsafe-best-match"]
        run_env = os.environ | uv_env
        python = ["--python", str(env_python(env))]
        _run([uv, "venv", "--quiet", "--python", sys.executable, str(env)], run_env)
        _run(
            [
                uv,
                "pip",
                "install",
                "--quiet",
                "--link-mode=hardlink",
                *python,
                *args,
                *extra,
                *wanted,
            ],
            run_env,
        )
        _run(
            [uv, "pip", "uninstall", "--quiet", *python, *BROKEN_BESIDE_CPU_TORCH],
            run_env,
        )
        _run(
            [
                uv,
                "pip",
                "install",
                "--quiet",
                "--link-mode=hardlink",
                *python,
                *args,
                "--no-deps",
                "-e",
                str(PROJECT),
            ],
            run_env,
        )
    else:
        pip = [str(env_python(env)), "-m", "pip"]
        _run([sys.executable, "-m", "venv", str(env)])
        _run([*pip, "install", "--quiet", *extra, *wanted])
        _run([*pip, "uninstall", "--quiet", "-y", *BROKEN_BESIDE_CPU_TORCH])
        _run([*pip, "install", "--quiet", "--no-deps", "-e", str(PROJECT)])
    stamp_file.write_text(json.dumps(stamp, indent=1), "utf-8")
    return env, False


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    log(shlex.join(cmd))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EnvError(
            f"{shlex.join(cmd[:4])} ... exited {proc.returncode}: "
            f"{proc.stderr.strip()[-2000:]}"
        )


class EnvError(RuntimeError):
    pass


def installed_torch(env: Path) -> str | None:
    proc = subprocess.run(
        [
            str(env_python(env)),
            "-c",
            "import importlib.metadata as m; print(m.version('torch'))",
        ],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() or None


# --- the probe -----------------------------------------------------------------


def run_probe(
    env: Path, probe_args: list[str], timeout: int
) -> tuple[dict | None, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        cmd = [
            str(env_python(env)),
            "-m",
            "compat_matrix.probe",
            "--json",
            str(out),
            *probe_args,
        ]
        log(shlex.join(cmd))
        try:
            proc = subprocess.run(
                cmd, cwd=PROJECT, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return None, f"probe did not finish in {timeout} s"
        if out.is_file():
            try:
                return json.loads(out.read_text("utf-8")), ""
            except json.JSONDecodeError as exc:
                return None, f"probe wrote unreadable JSON: {exc}"
        tail = proc.stderr.strip().splitlines()[-3:] or ["no output"]
        return (
            None,
            f"probe exited {proc.returncode} without a result: {' | '.join(tail)}",
        )


def skipped_probe(reason: str) -> list[dict[str, Any]]:
    return [
        {"name": n, "status": "skip", "reason": reason, "seconds": 0.0, "details": {}}
        for n in PROBE_CHECKS
    ]


# --- the cell ------------------------------------------------------------------


def run_cell(
    cell: versions.Cell,
    *,
    env_root: Path,
    results: Path = RESULTS,
    torch_index: str | None = None,
    probe_args: list[str] = (),
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
        "torch": {"pin": None, "available": None, "used": None},
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
        return _finish(result, results, started)

    t0 = time.perf_counter()
    try:
        result["static"] = static.check_wheel(wheel)
    except PatchError as exc:  # not a vLLM wheel at all: say so, keep going
        result["static"] = {
            "vllm": {"version": None, "location": str(wheel)},
            "checks": [static._check("wheel_ir", "fail", exc.message)],
            "ok": False,
        }
    lap("static", t0)

    probe_checks: list[dict[str, Any]]
    if cell.mode != "full":
        probe_checks = skipped_probe(f"static only: {cell.package} is not a CPU build")
    elif pin is None:
        probe_checks = skipped_probe("the wheel pins no torch for this platform")
    else:
        t0 = time.perf_counter()
        env = env_root / f"{cell.package}-{cell.version}"
        try:
            ok, why = (
                (True, "")
                if (env / STAMP).is_file()
                else torch_available(pin, index_args)
            )
        except Unavailable as exc:
            result.update(status="unavailable", reason=str(exc))
            ok, why = False, ""
        lap("torch_check", t0)
        result["torch"]["available"] = ok if result["status"] is None else None
        if result["status"] == "unavailable":
            probe_checks = skipped_probe(f"unavailable: {result['reason']}")
        elif not ok:
            torch = pin.removeprefix("torch==")
            probe_checks = skipped_probe(
                f"torch {torch} not available from the configured indexes"
            )
            result["torch"]["why"] = why
        else:
            probe_checks = _probe_in_env(
                cell,
                wheel,
                pin,
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
    return _finish(result, results, started)


def _probe_in_env(
    cell,
    wheel,
    pin,
    env_root,
    torch_index,
    probe_args,
    timeout,
    result,
    lap,
    results,
    fresh,
):
    t0 = time.perf_counter()
    try:
        env, reused = ensure_env(
            cell, wheel, pin, env_root=env_root, torch_index=torch_index
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
        "installer": "uv" if find_uv() else "pip",
    }
    result["torch"]["used"] = installed_torch(env)
    t0 = time.perf_counter()
    key = probe_key(env, probe_args)
    result["probe_key"] = key
    previous = None if fresh else _previous_probe(results / cell.result_name, key)
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


# What the probe's outcome depends on: the environment (its stamp) and the code
# it runs from this project: the probe, the patches (loaded by name from their
# patch.toml) and every project module they import, followed through imports.
# An unchanged key means a re-run would repeat the last probe, so a warm re-run
# reuses it (``--fresh`` forces a new one).
PROBE_SEEDS = (
    "compat_matrix/__init__.py",
    "compat_matrix/probe",
    "patches",
    "pyproject.toml",
)


def probed_files() -> list[Path]:
    seeds: list[Path] = []
    for entry in PROBE_SEEDS:
        path = PROJECT / entry
        seeds += (
            [path]
            if path.is_file()
            else sorted(
                p
                for p in path.rglob("*")
                if p.suffix in (".py", ".toml") and p.is_file()
            )
        )
    seen: set[Path] = set()
    todo = list(seeds)
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        if f.suffix == ".py":
            todo += _project_imports(f)
    return sorted(seen)


def _project_imports(file: Path) -> list[Path]:
    try:
        tree = ast.parse(file.read_bytes())
    except SyntaxError:
        return []
    package = file.relative_to(PROJECT).parent.parts
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            mod = base + (node.module.split(".") if node.module else [])
            names += [".".join(mod + [a.name]) for a in node.names] + [".".join(mod)]
    found = []
    for name in names:
        parts = name.split(".")
        for candidate in (
            PROJECT.joinpath(*parts).with_suffix(".py"),
            PROJECT.joinpath(*parts, "__init__.py"),
        ):
            if parts and parts[0] and candidate.is_file():
                found.append(candidate)
    return found


def probe_key(env: Path, probe_args: list[str]) -> str:
    digest = hashlib.sha256()
    digest.update((env / STAMP).read_bytes())
    digest.update(json.dumps(probe_args).encode())
    for f in probed_files():
        digest.update(str(f.relative_to(PROJECT)).encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()[:20]


def _previous_probe(path: Path, key: str) -> dict[str, Any] | None:
    try:
        previous = json.loads(path.read_text("utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if previous.get("probe_key") == key and previous.get("probe"):
        return previous
    return None


def _finish(result: dict[str, Any], results: Path, started: float) -> dict[str, Any]:
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
    parser.add_argument("--probe-timeout", type=int, default=900)
    parser.add_argument(
        "--fresh",
        action="store_true",
        default=bool(os.environ.get("VLLM_PATCH_COMPAT_FRESH")),
        help="run the probe even when nothing it depends on changed "
        "(env VLLM_PATCH_COMPAT_FRESH=1)",
    )
    args = parser.parse_args(argv)
    cell = versions.find(args.cell)
    result = run_cell(
        cell,
        env_root=args.env_root,
        results=args.results,
        torch_index=args.torch_index,
        probe_args=["--e2e"] if args.e2e else [],
        probe_timeout=args.probe_timeout,
        fresh=args.fresh,
    )
    return {"pass": 0, "fail": 1, "unavailable": EX_UNAVAILABLE}[result["status"]]


if __name__ == "__main__":
    sys.exit(main())
