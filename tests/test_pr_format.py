"""The formatter and spell checker versions a vLLM checkout pins, as its
``.pre-commit-config.yaml`` writes them: a tag, or (``pre-commit autoupdate
--freeze``, vLLM 0.34 on) a commit with its ``# frozen:`` tag."""

from __future__ import annotations

import pytest

from vllm_patch.upstream.pr_format import PRE_COMMIT, pinned_version

RUFF = "https://github.com/astral-sh/ruff-pre-commit"


@pytest.mark.parametrize(
    ("rev", "pinned"),
    [
        pytest.param("v0.14.0", "0.14.0", id="a tag (vLLM 0.33)"),
        pytest.param("0.14.0", "0.14.0", id="a version"),
        pytest.param(
            "f368fb366ff7f2f808dd324b83a6d32267799e19  # frozen: v0.17.2",
            "0.17.2",
            id="a frozen commit (vLLM 0.34)",
        ),
        pytest.param(
            "f368fb366ff7f2f808dd324b83a6d32267799e19", None, id="a bare commit"
        ),
        pytest.param("main  # frozen: --index-url=x", "main", id="not a version"),
    ],
)
def test_the_pinned_version_is_read_from_the_hook(tmp_path, rev, pinned):
    (tmp_path / PRE_COMMIT).write_text(f"repos:\n- repo: {RUFF}\n  rev: {rev}\n")
    assert pinned_version(tmp_path, "astral-sh/ruff-pre-commit") == pinned
