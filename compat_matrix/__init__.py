"""Which vLLM versions the carried patch and the out-of-tree provider work with.

``python -m compat_matrix.probe`` checks one environment (the interpreter that
runs it) and prints a JSON document; the matrix is built from those documents.
"""
