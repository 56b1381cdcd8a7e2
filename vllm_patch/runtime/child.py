"""Run one function in a child process and get its JSON result back.

Measurements and checks run in children: to use another environment's
interpreter, to import vLLM from a patched copy (``PYTHONPATH``), to start
with a clean process (one engine, one thread count, one IR op priority per
process), and to survive a kernel that crashes or hangs. Every such child goes
through here:

- ``run(target, kwargs)`` calls ``target`` (``"package.module:function"``)
  with the keyword arguments ``kwargs`` (JSON-able) in the child and returns a
  :class:`ChildOutcome`:
  the function's JSON-able return value, or why there is none (its exception,
  the exit code, a timeout), with everything the child printed.
- ``start`` / ``finish`` / ``stop`` split that, so that a child can run while
  the parent goes on; ``fork=True`` starts it as a fork of this process (its
  imports already done) instead of a fresh interpreter.
- ``progress`` gets the child's output line by line while it runs (stdout and
  stderr together): callers pick their progress lines out of it.
- ``timeout`` kills the child's whole process group (an engine's own worker
  processes included).
- ``report(value)``, called inside the child, hands the parent one JSON-able
  value at once (``ChildOutcome.reported``, in order): what a target finished
  before it crashed survives the crash.

On the child's ``PYTHONPATH`` come, in this order: the folders given as
``pythonpath`` (a patched copy of vLLM, which must shadow the installed one),
those of the extra environment, the inherited ones, and the project root last,
so that ``target`` imports in an interpreter that does not have this project
installed. :func:`child_env` is that rule.

The child side is ``python -m vllm_patch.runtime.child TARGET ARGS_FILE RESULT_FILE``:
nothing here imports more than the standard library.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""Put last on every child's ``PYTHONPATH``: this project's packages import there."""

LOG_TAIL_CHARS = 4000
_POLL_S = 0.05
REPORT_ENV = "VLLMPATCH_CHILD_REPORT"  # not VLLM_*: vLLM refuses unknown ones
"""Set in the child: the file :func:`report` appends to."""
_REPORT_FILE = "reported.jsonl"


class ChildFailed(RuntimeError):
    """A child that returned no result: ``outcome`` says why and holds its log."""

    def __init__(self, outcome: ChildOutcome) -> None:
        self.outcome = outcome
        tail = outcome.log_tail(1500).strip()
        super().__init__(
            f"{outcome.target}: {outcome.error}" + (f"\n{tail}" if tail else "")
        )


@dataclass
class ChildOutcome:
    """What one child did."""

    target: str
    ok: bool
    result: Any = None
    """What ``target`` returned (through JSON), when ``ok``."""
    error: str | None = None
    """Why there is no result: ``target``'s exception (``"TypeError: ..."``),
    ``"timed out after N s"``, or the exit code with the last error line."""
    log: str = ""
    """Everything the child wrote to stdout and stderr."""
    seconds: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    reported: list[Any] = field(default_factory=list)
    """What ``target`` passed to :func:`report`, in order, crash or not."""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.log[-chars:]

    def value(self) -> Any:
        """The result; :class:`ChildFailed` (with the log's tail) without one."""
        if not self.ok:
            raise ChildFailed(self)
        return self.result


@dataclass
class Child:
    """A started child; :func:`finish` collects it, :func:`stop` ends it."""

    target: str
    timeout: float | None
    started: float
    folder: tempfile.TemporaryDirectory
    proc: subprocess.Popen | None = None
    pid: int | None = None
    """The fork's process id (``proc`` is None then)."""
    _read: int = field(default=0, repr=False)
    _partial: str = field(default="", repr=False)

    @property
    def args_file(self) -> Path:
        return Path(self.folder.name) / "args.json"

    @property
    def result_file(self) -> Path:
        return Path(self.folder.name) / "result.json"

    @property
    def log_file(self) -> Path:
        return Path(self.folder.name) / "log.txt"

    @property
    def report_file(self) -> Path:
        return Path(self.folder.name) / _REPORT_FILE


