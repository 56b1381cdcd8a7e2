"""The upstream change itself, live: the chosen form applied to a hard-linked
copy of the installed vLLM, imported by a fresh interpreter without plugins:
the CPU kernels called eager, none compiling; the copy reverted to its bytes
and the installed vLLM untouched."""


def test_patched_eager_calls_kernels(patched):
    eager = patched()["counts"]["eager"]
    assert eager["calls"]["_C::rms_norm"] >= 1, eager
    assert eager["rtol_needed"] <= 2.5e-2, eager


def test_patched_compiled_calls_no_kernel(patched):
    compiled = patched()["counts"]["compiled"]
    assert not any(compiled["calls"].values()), compiled


def test_patched_copy_reverts(patched):
    record = patched()
    assert record["restored"], record["hashes"]
    assert record["original_unchanged"], record["hashes"]
