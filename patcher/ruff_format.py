"""Lay out Python source as vLLM's ``ruff format`` does, with the pinned ruff,
so ``apply``, ``diff`` and ``pr`` show the same lines."""

import subprocess
import textwrap
from functools import cache, lru_cache

import libcst as cst

from patcher.errors import PatchError

LINE_LENGTH = 88  # vLLM's pyproject.toml [tool.ruff]


@cache
def ruff_binary() -> str:
    """The pinned ruff's executable (the ``ruff`` package's own binary)."""
    try:
        from ruff.__main__ import find_ruff_bin  # a dependency of vllm-patch
    except ImportError:
        raise PatchError(
            "ruff is not installed: the codemods lay out their code with it",
            looked_for="the ruff package vllm-patch depends on (its pinned release)",
            found="no module named ruff; reinstall vllm-patch to get it back",
        ) from None
    return str(find_ruff_bin())


@lru_cache(maxsize=1024)
def format_source(source: str, indent: str = "    ") -> str:
    """``source`` as ``ruff format`` lays it out with vLLM's settings and ``indent``."""
    tabs = indent == "\t"
    style = 'format.indent-style="tab"' if tabs else f"indent-width={len(indent)}"
    cmd = [ruff_binary(), "format", "--isolated", "--no-cache", "--config", style]
    cmd += ["--line-length", str(LINE_LENGTH), "--target-version", "py310", "-"]
    # Bytes in and out: text mode would translate the file's line endings.
    done = subprocess.run(cmd, input=source.encode(), capture_output=True)
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()
        raise PatchError("ruff format failed", None, "source ruff can format", said)
    return done.stdout.decode()


def format_statements(module: cst.Module, at: set[int]) -> cst.Module:
    """The statements at indices ``at`` as ruff lays out the module; the rest as is."""
    if not at:
        return module
    ruffs = cst.parse_module(format_source(module.code, module.default_indent))
    if len(ruffs.body) != len(module.body):
        wanted = "a module ruff lays out statement by statement"
        found = f"{len(module.body)} statements, {len(ruffs.body)} after ruff"
        raise PatchError("ruff format splits or joins statements", None, wanted, found)
    body = [ruffs.body[i] if i in at else s for i, s in enumerate(module.body)]
    return module.with_changes(body=body)


def format_member(source: str, module: cst.Module) -> cst.BaseStatement:
    """``source`` (a class member at column 0) as ruff lays it out in ``module``."""
    out = format_source(
        f"class _:\n{textwrap.indent(source, '    ')}", module.default_indent
    )
    out = out.replace("\n", module.default_newline)  # ruff kept the "\n" it got
    klass = cst.parse_statement(out, config=module.config_for_parsing)
    return klass.body.body[0]
