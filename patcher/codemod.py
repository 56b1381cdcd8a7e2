"""What a patch's codemod gets: LibCST's interface (``DESCRIPTION``, a ``context``),
``TARGET`` from its ``patch.toml``, the tree's other files. Not a LibCST
``Codemod``: importing ``libcst.codemod`` costs half a second of every ``check``."""

import ast
import os
from collections import Counter
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import libcst as cst

from patcher.errors import PatchError, ShapeNotRecognised, VllmHasItsOwn
from patcher.files import read_text_at
from patcher.patchset import declared_file

# Keys in ``CodemodContext.scratch``: the engine's ``relpath -> str`` reader of
# the tree's files (also inside a wheel), and the sentences the codemod recorded.
TREE_READER = "vllm_patch.read_tree_file"
CHANGES = "vllm_patch.changes"
BOM = "\ufeff"


class TreeCodemod:
    """A codemod for one file of a vLLM source tree."""

    DESCRIPTION: str = ""
    TARGET: str = ""  # the edited file in the tree, from its patch.toml's ``file``

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.TARGET = declared_file(cls) or cls.TARGET

    def __init__(self, context) -> None:
        self.context = context

    @staticmethod
    def add_args(arg_parser) -> None:
        """No options (``libcst.tool`` asks)."""

    @classmethod
    def get_inherited_dependencies(cls) -> frozenset:
        """No LibCST metadata (``libcst.tool`` asks)."""
        return frozenset()

    def transform_module(self, tree: cst.Module) -> cst.Module:
        filename = self.context.filename
        path = PurePosixPath(Path(filename).as_posix()) if filename else None
        if path and not path.match(self.TARGET):
            from libcst.codemod import SkipFile  # run by libcst.tool: imported

            raise SkipFile(f"{type(self).__name__} edits only {self.TARGET}")
        return self.transform_module_impl(tree)

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        raise NotImplementedError

    def record(self, change: str) -> None:
        """Say what this run changed, in one sentence (Markdown),
        for the PR text."""
        self.context.scratch.setdefault(CHANGES, []).append(change)

    def shape_error(self, looked_for: str, found: str) -> ShapeNotRecognised:
        return ShapeNotRecognised(looked_for, found, path=self.TARGET)

    def vllm_has_its_own(self, what: str) -> VllmHasItsOwn:
        """For a file with vLLM's own form of the change: ``check`` exits 0."""
        return VllmHasItsOwn(f"{self.TARGET} has {what}")

    def top_level_class(
        self, tree: cst.Module, name: str
    ) -> tuple[int, cst.ClassDef]:
        """The module-level class ``name`` and its index, or a shape error."""
        for i, stmt in enumerate(tree.body):
            if isinstance(stmt, cst.ClassDef) and stmt.name.value == name:
                return i, stmt
        names = [s.name.value for s in tree.body if isinstance(s, cst.ClassDef)]
        raise self.shape_error(f"class {name}", f"classes: {names or 'none'}")

    @staticmethod
    def with_body(tree: cst.Module, at: int, node, body) -> cst.Module:
        """``tree`` with the body of its ``at``-th statement ``node`` replaced."""
        new = node.with_changes(body=node.body.with_changes(body=body))
        return tree.with_changes(body=[*tree.body[:at], new, *tree.body[at + 1 :]])

    def parse_tree_file(self, relpath: str) -> cst.Module:
        return parse(self.read_tree_file(relpath), relpath)

    def read_tree_ast(self, relpath: str) -> ast.Module:
        """Another file of the tree, parsed by ``ast`` (fast: to read only)."""
        text = self.read_tree_file(relpath)
        try:
            return ast.parse(text.removeprefix(BOM), relpath)
        except (SyntaxError, ValueError) as exc:
            raise _syntax_error(text, relpath, "a Python module", str(exc)) from exc

    def read_tree_file(self, relpath: str) -> str:
        reader: Callable[[str], str] | None = self.context.scratch.get(TREE_READER)
        if reader is not None:
            return reader(relpath)
        if not self.context.filename:  # run by libcst.tool: the root from our file
            raise PatchError(
                f"needs {relpath} from the same tree, but has no filename"
            )
        depth = len(PurePosixPath(self.TARGET).parts)
        root = Path(self.context.filename).resolve().parents[depth - 1]
        return read_text_at(Path(os.path.realpath(root / relpath)), relpath)


def names(node: cst.CSTNode) -> Counter[str]:
    """How often each name occurs in ``node``."""
    counts: Counter[str] = Counter()

    class Names(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            counts[name.value] += 1

    node.visit(Names())
    return counts


def source(node: cst.CSTNode) -> str:
    """A node's code, stripped."""
    return cst.Module([]).code_for_node(node).strip()


@lru_cache(maxsize=8)  # a module is immutable: one parse per text, shared
def parse(source: str, relpath: str) -> cst.Module:
    try:
        return cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        where = f"line {exc.raw_line}, column {exc.raw_column}: {exc.message}"
        looked_for = "a Python module LibCST can parse"
        raise _syntax_error(source, relpath, looked_for, where) from exc


def _syntax_error(source: str, relpath: str, looked_for: str, said: str):
    """A syntax error where CPython puts it (LibCST's parser may be a line off)."""
    try:
        compile(source.removeprefix(BOM), relpath, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as err:
        if "\0" in source:  # CPython gives no position for a NUL byte
            before = source[: source.index("\0")]
            line = before.count("\n") + 1
            column = len(before.rpartition("\n")[2]) + 1
            said = f"line {line}, column {column}: a NUL byte (not Python source)"
        else:
            said = f"line {err.lineno}, column {err.offset}: {err.msg}"
    return PatchError(
        "syntax error", path=relpath, looked_for=looked_for, found=said
    )


def run_codemod(
    codemod: type[TreeCodemod],
    source: str,
    read_tree_file: Callable[[str], str],
    said: list[str] | None = None,
) -> str:
    """``codemod`` run on ``source``; a BOM, which LibCST drops, is put back."""
    bom = BOM if source.startswith(BOM) else ""
    module = parse(source.removeprefix(bom), codemod.TARGET)
    context = SimpleNamespace(
        filename=codemod.TARGET, scratch={TREE_READER: read_tree_file}
    )
    code = codemod(context).transform_module(module).code
    if said is not None:
        said += context.scratch.get(CHANGES, ())
    return bom + code
