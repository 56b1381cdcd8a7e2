"""Both forms of the change and the provider against the rule
(``patches/cpu_norm_rule.py``), on the installed vLLM: every cell of dtype {float32, bfloat16, float16} x
hidden size {8, 12, 2048, 4100} x layout {contiguous, a q/k norm's strided
view, 3-D} x residual {none, same dtype, another dtype} x weight {weight, none,
variance size override}, eager, compiled (``custom_ops: ["none"]``) and
compiled with ``+rms_norm`` (one ``torch.compile(fullgraph=True)`` graph of
every cell native takes per mode). In every cell the kernel ran exactly where
the rule says (torch's profiler counts ``_C::`` events), its output is within
vLLM IR's tolerance for the dtype (``get_tolerance``) of native, and nothing
raises that native does not, and where a kernel ran no output (the residual it
writes back included) has a bias native lacks (``bias_matches``: the mean
signed relative error against float64, within native's plus the margin). The
residual stream after 64 bfloat16 fused adds keeps its norm within 1% of exact.
All of it at one OpenMP thread and at as many as the process has CPUs, on
every x86 kernel build this CPU runs: vLLM's pick, then each older CPU class's
build, forced as a CPU of that class gets it (``cpu_library.force``: vLLM and
the rule both see that class).

Each form runs in its own child (``compat_matrix/conformance_table.py``): the
CustomOp form and the IR form on a patched copy, the provider opted in on the
installed vLLM. Expectations come from the rule, so the table holds on any build.
``nox -s conformance`` keeps the table's summary (``conformance``, a test-suite
property of its JUnit XML) in ``compat_matrix/results/``, for MATRIX.md."""

from __future__ import annotations

import pytest

from compat_matrix.conformance_table import (
    DIMENSIONS,
    DTYPES,
    KERNELS,
    bias_matches,
    cells,
    summary,
    thread_layouts,
    wrong,
)
from patcher.patchset import select
from patcher.tree import open_tree
from patches.cpu_fused_norms.identity import OPT_IN_ENV
from vllm_patch.runtime import child, cpu_library, machine

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

FORMS = {
    "custom_op": "rms_norm_forward_cpu",
    "ir": "cpu_fused_norms",
    "provider": None,
}
MODES = ["eager", "compiled", "plus_rms_norm"]
# As vLLM compiles: Inductor.
BACKEND = "inductor"


def _start(form: str, copy_of=None, **kwargs):
    """The provider with every plugin and the opt-in; a form with no plugin."""
    provider = form == "provider"
    return child.start(
        "compat_matrix.conformance_table:everything",
        {"form": form, **kwargs},
        pythonpath=[copy_of] if copy_of else [],
        env={OPT_IN_ENV: "1"} if provider else {"VLLM_PLUGINS": "none"},
        drop_env=["VLLM_PLUGINS"] if provider else [OPT_IN_ENV],
        timeout=1800,
    )


BUILDS = [None, *cpu_library.runnable(machine.cpu()["flags"])[1:]]
"""vLLM's own pick (None), then each older x86 CPU class's build, forced as a
CPU of that class gets it: every x86 kernel build this CPU runs."""
THREADS = thread_layouts()
"""One OpenMP thread, and as many as the process has CPUs (vLLM's default)."""
LAYOUTS = [(library, threads) for library in BUILDS for threads in THREADS]
RUNS = [(form, *layout) for layout in LAYOUTS for form in FORMS]
IDS = [f"{form}-{lib or 'own build'}-{n} threads" for form, lib, n in RUNS]
CELLS = len(cells())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every form's table on every build and thread layout, the three forms'
    children side by side, one build and layout after the other."""
    import contextlib

    from vllm_patch.runtime.patched_copy import patched_copy

    out = {}
    with contextlib.ExitStack() as stack:
        copies = {
            form: patch
            and stack.enter_context(
                patched_copy(
                    open_tree(None),
                    select([patch])[0],
                    parent=tmp_path_factory.mktemp(form),
                )
            )
            for form, patch in FORMS.items()
        }
        for library, threads in LAYOUTS:
            started = {
                (form, library, threads): _start(
                    form,
                    copy,
                    modes=MODES,
                    backend=BACKEND,
                    library=library,
                    threads=threads,
                )
                for form, copy in copies.items()
            }
            out |= {key: child.finish(c).value() for key, c in started.items()}
    return out


@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_every_eager_cell(results, run):
    """Every cell ran and none is against the rule; at one thread (where the
    rule keeps the kernels) some ran a kernel and some native."""
    found = results[run]["table"]["cells"]
    assert len(found) == CELLS
    if run[2] == 1:
        assert any(c["kernel"] for c in found) and not all(
            c["kernel"] for c in found
        )
    assert sum(c["expected"] for c in found) == sum(c["kernel"] > 0 for c in found)
    bad = wrong(found)
    assert not bad, f"{len(bad)} cells, e.g. {bad[:3]}"


def test_no_kernel_cell_has_a_bias_native_lacks(results):
    """The rule's bias criterion over the whole table: in every cell where a
    kernel ran, on every output (the residual written back too), its bias is
    no larger than native's plus the margin; and the table had such cells."""
    ran = [
        (run, c["cell"], output)
        for run, found in results.items()
        for c in found["table"]["cells"]
        if c["kernel"] > 0
        for output in c["bias"]
    ]
    assert ran, "no cell ran a kernel: the bias criterion checked nothing"
    biased = [r for r in ran if not bias_matches(r[2])]
    assert not biased, f"{len(biased)} of {len(ran)}, e.g. {biased[:3]}"
    measured = [
        c for f in results.values() for c in f["table"]["cells"] if c["bias"]
    ]
    assert len(measured) >= len(RUNS) * CELLS // 2


