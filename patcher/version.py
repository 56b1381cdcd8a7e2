"""Read the version of a vLLM tree without importing it."""

from __future__ import annotations

import ast
import email.parser

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from patcher.tree import VllmTree

VERSION_FILE = "vllm/_version.py"


def read_version(tree: VllmTree) -> Version | None:
    """From ``vllm/_version.py``, else the dist-info, else the wheel's name."""
    for reader in (_from_version_file, _from_dist_info, _from_wheel_name):
        version = reader(tree)
        if version is not None:
            return version
    return None


def _parse(text: str | None) -> Version | None:
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


VERSION_NAMES = {"__version__", "version"}


def _from_version_file(tree: VllmTree) -> Version | None:
    """Every form vLLM's ``_version.py`` has had: ``__version__ = version = "x"``,
    ``version = "x"``, and annotated (``__version__: str = "x"``)."""
    if not tree.exists(VERSION_FILE):
        return None
    try:
        module = ast.parse(tree.read_bytes(VERSION_FILE))
    except (SyntaxError, ValueError):
        return None
    for node in module.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if names & VERSION_NAMES and isinstance(value, ast.Constant):
            return _parse(str(value.value))
    return None


def _from_dist_info(tree: VllmTree) -> Version | None:
    text = tree.metadata()
    if text is None:
        return None
    return _parse(email.parser.HeaderParser().parsestr(text).get("Version"))


def _from_wheel_name(tree: VllmTree) -> Version | None:
    if not tree.is_wheel:
        return None
    try:
        return parse_wheel_filename(tree.location.name)[1]
    except InvalidWheelFilename:
        return None
