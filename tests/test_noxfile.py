"""The noxfile's helpers: pip's package sources handed to uv through its
environment, never on a command line nox echoes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECRET = "SECRET-3f9a"
# A closed local port: uv gets the index, nothing leaves the machine.
INDEX = f"https://user:{SECRET}@127.0.0.1:9/simple"


@pytest.fixture
def pip_env(monkeypatch, tmp_path):
    """pip configured by its environment alone (it ranks over its files)."""
    for name in list(os.environ):
        if name.startswith(("PIP_", "UV_")) or name == "VLLMPATCH_TORCH_INDEX":
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.chdir(ROOT)  # the noxfile reads pyproject.toml from there
    return monkeypatch


SOURCES = [
    pytest.param(
        {
            "PIP_INDEX_URL": "https://mirror.example/simple",
            "PIP_EXTRA_INDEX_URL": "file:///a/simple file:///b/simple",
            "PIP_FIND_LINKS": "/opt/wheels /opt/more",
            "VLLMPATCH_TORCH_INDEX": "https://download.pytorch.org/whl/cpu",
        },
        {
            "UV_INDEX_URL": "https://mirror.example/simple",
            "UV_EXTRA_INDEX_URL": "file:///a/simple file:///b/simple "
            "https://download.pytorch.org/whl/cpu",
            "UV_INDEX_STRATEGY": "unsafe-best-match",
            "UV_FIND_LINKS": "/opt/wheels,/opt/more",
        },
        id="every source, and a +cpu torch index",
    ),
    pytest.param(
        {"PIP_INDEX_URL": "https://mirror.example/simple", "PIP_FIND_LINKS": "/w"},
        {"UV_INDEX_URL": "https://mirror.example/simple", "UV_FIND_LINKS": "/w"},
        id="no extra index: uv's own strategy",
    ),
    pytest.param(
        {"VLLMPATCH_TORCH_INDEX": "https://download.pytorch.org/whl/cpu"},
        {
            "UV_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cpu",
            "UV_INDEX_STRATEGY": "unsafe-best-match",
        },
        id="the torch index alone",
    ),
    pytest.param({}, {}, id="nothing configured"),
]


@pytest.mark.parametrize(("configured", "expected"), SOURCES)
def test_pips_sources_become_uvs_environment(pip_env, configured, expected):
    for name, value in configured.items():
        pip_env.setenv(name, value)
    import noxfile

    assert noxfile.pip_sources.__wrapped__() == expected


NOXFILE = """\
import os
import sys

os.chdir({root!r})
sys.path.insert(0, {root!r})

import nox

import noxfile as project


@nox.session(venv_backend="uv")
def probe(session):
    session.install(
        "-v", "--offline", "--no-deps", "absent-probe-package",
        env=project.pip_sources(), success_codes=[0, 1, 2], silent=False,
    )
"""


def test_an_index_credential_never_shows_in_noxs_output(pip_env, tmp_path):
    """nox for real: a session installs with pip's sources; uv receives the
    index (its debug output names the host) and nothing nox or uv prints holds
    the password."""
    pip_env.setenv("PIP_EXTRA_INDEX_URL", INDEX)
    pip_env.setenv("PIP_FIND_LINKS", str(tmp_path))
    noxfile = tmp_path / "noxfile.py"
    noxfile.write_text(NOXFILE.format(root=str(ROOT)))
    command = [sys.executable, "-m", "nox", "-f", str(noxfile)]
    command += ["--envdir", str(tmp_path / ".nox"), "-s", "probe"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "uv pip install -v --offline" in output  # what nox echoed
    assert "127.0.0.1:9/simple" in output  # uv had the index
    assert SECRET not in output
