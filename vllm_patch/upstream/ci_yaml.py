"""Wire a patch's tests into a CI step of the checkout's Buildkite YAML: the
step (found by its label) runs the test files and lists the changed sources in
its ``source_file_dependencies`` (the patch's ``[upstream.ci]``, ``CiWiring``).

The edit is made on the text, in the step's own layout, so every other byte
stays; the result must parse to the original document plus exactly the added
entries. The file is data: a regular file inside the work tree (no link on the
way), at most ``MAX_BYTES``, UTF-8, read by a safe loader bounded in nesting,
aliases and expanded size (so comparing is linear). An added line holds only
the tool's own path and the step's indentation, ``pytest`` flags and ``\\``
continuation. Anything else: left out, with the reason, never followed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from patcher.errors import PatchError
from patcher.files import read_text_in, refusal

MAX_BYTES = 64 << 10
"""vLLM's cpu.yaml is 11 kB (0.32.0)."""
MAX_DEPTH, MAX_ALIASES, MAX_NODES = 32, 16, 100_000
"""vLLM's cpu.yaml: 5 deep, 2 aliases, about 400 nodes."""
DEPENDENCIES = "source_file_dependencies"
COMMANDS = "commands"
_PATH = r"tests/[\w/.-]+\.py(?:::[\w:.\[\]-]+)?"
MODEL = re.compile(
    rf"(?P<indent>[ \t]*)(?:(?P<pytest>pytest(?: -[A-Za-z]+)* ){_PATH}"
    rf"|{_PATH}(?P<cont> \\))(?P<eol>\r?\n?)"
)
"""A line a new one may follow: a test path alone in a list continued with
``\\``, or ``pytest -FLAGS`` of one test path; nothing else."""
TEST_PATH = re.compile(rf"(?<![\w/.-]){_PATH}")


@dataclass(frozen=True)
class CiWiring:
    """What a patch adds to a CI step: ``tests`` to the pytest commands of the
    step whose label contains ``step``, ``dependencies`` to its
    ``source_file_dependencies``, in ``file`` (a path in the checkout)."""

    file: str
    step: str
    tests: tuple[str, ...]
    dependencies: tuple[str, ...]


@dataclass
class CiEdit:
    """The edit made, or why the file is left alone (``text`` None)."""

    wiring: CiWiring
    label: str | None = None
    """The step's full label."""
    text: str | None = None
    """The file's new text."""
    reason: str = ""
    added_tests: list[str] = field(default_factory=list)
    added_dependencies: list[str] = field(default_factory=list)
    inserted: list[str] = field(default_factory=list)
    """The command lines added, stripped (to check the parsed result)."""

    def described(self) -> list[str]:
        """What changed, in the words of a commit message's change list."""
        said = []
        if self.added_tests and self.wiring.file.endswith(".sh"):
            tests = _listed(self.added_tests)
            said.append(f"runs {tests} after `{self.wiring.step}`")
        elif self.added_tests:
            said.append(
                f'the "{self.wiring.step}" step runs {_listed(self.added_tests)}'
            )
        if self.added_dependencies:
            deps = _listed(self.added_dependencies)
            said.append(f"and lists {deps} in its `{DEPENDENCIES}`")
        return [" ".join(said)] if said else []


def _listed(items: list[str]) -> str:
    return ", ".join(f"`{x}`" for x in items)


class CiShapeError(ValueError):
    """The step is not laid out the way the text edit understands."""


def wire(root: Path, wiring: CiWiring) -> CiEdit:
    """The edit of ``wiring.file`` under ``root``; nothing is written."""
    edit = CiEdit(wiring)
    try:
        before = read_text_in(root, wiring.file, "the CI file", limit=MAX_BYTES)
        if before is None:
            edit.reason = f"this checkout has no {wiring.file}"
            return edit
        if wiring.file.endswith(".sh"):
            edit.label = wiring.file.rsplit("/", 1)[-1]
            after = _script_text(before, edit)
        else:
            old = load(before)
            edit.label = _find_label(old, wiring.step, wiring.file)
            after = _edit_text(before, edit)
            _verify(old, after, edit)
    except (PatchError, CiShapeError) as exc:
        bad = isinstance(exc, PatchError)
        edit.reason = f"left out: {wiring.file}: {refusal(exc)}" if bad else str(exc)
        return edit
    edit.text = after if after != before else None
    if edit.text is None:
        edit.reason = f'the "{edit.label}" step runs and lists these already'
    return edit


LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""PyYAML's safe loader, libyaml's where PyYAML has it (40 times faster)."""


def load(text: str):
    """The document in ``text``, read by the safe loader after its events were
    counted (nesting, aliases) and its node graph measured (the size with every
    alias expanded, each node counted once): ``CiShapeError`` past a bound or if
    it is not YAML, naming the line and column, never the file's text."""
    try:
        depth = aliases = 0
        for event in yaml.parse(text, Loader=LOADER):
            if isinstance(event, yaml.AliasEvent):
                aliases += 1
            elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                depth += 1
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
            if depth > MAX_DEPTH or aliases > MAX_ALIASES:
                raise CiShapeError(
                    f"left out: YAML nested over {MAX_DEPTH} deep or with over "
                    f"{MAX_ALIASES} aliases"
                )
        loader = LOADER(text)
        try:
            node = loader.get_single_node()
            if node is not None and _expanded(node, {}) > MAX_NODES:
                raise CiShapeError(f"left out: YAML expanding past {MAX_NODES} nodes")
            return loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise CiShapeError(f"left out: not YAML the safe loader reads{where}") from exc


def _expanded(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes of ``node`` with every alias expanded, each node counted once
    (linear; nesting is bounded)."""
    if id(node) not in sizes:
        sizes[id(node)] = MAX_NODES + 1  # a node inside itself: refused
        items = node.value if isinstance(node.value, list) else []
        kids = [k for i in items for k in (i if isinstance(i, tuple) else (i,))]
        sizes[id(node)] = 1 + sum(_expanded(k, sizes) for k in kids)
    return sizes[id(node)]


def _find_label(doc, step: str, file: str) -> str:
    steps = doc.get("steps") if isinstance(doc, dict) else None
    labels = [
        s["label"]
        for s in steps or []
        if isinstance(s, dict) and step in str(s.get("label", ""))
    ]
    if len(labels) != 1:
        raise CiShapeError(
            f"{file}: looked for one step labelled {step!r}, found {len(labels)}"
        )
    return labels[0]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _step_lines(lines: list[str], label: str) -> tuple[int, int]:
    """[start, end) of the step whose ``- label:`` line names ``label``."""
    head = re.compile(r"^(\s*)- label:\s*['\"]?" + re.escape(label) + r"['\"]?\s*$")
    starts = [i for i, line in enumerate(lines) if head.match(line)]
    if len(starts) != 1:
        raise CiShapeError(f"no single '- label: {label}' line")
    start = starts[0]
    dash = _indent(lines[start])
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > dash):
        end += 1
    return start, end


def _key_block(lines: list[str], start: int, end: int, key: str) -> tuple[int, int]:
    """[first, last) lines of the value of ``key`` inside the step's lines."""
    keys = [i for i in range(start, end) if re.match(rf"^\s*(- )?{key}:\s*$", lines[i])]
    if len(keys) != 1:
        raise CiShapeError(f"no single block '{key}:' in the step")
    at = keys[0]
    indent = _indent(lines[at]) + (2 if lines[at].lstrip().startswith("- ") else 0)
    last = at + 1
    while last < end and (
        not lines[last].strip()
        or _indent(lines[last]) > indent
        or (_indent(lines[last]) == indent and lines[last].lstrip().startswith("- "))
    ):
        last += 1
    while last > at + 1 and not lines[last - 1].strip():
        last -= 1  # trailing blank lines belong between steps
    return at + 1, last


def _edit_text(text: str, edit: CiEdit) -> str:
    lines = text.splitlines(keepends=True)
    start, end = _step_lines(lines, edit.label)
    deps_at, deps_end = _key_block(lines, start, end, DEPENDENCIES)
    cmd_at, cmd_end = _key_block(lines, start, end, COMMANDS)
    offset, new_tests = _test_lines(lines[cmd_at:cmd_end], edit)
    inserts = [(cmd_at + offset, new_tests)]
    offset, new_deps = _dependency_lines(lines[deps_at:deps_end], edit)
    inserts.append((deps_at + offset, new_deps))
    for at, added in sorted(inserts, reverse=True):  # later lines first
        lines[at:at] = added
    edit.inserted = [line.strip() for line in new_tests]
    return "".join(lines)


def _dependency_lines(block: list[str], edit: CiEdit) -> tuple[int, list[str]]:
    """(offset in the block to insert at, new ``- path`` lines)."""
    items = [i for i, line in enumerate(block) if line.lstrip().startswith("- ")]
    if not items:
        raise CiShapeError(f"{DEPENDENCIES} of the step is not a block list")
    last = block[items[-1]]
    prefix = last[: _indent(last)] + "- "
    listed = {line.strip()[2:].strip() for line in block if line.strip()}
    new = [d for d in edit.wiring.dependencies if d not in listed]
    edit.added_dependencies = new
    return items[-1] + 1, [f"{prefix}{d}\n" for d in new]


def _test_lines(block: list[str], edit: CiEdit) -> tuple[int, list[str]]:
    """(offset to insert at, one line per new test): the test path in the
    layout of the last line that is a test path alone or a ``pytest`` of one
    and does not close the command string."""
    models = [(i, m) for i, line in enumerate(block) if (m := MODEL.fullmatch(line))]
    if not models:
        raise CiShapeError(
            "found no line of the step's commands that is a test file alone (or "
            "a pytest of one) that a new line could follow"
        )
    at, model = models[-1]
    listed = {m.group(0) for line in block for m in TEST_PATH.finditer(line)}
    new = [t for t in edit.wiring.tests if t not in listed]
    edit.added_tests = new
    indent, pytest, cont, eol = model.group("indent", "pytest", "cont", "eol")
    return at + 1, [f"{indent}{pytest or ''}{t}{cont or ''}{eol}" for t in new]


def _script_text(text: str, edit: CiEdit) -> str:
    """A shell script with the new tests' ``pytest`` lines after the one line
    that runs ``wiring.step`` (a sibling test), in its layout."""
    lines = text.splitlines(keepends=True)
    at = [
        i
        for i, line in enumerate(lines)
        if (m := MODEL.fullmatch(line)) and m["pytest"] and edit.wiring.step in line
    ]
    if len(at) != 1:
        raise CiShapeError(
            f"{edit.wiring.file}: looked for one `pytest` line of "
            f"{edit.wiring.step}, found {len(at)}"
        )
    offset, new = _test_lines([lines[at[0]]], edit)
    lines[at[0] + offset : at[0] + offset] = new
    return "".join(lines)


def _verify(old, after: str, edit: CiEdit) -> None:
    """``after`` parses to the ``old`` document plus exactly the added entries."""
    new = load(after)
    old_step, new_step = _step(old, edit.label), _step(new, edit.label)
    if not isinstance(old_step.get(DEPENDENCIES), list):
        raise CiShapeError(f"{DEPENDENCIES} of the step is not a list")
    if new_step.get(DEPENDENCIES) != old_step[DEPENDENCIES] + edit.added_dependencies:
        raise CiShapeError(f"the edited {DEPENDENCIES} did not parse as intended")
    commands = [str(c) for c in new_step.get(COMMANDS, [])]
    if not all(t in " ".join(commands) for t in edit.added_tests):
        raise CiShapeError("the edited commands do not run the added tests")
    new_step[DEPENDENCIES] = old_step.get(DEPENDENCIES)
    kept = (c.splitlines(keepends=True) for c in commands)
    new_step[COMMANDS] = [
        "".join(x for x in c if x.strip() not in edit.inserted) for c in kept
    ]
    if new != old:
        raise CiShapeError("the text edit changed more than the step's two lists")


def _step(doc: dict, label: str) -> dict:
    return next(
        s for s in doc["steps"] if isinstance(s, dict) and s.get("label") == label
    )