def child_env(
    env: Mapping[str, str] | None = None,
    *,
    pythonpath: Iterable[str | Path] = (),
    drop_env: Iterable[str] = (),
) -> dict[str, str]:
    """This process's environment with ``env`` on top and ``drop_env`` removed,
    and the ``PYTHONPATH`` rule of the module docstring. A child given
    ``pythonpath`` (a hard-linked copy) writes no bytecode: it adds no files to
    the copy."""
    base = {k: v for k, v in os.environ.items() if k not in set(drop_env)}
    env = dict(env or {})
    first = [str(p) for p in pythonpath]
    paths = [*first, *_split(env.pop("PYTHONPATH", ""))]
    paths += [*_split(base.get("PYTHONPATH", "")), str(PROJECT_ROOT)]
    out = {**base, **env}
    out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))  # first one wins
    if first:
        out["PYTHONDONTWRITEBYTECODE"] = "1"
    return out


def _split(value: str) -> list[str]:
    return [p for p in value.split(os.pathsep) if p]


def start(
    target: str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    python: str | Path = sys.executable,
    env: Mapping[str, str] | None = None,
    pythonpath: Iterable[str | Path] = (),
    drop_env: Iterable[str] = (),
    cwd: str | Path | None = None,
    timeout: float | None = None,
    fork: bool = False,
) -> Child:
    """Start ``target(**kwargs)`` in a child without waiting for it.

    ``python``: the interpreter (another environment's); ``env``: extra
    environment variables; ``pythonpath``: folders first on its path;
    ``drop_env``: variables it must not see; ``cwd``: its working directory
    (default: a temporary folder, so that nothing in the parent's lands first
    on ``sys.path``); ``timeout``: seconds from now after which :func:`finish`
    kills it (None: none).

    ``fork=True`` runs it in a fork of this process instead (``python`` and
    ``env`` beyond ``drop_env`` do not apply; ``pythonpath`` goes first on
    ``sys.path``): it starts in well under a second with this process's imports
    done, for a task that needs vLLM as this process has it, or, with
    ``pythonpath``, one started before this process imported vLLM at all.
    """
    folder = tempfile.TemporaryDirectory(prefix="vllm-patch-child-")
    child = Child(target, timeout, time.perf_counter(), folder)
    child.args_file.write_text(json.dumps(dict(kwargs or {})), "utf-8")
    if fork:
        child.pid = _fork(child, list(pythonpath), list(drop_env), cwd)
        return child
    cmd = [str(python), "-m", "vllm_patch.runtime.child", target]
    cmd += [str(child.args_file), str(child.result_file)]
    with child.log_file.open("wb") as log:
        child.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(env, pythonpath=pythonpath, drop_env=drop_env),
            cwd=str(cwd or folder.name),
            start_new_session=True,  # its own process group: a timeout ends it all
        )
    return child


