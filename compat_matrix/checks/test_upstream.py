"""The upstream change, live, on a patched copy of the installed vLLM imported
without plugins: the CPU kernels called eager, none compiling; the copy
reverted to its bytes and the installed vLLM untouched."""

from calls import BF16_RTOL


def test_patched_eager_calls_what_the_rule_says(patched):
    eager = patched()["counts"]["eager"]
    assert not eager["unexpected"], eager["described"]
    rtol = eager["rtol_needed"]
    assert rtol <= BF16_RTOL, f"rtol {rtol:.3g} needed against native"


def test_patched_compiled_calls_no_kernel(patched):
    compiled = patched()["counts"]["compiled"]
    assert not compiled["unexpected"], compiled["described"]


def test_patched_copy_reverts(patched):
    record = patched()
    assert record["restored"], record["hashes"]
    assert record["original_unchanged"], record["hashes"]