@pytest.mark.parametrize("run", RUNS, ids=IDS)
@pytest.mark.parametrize("mode", MODES[1:])
def test_every_compiled_cell(results, run, mode):
    graph = results[run]["table"]["graphs"][mode]
    assert graph["raised"] is None, graph["raised"]
    assert graph["cells"] + graph["native_raised"] == CELLS
    assert graph["calls"] == graph["expected"]
    assert graph["excess"] == 0.0


@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_the_residual_stream_keeps_its_norm(results, run):
    found = results[run]["drift"]
    assert abs(found["ratio"] - 1) < 0.01, found


def test_each_build_and_layout_ran_as_asked(results):
    """Each child loaded the build asked for (vLLM's pick: the newest class
    this CPU runs) and ran at the OpenMP team asked for."""
    from vllm_patch.runtime.cpu_library import LIBRARIES

    newest = cpu_library.runnable(machine.cpu()["flags"])[0]
    assert len(results) == len(RUNS)
    for (_, library, threads), found in results.items():
        assert found["drift"]["build"] == [LIBRARIES[library or newest]]
        assert found["threads"]["openmp"] == threads


def test_the_table_is_recorded(results, record_testsuite_property):
    """Per build, thread layout, form and dtype the eager cells that ran a
    kernel, ran native, or went wrong; the kernels' bias called directly;
    per compiled mode the graph's kernel calls against the rule's; the
    residual stream; and where it ran."""
    import json

    from vllm.version import __version__

    tables = [
        {
            "build": results["provider", library, threads]["drift"]["build"],
            "forced": library is not None,
            "threads": threads,
            "cpus": results["provider", library, threads]["threads"]["cpus"],
            "probe": results["provider", library, threads]["probe"],
            "forms": {
                form: summary(results[form, library, threads]) for form in FORMS
            },
        }
        for library, threads in LAYOUTS
    ]
    machine_is = "{cpu_model} ({arch}), {usable_cpus} CPUs".format(
        **machine.facts()
    )
    doc = {"machine": machine_is, "vllm": __version__, "tables": tables}
    doc["dimensions"] = {name: list(values) for name, values in DIMENSIONS.items()}
    record_testsuite_property("conformance", json.dumps(doc))
    assert len(tables) == len(LAYOUTS)
    for table in tables:
        assert set(table["probe"]) == set(DTYPES)
        for form in table["forms"].values():
            counted = [c["kernel"] + c["native"] for c in form["eager"].values()]
            assert counted == [CELLS // len(DTYPES)] * len(DTYPES)


def test_the_plus_rms_norm_graph_runs_the_kernels(results):
    """Not a vacuous compiled table: at one thread, with ``+rms_norm`` the
    CustomOp form's graph calls both kernels (float32 at least, every build)."""
    checked = [
        found["table"]["graphs"]["plus_rms_norm"]["expected"]
        for (form, _, threads), found in results.items()
        if form != "ir" and threads == 1
    ]
    assert len(checked) == 2 * len(BUILDS)
    for expected in checked:
        assert sorted(expected) == sorted(KERNELS) and all(expected.values()), (
            expected
        )
