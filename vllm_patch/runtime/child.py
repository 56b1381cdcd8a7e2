"""Run one function in a child interpreter (a patched copy first on its path; a
crash or hang stays there) and get its JSON result; that side: stdlib only."""

import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # last on a child's path
# The file report() appends to; not VLLM_*: vLLM warns about unknown ones.
REPORT_ENV = "VLLMPATCH_CHILD_REPORT"


class ChildFailed(RuntimeError):
    """A child that returned no result: why, and the tail of its log."""


@dataclass
class ChildOutcome:
    """``result`` when ``ok``, else ``error``; ``reported``:
    what :func:`report` got."""

    target: str
    ok: bool
    result: Any = None
    error: str | None = None
    log: str = ""
    seconds: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    reported: list[Any] = field(default_factory=list)

    def value(self) -> Any:
        if not self.ok:
            tail = self.log[-1500:].strip()
            raise ChildFailed(f"{self.target}: {self.error}\n{tail}".strip())
        return self.result


@dataclass
class Child:
    target: str
    timeout: float | None
    folder: tempfile.TemporaryDirectory
    proc: subprocess.Popen | None = None
    started: float = field(default_factory=time.perf_counter)

    def file(self, name: str) -> Path:  # args.json, result.json, log.txt, ...
        return Path(self.folder.name) / name


def child_env(
    env: Mapping[str, str] | None = None,
    *,
    pythonpath: Iterable[str | Path] = (),
    drop_env: Iterable[str] = (),
) -> dict[str, str]:
    """This environment, ``env`` on top, ``drop_env`` removed; ``PYTHONPATH``:
    ``pythonpath`` first (a patched copy, kept free of bytecode), ``env``'s, the
    inherited one, the project root last (where it is not installed)."""
    dropped = set(drop_env)
    env = dict(env or {})
    first = [str(p) for p in pythonpath]
    out = {k: v for k, v in os.environ.items() if k not in dropped}
    paths = [*first, env.pop("PYTHONPATH", ""), out.get("PYTHONPATH", "")]
    paths = os.pathsep.join([*paths, str(PROJECT_ROOT)]).split(os.pathsep)
    out.update(env)
    out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, paths)))
    if first:  # a patched copy: no bytecode written into it
        out["PYTHONDONTWRITEBYTECODE"] = "1"
    return out


def start(
    target: str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    python: str | Path = sys.executable,
    cwd: str | Path | None = None,
    timeout: float | None = None,
    **environ: Any,
) -> Child:
    """Start ``target(**kwargs)`` (``"module:function"``) with
    ``child_env(**environ)`` in ``cwd`` (default: an empty folder, so nothing
    lands first on its ``sys.path``), killed ``timeout`` s from now."""
    folder = tempfile.TemporaryDirectory(prefix="vllm-patch-")
    child = Child(target, timeout, folder)
    child.file("args.json").write_text(json.dumps(dict(kwargs or {})), "utf-8")
    with child.file("log.txt").open("wb") as log:
        child.proc = subprocess.Popen(
            [
                str(python),
                "-m",
                "vllm_patch.runtime.child",
                target,
                child.folder.name,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(**environ),
            cwd=str(cwd or child.folder.name),
            start_new_session=True,  # its own process group: a timeout ends it all
        )
    return child


def finish(child: Child) -> ChildOutcome:
    """Wait for ``child`` (ended at its timeout) and read what it left."""
    left = child.timeout and child.started + child.timeout - time.perf_counter()
    timed_out = False
    try:
        rc = child.proc.wait(None if left is None else max(left, 0))
    except subprocess.TimeoutExpired:
        kill_group(child.proc)
        rc = None
        timed_out = True
    with child.folder:
        log = child.file("log.txt").read_text("utf-8", errors="replace")
        payload = {}
        said = []  # what report() wrote, to a line cut short
        try:
            payload = json.loads(child.file("result.json").read_text("utf-8"))
        except json.JSONDecodeError:
            payload = {"error": "the child wrote an unreadable result"}
        except FileNotFoundError:
            pass
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            jsonl = child.file("reported.jsonl").read_text("utf-8")
            for line in jsonl.splitlines():
                said.append(json.loads(line))
    if timed_out:
        error = f"timed out after {child.timeout:.0f} s"
    elif rc == 0 and "result" in payload:
        error = None
    elif payload.get("error"):
        error = payload["error"]
    else:
        error = f"exit code {rc}: {last_error_line(log)}" if rc else "no result"
    result = payload.get("result") if error is None else None
    seconds = round(time.perf_counter() - child.started, 2)
    return ChildOutcome(
        child.target,
        error is None,
        result,
        error,
        log,
        seconds,
        rc,
        timed_out,
        said,
    )


def run(target: str, kwargs=None, **how: Any) -> ChildOutcome:
    return finish(start(target, kwargs, **how))


def stop(child: Child) -> None:
    if child.proc.poll() is None:
        kill_group(child.proc)
    child.folder.cleanup()


def kill_group(proc: subprocess.Popen, grace: float = 0) -> None:
    """End the process group ``proc`` leads: SIGTERM and ``grace`` seconds
    first if given, then SIGKILL to what is left (an engine left behind)."""
    try:
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            if grace:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=grace)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def last_error_line(log: str) -> str:
    """The last line of ``log`` naming an error or exception, else its last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"(Error|Exception)\b", ln)]
    return (errors or lines or ["no output"])[-1][-300:]


# --- the child's side --------------------------------------------------------


def report(value: Any) -> None:
    """In a child: hand ``value`` to the parent now, to survive a later crash."""
    with open(os.environ[REPORT_ENV], "a", encoding="utf-8") as out:
        out.write(json.dumps(value, default=str) + "\n")


def child_main(target: str, folder: str) -> int:
    """``target(**args)``; write ``{"result": ...}`` or ``{"error": ...}``."""
    os.environ[REPORT_ENV] = os.path.join(folder, "reported.jsonl")
    module, _, function = target.partition(":")
    try:
        kwargs = json.loads(Path(folder, "args.json").read_text("utf-8"))
        call = getattr(importlib.import_module(module), function)
        result = {"result": call(**kwargs)}
        code = 0
    except BaseException as exc:  # reported to the parent, which owns the verdict
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    Path(folder, "result.json").write_text(json.dumps(result, default=str), "utf-8")
    return code


if __name__ == "__main__":
    sys.exit(child_main(*sys.argv[1:3]))
