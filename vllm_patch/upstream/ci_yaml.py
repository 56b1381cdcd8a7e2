"""A patch's tests wired into the checkout's CI (a Buildkite step, a script) as a
text edit; YAML must parse to the old plus the added entries (data:
docs/safety.md)."""

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from patcher.errors import PatchError
from patcher.files import read_text_in, refusal

CI_BYTES = 64 << 10  # vLLM's cpu.yaml is 11 kB (0.32.0)
MAX_DEPTH, MAX_ALIASES, MAX_NODES = 32, 16, 100_000  # cpu.yaml: 5, 2, about 400
DEPENDENCIES = "source_file_dependencies"
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: 40 times faster
_PATH = r"tests/[\w/.-]+\.py(?:::[\w:.\[\]-]+)?"
# A line a new one may follow: a test path alone in a list continued with a
# backslash, or ``pytest -FLAGS`` of one test path; nothing else.
MODEL = re.compile(
    rf"(?P<indent>[ \t]*)(?:(?P<pytest>pytest(?: -[A-Za-z]+)* ){_PATH}"
    rf"|{_PATH}(?P<cont> \\))(?P<eol>\r?\n?)"
)
TEST_PATH = re.compile(rf"(?<![\w/.-]){_PATH}")


@dataclass(frozen=True)
class CiWiring:
    """``tests`` to run in ``file``: in the step whose label contains ``step``
    (listing ``dependencies``), or in a script after the test ``step``'s line."""

    file: str
    step: str
    tests: tuple[str, ...]
    dependencies: tuple[str, ...]


@dataclass
class CiEdit:
    """The file's new ``text``, or why it is left alone (``text`` None)."""

    wiring: CiWiring
    label: str | None = None  # the step's full label
    text: str | None = None
    reason: str = ""
    left_out: bool = False  # refused as data (a link, a bound, not YAML)
    added_tests: list[str] = field(default_factory=list)
    added_dependencies: list[str] = field(default_factory=list)

    def described(self) -> list[str]:
        """What changed, or why it is left alone."""
        if self.text is None:
            return [self.reason]
        tests = ", ".join(f"`{t}`" for t in self.added_tests)
        step = self.wiring.step
        said = [f"runs {tests} after `{step}`"] if tests else []
        if tests and not self.wiring.file.endswith(".sh"):
            said = [f'the "{step}" step runs {tests}']
        deps = ", ".join(f"`{d}`" for d in self.added_dependencies)
        if deps:
            said.append(f"and lists {deps} in its `{DEPENDENCIES}`")
        return [" ".join(said)] if said else []


class CiShapeError(ValueError):
    """The file is not laid out the way the text edit understands."""


def wire(root: Path, wiring: CiWiring) -> CiEdit:
    """The edit of ``wiring.file`` under ``root``; nothing is written."""
    edit = CiEdit(wiring)
    try:
        before = read_text_in(root, wiring.file, "the CI file", limit=CI_BYTES)
        if before is None:
            edit.reason = f"this checkout has no {wiring.file}"
        elif wiring.file.endswith(".sh"):
            edit.text = _script_text(before, edit)
        else:
            edit.text = _yaml_text(before, edit)
    except PatchError as exc:
        edit.reason = f"left out: {wiring.file}: {refusal(exc)}"
        edit.left_out = True
    except CiShapeError as exc:
        edit.reason = str(exc)
    if edit.text is not None and edit.text == before:
        edit.text = None
        edit.reason = f'the "{edit.label}" step runs and lists these already'
    return edit


def load_yaml(text: str) -> tuple[yaml.Node | None, object]:
    """``text``'s node graph and document within the bounds, or a refusal."""
    try:
        depth = aliases = 0
        for event in yaml.parse(text, Loader=LOADER):
            aliases += isinstance(event, yaml.AliasEvent)
            depth += isinstance(event, yaml.CollectionStartEvent)
            depth -= isinstance(event, yaml.CollectionEndEvent)
            if depth > MAX_DEPTH or aliases > MAX_ALIASES:
                raise PatchError(
                    f"YAML nested over {MAX_DEPTH} deep or with over "
                    f"{MAX_ALIASES} aliases"
                )
        loader = LOADER(text)
        node = loader.get_single_node()
        if node is not None and _expanded(node, {}) > MAX_NODES:
            raise PatchError(f"YAML expanding past {MAX_NODES} nodes")
        return node, node and loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise PatchError(f"not YAML the safe loader reads{where}") from exc


