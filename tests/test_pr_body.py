"""What `vllm-patch pr` writes for vLLM's reviewers, rendered without git or
vLLM: the description in each real template, free of this tool and this
machine, and the commit message within 72 columns."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from vllm_patch.upstream import pr_body
from vllm_patch.upstream.ci_yaml import wire
from vllm_patch.upstream.meta import pick_patch, upstream_of
from vllm_patch.upstream.pr import WIDTH, Identity, commit_message
from vllm_patch.upstream.template import TEMPLATE
from vllm_patch.upstream.vllm_tests import TestRun

PATCH = pick_patch("cpu_fused_norms")
UPSTREAM = upstream_of(PATCH)
FIXTURES = Path(__file__).parent / "fixtures" / "upstream_files"
TEST = "tests/kernels/ir/test_layernorm.py"
# What must never reach vLLM's reviewers: this tool, how it ran, this machine.
LEAKS = [
    "vllm-patch",
    "vllm_patch",
    "cpu_fused_norms",
    "vllm_c_cpu",
    "hard-linked",
    "--noconftest",
    "--import-mode",
    "PYTHONPATH",
    "(upstream)",
    "(native)",
    "installed for",
    "Traceback",
    'File "',
    sys.executable,
    str(Path.home()),
    "/tmp/",
    ".json",
]
RAN = TestRun(
    files=(TEST,),
    command=f"pytest {TEST}",
    ran=True,
    counts={"passed": 1084, "failed": 0, "errors": 0, "skipped": 724},
    seconds=360.0,
    vllm="0.32.0",
    torch="2.13.0+cpu",
    machine="AMD EPYC 9R14 (x86_64; avx2, fma, avx512f)",
)
NOT_RAN = TestRun(
    files=(TEST,),
    command=f"pytest {TEST}",
    ran=False,
    reason=f"the vLLM installed for {sys.executable} is 0.33.0: Traceback ...",
)


def checkout(tmp_path: Path, release: str | None) -> Path:
    root = tmp_path / "vllm"
    (root / ".buildkite/hardware_tests").mkdir(parents=True)
    (root / ".github").mkdir()
    if release:
        shutil.copy(FIXTURES / release / "PULL_REQUEST_TEMPLATE.md", root / TEMPLATE)
        shutil.copy(FIXTURES / release / "cpu.yaml", root / UPSTREAM.ci.file)
    return root


def render(root: Path, run: TestRun, evidence: list[Path]) -> str:
    facts = pr_body.Facts(
        version=Version("0.32.0"),
        evidence=pr_body.load_evidence(evidence),
        checkout=root,
        described={"vllm/kernels/vllm_c.py": ["`GPGPU_DEVICE` gains the CPU"]},
        tests_run=run,
        ci=wire(root, UPSTREAM.ci),
    )
    return pr_body.render(PATCH, UPSTREAM, facts)


@pytest.mark.parametrize(
    "release, sections",
    [
        pytest.param(
            "v0.32.0", ["Overview", "Claims", "Validation", "Details"], id="v0.32.0"
        ),
        pytest.param("v0.27.0", ["Purpose", "Test Plan", "Test Result"], id="v0.27.0"),
        pytest.param(
            None, ["Overview", "Claims", "Validation", "Details"], id="no template"
        ),
    ],
)
@pytest.mark.parametrize("run", [RAN, NOT_RAN], ids=["tests ran", "tests not run"])
@pytest.mark.parametrize("bench", [True, False], ids=["bench", "no bench"])
def test_the_description_speaks_of_vllm_alone(tmp_path, release, sections, run, bench):
    evidence = [pr_body.DEFAULT_EVIDENCE[1]] if bench else [tmp_path / "none"]
    text = render(checkout(tmp_path, release), run, evidence)

    assert re.findall(r"^## (.+)$", text, re.MULTILINE) == sections
    for leak in LEAKS:
        assert leak not in text, leak
    assert "[x]" not in text
    assert UPSTREAM.rule in text
    if run.ran:
        assert "**1084 passed, 0 failed, 0 errors, 724 skipped**" in text
        assert "AMD EPYC 9R14 (x86_64; avx2, fma, avx512f)" in text
        assert "vLLM 0.32.0 (torch 2.13.0+cpu)" in text
    else:  # the reviewer's command instead of a result
        assert f"```bash\npytest {TEST}\n```" in text
    # Concrete claims from the bench's figures, where there is a bench result.
    assert ("x faster than native per call" in text) is bench
    if release:
        assert f'runs `{TEST}` in its "CPU-Kernel Tests' in text
    else:
        assert f"this checkout has no {UPSTREAM.ci.file}" in text


def test_the_numerics_note_is_in_the_details_only_when_the_patch_has_one(tmp_path):
    root = checkout(tmp_path, "v0.32.0")
    facts = pr_body.Facts(version=None, evidence=pr_body.Evidence(), checkout=root)
    note = "bfloat16 NOTE with figures"
    with_note = pr_body.render(
        PATCH, UPSTREAM.__class__(**{**vars(UPSTREAM), "numerics_note": note}), facts
    )
    without = pr_body.render(
        PATCH, UPSTREAM.__class__(**{**vars(UPSTREAM), "numerics_note": ""}), facts
    )
    assert note in with_note.split("## Details", 1)[1]
    assert note not in without


def test_the_commit_message_wraps_at_72_columns():
    described = {
        "vllm/kernels/vllm_c.py": [
            "`rms_add_no_var_size`, the fused_add_rms_norm impl's `supports_args`, "
            "refuses a non-contiguous `x` and `x_residual` on CPU"
        ],
        TEST: [
            "New `test_fused_add_rms_norm_vllm_c_sends_non_contiguous_input_to_"
            "native_on_cpu`: a non-contiguous input goes to native"
        ],
    }
    message = commit_message(UPSTREAM, Identity("Ada", "ada@example.com"), described)
    lines = message.splitlines()
    assert lines[0] == UPSTREAM.title and lines[1] == ""
    assert max(len(line) for line in lines) <= WIDTH, message
    flat = " ".join(message.split())
    assert " ".join(UPSTREAM.rule.split()) in flat
    assert "- vllm/kernels/vllm_c.py: `rms_add_no_var_size`" in flat
    assert lines[-1] == "Signed-off-by: Ada <ada@example.com>"
