"""Both forms of the change and the provider against the rule (``cpu_norm_rule.py``),
on the installed vLLM: every cell of dtype {float32, bfloat16, float16} x
hidden size {8, 12, 2048, 4100} x layout {contiguous, a q/k norm's strided
view, 3-D} x residual {none, same dtype, another dtype} x weight {weight, none,
variance size override}, eager, compiled (``custom_ops: ["none"]``) and
compiled with ``+rms_norm`` (one ``torch.compile(fullgraph=True)`` graph of
every cell native takes per mode). In every cell the kernel ran exactly where
the rule says (torch's profiler counts ``_C::`` events), its output is within
vLLM IR's tolerance for the dtype (``get_tolerance``) of native, and nothing
raises that native does not. The residual stream after 64 bfloat16 fused adds
keeps its norm within 1% of exact. All of it on every x86 kernel build this
CPU runs: vLLM's pick, then each older CPU class's build, forced as a CPU of
that class gets it (``cpu_library.force``: vLLM and the rule both see that
class).

Each form runs in its own child (``conformance_table.py``): the CustomOp form
and the IR form on a patched copy, the provider opted in on the installed
vLLM. Expectations come from the rule, so the table holds on any build.
``nox -s conformance`` keeps the table's summary (``conformance``, a test-suite
property of its JUnit XML) in ``compat_matrix/results/``, for MATRIX.md."""

from __future__ import annotations

import pytest

from patcher.patchset import select
from patcher.tree import open_tree
from patches.cpu_fused_norms.identity import OPT_IN_ENV
from tests.conformance_table import DIMENSIONS, DTYPES, cells, summary, wrong
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
        "tests.conformance_table:everything",
        {"form": form, **kwargs},
        pythonpath=[copy_of] if copy_of else [],
        env={OPT_IN_ENV: "1"} if provider else {"VLLM_PLUGINS": "none"},
        drop_env=["VLLM_PLUGINS"] if provider else [OPT_IN_ENV],
        timeout=1800,
    )


BUILDS = [None, *cpu_library.runnable(machine.cpu()["flags"])[1:]]
"""vLLM's own pick (None), then each older x86 CPU class's build, forced as a
CPU of that class gets it: every x86 kernel build this CPU runs."""
RUNS = [(form, library) for library in BUILDS for form in FORMS]
IDS = [f"{form}-{library or 'own build'}" for form, library in RUNS]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every form's table on every build, the three forms' children side by
    side, one build after the other."""
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
        for library in BUILDS:
            started = {
                (form, library): _start(
                    form, copy, modes=MODES, backend=BACKEND, library=library
                )
                for form, copy in copies.items()
            }
            out |= {key: child.finish(c).value() for key, c in started.items()}
    return out


@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_every_eager_cell(results, run):
    cells = results[run]["table"]["cells"]
    assert len(cells) == 324
    assert any(c["kernel"] for c in cells) and not all(c["kernel"] for c in cells)
    bad = wrong(cells)
    assert not bad, f"{len(bad)} cells, e.g. {bad[:3]}"


@pytest.mark.parametrize("run", RUNS, ids=IDS)
@pytest.mark.parametrize("mode", MODES[1:])
def test_every_compiled_cell(results, run, mode):
    graph = results[run]["table"]["graphs"][mode]
    assert graph["raised"] is None, graph["raised"]
    assert graph["cells"] + graph["native_raised"] == len(cells())
    assert graph["calls"] == graph["expected"]
    assert graph["excess"] == 0.0


@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_the_residual_stream_keeps_its_norm(results, run):
    found = results[run]["drift"]
    assert abs(found["ratio"] - 1) < 0.01, found


def test_each_build_ran_as_asked(results):
    """vLLM's pick, then each forced build: the one the child loaded."""
    from vllm_patch.runtime.cpu_library import LIBRARIES

    for (_, library), found in results.items():
        if library:
            assert found["drift"]["build"] == [LIBRARIES[library]]


def test_the_table_is_recorded(results, record_testsuite_property):
    """Per build, form and dtype the eager cells that ran a kernel, ran
    native, or went wrong; per compiled mode the graph's kernel calls against
    the rule's; the residual stream; and where it ran."""
    import json

    from vllm.version import __version__

    tables = [
        {
            "build": results["provider", library]["drift"]["build"],
            "forced": library is not None,
            "forms": {form: summary(results[form, library]) for form in FORMS},
        }
        for library in BUILDS
    ]
    machine_is = "{cpu_model} ({arch}), {usable_cpus} CPUs".format(**machine.facts())
    doc = {"machine": machine_is, "vllm": __version__, "tables": tables}
    doc["dimensions"] = {name: list(values) for name, values in DIMENSIONS.items()}
    record_testsuite_property("conformance", json.dumps(doc))
    for table in tables:
        for form in table["forms"].values():
            counted = [c["kernel"] + c["native"] for c in form["eager"].values()]
            assert counted == [108] * len(DTYPES)


def test_the_plus_rms_norm_graph_runs_the_kernels(results):
    """Not a vacuous compiled table: with ``+rms_norm`` the CustomOp form's
    graph calls both kernels (float32 at least, on every build)."""
    for (form, _), found in results.items():
        if form != "ir":
            expected = found["table"]["graphs"]["plus_rms_norm"]["expected"]
            assert all(expected.values()), expected
