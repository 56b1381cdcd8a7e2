"""Static checks, on the installed vLLM or a wheel: which mechanism the release
has, which form of the change the engine picks for it, and whether that form
applies (the engine's dry run)."""

from patcher.patchset import all_patches


def test_form_fits_mechanism(mechanism, form):
    """The IR form where IR is vLLM's current mechanism; the CustomOp form (the
    patch that ``replaces`` it) where IR is deprecated or absent."""
    customop = next(p for p in all_patches() if "replaces" in p.meta)
    want = customop.meta["replaces"] if mechanism == "IR" else customop.name
    assert form == want, f"{mechanism}: the engine picks {form}, not {want}"


def test_form_applies(check_report, form):
    """A plain ``vllm-patch check`` judges the chosen form applicable (or
    already applied), with no error."""
    assert form, f"no carried patch applies: {check_report}"
    entry = next(r for r in check_report if r["patch"] == form)
    assert entry["error"] is None, entry["error"]
