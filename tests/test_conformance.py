"""Both forms of the change and the provider against the rule (``rule.py``),
on the installed vLLM: every cell of dtype {float32, bfloat16, float16} x
hidden size {8, 12, 2048, 4100} x layout {contiguous, a q/k norm's strided
view, 3-D} x residual {none, same dtype, another dtype} x weight {weight, none,
variance size override}, eager, compiled (``custom_ops: ["none"]``) and
compiled with ``+rms_norm`` (one ``torch.compile(fullgraph=True)`` graph of
every cell native takes per mode). In every cell the kernel ran exactly where
the rule says (torch's profiler counts ``_C::`` events), its output is within
vLLM IR's tolerance for the dtype (``get_tolerance``) of native, and nothing
raises that native does not. The residual stream after 64 bfloat16 fused adds
keeps its norm within 1% of exact on every kernel build this CPU loads.

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
from tests.conformance_table import DTYPES, cells
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


def _start(form: str, copy_of=None, target="everything", **kwargs):
    """The provider with every plugin and the opt-in; a form with no plugin."""
    provider = form == "provider"
    return child.start(
        f"tests.conformance_table:{target}",
        {"form": form, **kwargs},
        pythonpath=[copy_of] if copy_of else [],
        env={OPT_IN_ENV: "1"} if provider else {"VLLM_PLUGINS": "none"},
        drop_env=["VLLM_PLUGINS"] if provider else [OPT_IN_ENV],
        timeout=1800,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every form's table, the three children running side by side, and the
    residual stream through the provider on each other x86 build this CPU
    loads (vLLM's pick is in each table's child)."""
    import contextlib

    from vllm_patch.runtime.patched_copy import patched_copy

    started = {}
    with contextlib.ExitStack() as stack:
        for form, patch in FORMS.items():
            copy = None
            if patch:
                copy = stack.enter_context(
                    patched_copy(
                        open_tree(None),
                        select([patch])[0],
                        parent=tmp_path_factory.mktemp(form),
                    )
                )
            started[form] = _start(form, copy, modes=MODES, backend=BACKEND)
        others = [
            _start("provider", target="drift", library=library)
            for library in cpu_library.runnable(machine.cpu()["flags"])[1:]
        ]
        out = {form: child.finish(c).value() for form, c in started.items()}
        for running in others:
            out["provider"]["drift"].append(child.finish(running).value())
    return out


def _wrong(cells):
    return [
        c
        for c in cells
        if c["raised"] or c["excess"] > 0 or (c["kernel"] > 0) != c["expected"]
    ]


@pytest.mark.parametrize("form", FORMS)
def test_every_eager_cell(results, form):
    cells = results[form]["table"]["cells"]
    assert len(cells) == 324
    assert any(c["kernel"] for c in cells) and not all(c["kernel"] for c in cells)
    wrong = _wrong(cells)
    assert not wrong, f"{len(wrong)} cells, e.g. {wrong[:3]}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mode", MODES[1:])
def test_every_compiled_cell(results, form, mode):
    graph = results[form]["table"]["graphs"][mode]
    assert graph["raised"] is None, graph["raised"]
    assert graph["cells"] + graph["native_raised"] == len(cells())
    assert graph["calls"] == graph["expected"]
    assert graph["excess"] == 0.0


@pytest.mark.parametrize("form", FORMS)
def test_the_residual_stream_keeps_its_norm(results, form):
    for found in results[form]["drift"]:
        assert abs(found["ratio"] - 1) < 0.01, found


def test_the_table_is_recorded(results, record_testsuite_property):
    """Per form and dtype the eager cells that ran a kernel, ran native, or
    went wrong; per form and compiled mode the graph's kernel calls against
    the rule's; the residual stream per build; and where it ran."""
    import json

    from vllm.version import __version__

    summary = {
        "machine": "{cpu_model} ({arch}), {usable_cpus} CPUs".format(**machine.facts()),
        "build": results["provider"]["drift"][0]["build"],
        "vllm": __version__,
        "forms": {
            form: {
                "eager": {
                    dtype: _counts(
                        [c for c in found["table"]["cells"] if c["cell"][0] == dtype]
                    )
                    for dtype in DTYPES
                },
                "graphs": found["table"]["graphs"],
                "drift": found["drift"],
            }
            for form, found in results.items()
        },
    }
    record_testsuite_property("conformance", json.dumps(summary))
    for form in summary["forms"].values():
        assert [c["kernel"] + c["native"] for c in form["eager"].values()] == [
            108
        ] * len(DTYPES)


def _counts(cells: list[dict]) -> dict[str, int]:
    return {
        "kernel": sum(c["kernel"] > 0 for c in cells),
        "native": sum(c["kernel"] == 0 for c in cells),
        "wrong": len(_wrong(cells)),
    }


def test_the_plus_rms_norm_graph_runs_the_kernels(results):
    """Not a vacuous compiled table: with ``+rms_norm`` the CustomOp form's
    graph calls both kernels (float32 at least, on every build)."""
    for form in ("custom_op", "provider"):
        expected = results[form]["table"]["graphs"]["plus_rms_norm"]["expected"]
        assert all(expected.values()), expected
