"""Which vLLM releases the carried change and the out-of-tree provider work with.

``nox -s compat`` runs ``checks/`` (pytest tests) in one environment per release
listed in ``versions.json`` and writes ``results/<package>-<version>.xml``;
``report`` (``nox -s matrix``) builds MATRIX.md and matrix.json from them. The
repository's tool: not installed with the project.
"""