def _fork(child: Child, pythonpath: list, drop_env: list, cwd) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1  # the child: run the target, never return into the parent's code
    try:
        os.setsid()
        for name in drop_env:
            os.environ.pop(name, None)
        sys.path[:0] = [str(p) for p in pythonpath]
        sys.dont_write_bytecode = True  # never add files to a linked copy
        if cwd:
            os.chdir(cwd)
        log = os.open(child.log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        # The parent's Python streams may not write to its file descriptors
        # (a capturing test runner): the child's write to the log.
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        code = child_main(child.target, child.args_file, child.result_file)
    finally:
        os._exit(code)


def finish(child: Child, progress: Callable[[str], None] | None = None) -> ChildOutcome:
    """Wait for ``child`` (killing its process group at its timeout), passing
    each line of its output to ``progress`` as it comes; its outcome."""
    deadline = None if child.timeout is None else child.started + child.timeout
    timed_out = False
    while True:
        rc = _poll(child)
        _pass_lines(child, progress)
        if rc is not None:
            break
        if deadline is not None and time.perf_counter() > deadline:
            _kill(child)
            timed_out, rc = True, None
            break
        time.sleep(_POLL_S)
    _pass_lines(child, progress, final=True)
    seconds = round(time.perf_counter() - child.started, 2)
    with child.folder:
        log = child.log_file.read_text("utf-8", errors="replace")
        payload: dict[str, Any] = {}
        if child.result_file.is_file():
            try:
                payload = json.loads(child.result_file.read_text("utf-8"))
            except json.JSONDecodeError:
                payload = {"error": "the child wrote an unreadable result"}
        reported = _read_reported(child.report_file)
    outcome = ChildOutcome(
        child.target,
        ok=False,
        log=log,
        seconds=seconds,
        returncode=rc,
        reported=reported,
    )
    if timed_out:
        outcome.timed_out = True
        outcome.error = f"timed out after {child.timeout:.0f} s"
    elif rc == 0 and "result" in payload:
        outcome.ok, outcome.result = True, payload["result"]
    else:
        outcome.error = payload.get("error") or (
            f"exit code {rc}: {last_error_line(log)}"
            if rc
            else "the child wrote no result"
        )
    return outcome


def _read_reported(path: Path) -> list[Any]:
    """The values :func:`report` wrote; a line cut short by a crash is left out."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text("utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def run(
    target: str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    **how: Any,
) -> ChildOutcome:
    """:func:`start` then :func:`finish`; ``how`` as :func:`start` takes it."""
    return finish(start(target, kwargs, **how), progress)


def stop(child: Child) -> None:
    """End ``child`` if it still runs (one that was never collected)."""
    if _poll(child) is None:
        _kill(child)
    child.folder.cleanup()


def _poll(child: Child) -> int | None:
    if child.proc is not None:
        return child.proc.poll()
    try:
        pid, status = os.waitpid(child.pid, os.WNOHANG)
    except ChildProcessError:  # collected already
        return -1
    return os.waitstatus_to_exitcode(status) if pid else None


def _kill(child: Child) -> None:
    pid = child.proc.pid if child.proc is not None else child.pid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if child.proc is not None:
        child.proc.wait()
    else:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child.pid, 0)


def _pass_lines(
    child: Child, progress: Callable[[str], None] | None, final: bool = False
) -> None:
    if progress is None or not child.log_file.is_file():
        return
    with child.log_file.open("rb") as log:
        log.seek(child._read)
        chunk = log.read()
    child._read += len(chunk)
    text = child._partial + chunk.decode("utf-8", errors="replace")
    *lines, child._partial = text.split("\n")
    if final and child._partial:
        lines, child._partial = [*lines, child._partial], ""
    for line in lines:
        progress(line.rstrip("\r"))


def last_error_line(log: str) -> str:
    """The last line of ``log`` naming an error or exception, else its last line."""
    lines = [ln for ln in log.splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.search(r"(Error|Exception)\b", line):
            return line.strip()[-300:]
    return lines[-1].strip()[-300:] if lines else "no output"


# --- the child's side --------------------------------------------------------


def load_target(target: str) -> Callable[..., Any]:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def report(value: Any) -> None:
    """In a child: hand ``value`` (JSON-able) to the parent now, so that it
    survives a crash of this process later on (:attr:`ChildOutcome.reported`)."""
    with open(os.environ[REPORT_ENV], "a", encoding="utf-8") as out:
        out.write(json.dumps(value, default=str) + "\n")


def child_main(target: str, args_file: Path, result_file: Path) -> int:
    """Call ``target`` with the keyword arguments in ``args_file``; write
    ``{"result": ...}`` or ``{"error": ...}`` (the traceback goes to stderr)."""
    os.environ[REPORT_ENV] = str(Path(result_file).with_name(_REPORT_FILE))
    try:
        kwargs = json.loads(Path(args_file).read_text("utf-8"))
        result = {"result": load_target(target)(**kwargs)}
        code = 0
    except BaseException as exc:  # reported to the parent, which owns the verdict
        traceback.print_exc()
        result, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
    sys.stdout.flush()
    sys.stderr.flush()
    Path(result_file).write_text(json.dumps(result, default=str), "utf-8")
    return code


if __name__ == "__main__":
    sys.exit(child_main(*sys.argv[1:4]))
