"""A vLLM tree's version, without importing it: ``vllm/_version.py``, else the
dist-info, else the wheel's name."""

import ast
import contextlib
import email.parser

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from patcher.tree import VllmTree

VERSION_FILE = "vllm/_version.py"


def read_version(tree: VllmTree) -> Version | None:
    for read in (_from_version_file, _from_dist_info, _from_wheel_name):
        with contextlib.suppress(InvalidVersion, InvalidWheelFilename):
            return Version(str(read(tree)))
    return None


def _from_version_file(tree: VllmTree) -> str | None:
    """Each form ``_version.py`` has had: plain, chained or annotated assignment."""
    if not tree.exists(VERSION_FILE):
        return None
    with contextlib.suppress(SyntaxError, ValueError):
        for node in ast.parse(tree.read_bytes(VERSION_FILE)).body:
            targets = getattr(node, "targets", [getattr(node, "target", None)])
            value = getattr(node, "value", None)
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            versions = names & {"__version__", "version"}
            if versions and isinstance(value, ast.Constant):
                return str(value.value)
    return None


def _from_dist_info(tree: VllmTree) -> str | None:
    headers = email.parser.HeaderParser().parsestr(tree.metadata() or "")
    return headers.get("Version")


def _from_wheel_name(tree: VllmTree) -> Version | None:
    return parse_wheel_filename(tree.location.name)[1] if tree.is_wheel else None
