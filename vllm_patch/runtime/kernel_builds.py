"""vLLM's x86 CPU kernel builds: which library vLLM loads for which CPU class,
and which builds a CPU runs (no torch, no vLLM)."""

# Each CPU class, newest first: the library vLLM loads for it, the CPU flag
# (``/proc/cpuinfo``) that library needs, the torch check that says it runs.
LIBRARIES = {"avx512_bf16": "_C", "avx512": "_C_AVX512", "avx2": "_C_AVX2"}
NEEDS = {"avx512_bf16": "avx512_bf16", "avx512": "avx512f", "avx2": "avx2"}
CHECKS = {
    "avx512_bf16": "_is_avx512_bf16_supported",
    "avx512": "_is_avx512_supported",
}
# AMX comes only with the newest class (Sapphire Rapids on), and vLLM's AMX
# paths call kernels only the _C build has (0.32.0's linear layers pack their
# weights with torch.ops._C.convert_weight_packed): a CPU made to look older
# must say no to these torch checks too.
NEWEST_CLASS_ONLY = ("_is_amx_tile_supported", "_is_amx_fp16_supported")


def runnable(flags: list[str]) -> list[str]:
    """The classes whose builds a CPU with ``flags`` runs, newest first."""
    return [c for c in LIBRARIES if NEEDS[c] in flags]