def _expanded(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes of ``node`` with every alias expanded, each node counted once."""
    if id(node) not in sizes:
        sizes[id(node)] = MAX_NODES + 1  # a node inside itself: refused
        items = node.value if isinstance(node.value, list) else []
        kids = [k for i in items for k in (i if isinstance(i, tuple) else (i,))]
        sizes[id(node)] = 1 + sum(_expanded(k, sizes) for k in kids)
    return sizes[id(node)]


def _value_of(node: yaml.Node | None, key: str) -> yaml.Node | None:
    """The value of ``key`` in a mapping node that has it once, else None."""
    mapping = isinstance(node, yaml.MappingNode)
    found = [v for k, v in node.value if k.value == key] if mapping else []
    return found[0] if len(found) == 1 else None


def _block_list(step: yaml.Node, key: str) -> list[yaml.Node]:
    """The items of the step's ``key``, a block list of at least one."""
    found = _value_of(step, key)
    block_list = isinstance(found, yaml.SequenceNode) and not found.flow_style
    if not block_list or not found.value:
        raise CiShapeError(f"no single block '{key}:' in the step")
    return found.value


def _yaml_text(text: str, edit: CiEdit) -> str:
    """The step's new tests and files; it must parse to the old plus exactly
    them."""
    node, old = load_yaml(text)
    steps = _value_of(node, "steps")
    found = [
        (label.value, step, i)
        for i, step in enumerate(steps.value if steps else ())  # a list's: mappings
        if isinstance(label := _value_of(step, "label"), yaml.ScalarNode)
        and edit.wiring.step in label.value
    ]
    if len(found) != 1:
        raise CiShapeError(
            f"{edit.wiring.file}: looked for one step labelled "
            f"{edit.wiring.step!r}, found {len(found)}"
        )
    edit.label, step, index = found[0]
    deps, commands = (_block_list(step, k) for k in (DEPENDENCIES, "commands"))
    lines = text.splitlines(keepends=True)
    start, last = commands[0].start_mark.line, commands[-1].end_mark
    end = last.line + 1 if last.column else last.line  # a block scalar ends at 0
    offset, new_tests = _test_lines(lines[start:end], edit)
    listed = {d.value for d in deps}
    edit.added_dependencies = [
        d for d in edit.wiring.dependencies if d not in listed
    ]
    dash = lines[deps[-1].start_mark.line][: deps[-1].start_mark.column]  # "  - "
    new_deps = [f"{dash}{d}\n" for d in edit.added_dependencies]
    inserts = [(start + offset, new_tests), (deps[-1].end_mark.line + 1, new_deps)]
    for at, added in sorted(inserts, reverse=True):  # the later lines first
        lines[at:at] = added
    new = load_yaml("".join(lines))[1]
    old["steps"][index][DEPENDENCIES] += edit.added_dependencies
    inserted = {line.strip() for line in new_tests}
    try:  # the added test lines taken out again
        commands = [str(c) for c in new["steps"][index]["commands"]]
        new["steps"][index]["commands"] = [
            "".join(x for x in c.splitlines(True) if x.strip() not in inserted)
            for c in commands
        ]
    except (KeyError, IndexError, TypeError):
        commands = []
    if new != old or not all(t in " ".join(commands) for t in edit.added_tests):
        raise CiShapeError(
            "the edited file does not parse to the original plus the added entries"
        )
    return "".join(lines)


def _test_lines(block: list[str], edit: CiEdit) -> tuple[int, list[str]]:
    """(where to insert, a line per new test) laid out as ``block``'s last MODEL."""
    models = [
        (i, m) for i, line in enumerate(block) if (m := MODEL.fullmatch(line))
    ]
    if not models:
        raise CiShapeError(
            "found no line of the step's commands that is a test file alone (or "
            "a pytest of one) that a new line could follow"
        )
    at, model = models[-1]
    listed = {m.group(0) for line in block for m in TEST_PATH.finditer(line)}
    edit.added_tests = [t for t in edit.wiring.tests if t not in listed]
    indent, pytest, cont, eol = model.group("indent", "pytest", "cont", "eol")
    return at + 1, [
        f"{indent}{pytest or ''}{t}{cont or ''}{eol}" for t in edit.added_tests
    ]


def _script_text(text: str, edit: CiEdit) -> str:
    """The new tests' ``pytest`` lines after the one running ``wiring.step``."""
    edit.label = edit.wiring.file.rsplit("/", 1)[-1]
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
    lines[at[0] + 1 : at[0] + 1] = _test_lines([lines[at[0]]], edit)[1]
    return "".join(lines)
