"""Read the version of a vLLM tree without importing it."""

from __future__ import annotations

import ast
import email.parser
import zipfile

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


def _from_version_file(tree: VllmTree) -> Version | None:
    if not tree.exists(VERSION_FILE):
        return None
    try:
        module = ast.parse(tree.read_bytes(VERSION_FILE))
    except (SyntaxError, ValueError):
        return None
    for node in module.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if names & {"__version__", "version"} and isinstance(node.value, ast.Constant):
            return _parse(str(node.value.value))
    return None


def _from_dist_info(tree: VllmTree) -> Version | None:
    if tree.is_wheel:
        with zipfile.ZipFile(tree.location) as zf:
            names = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
            text = zf.read(names[0]).decode("utf-8", "replace") if names else None
    elif tree.dist_info is not None and (tree.dist_info / "METADATA").is_file():
        text = (tree.dist_info / "METADATA").read_text("utf-8", "replace")
    else:
        text = None
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
