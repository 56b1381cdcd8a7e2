"""A sentence added to a docstring, and taken out again byte for byte."""

from __future__ import annotations

import pytest

from patcher.docstrings import with_sentence, without_sentence

SENTENCE = "On CPU, x must also be contiguous."
LONG = '"""vLLM kernel requires no variance_size override and matching input/weight dtype."""'


@pytest.mark.parametrize(
    "literal,column,indent,expected",
    [
        ('"""Short."""', 0, "", f'"""Short. {SENTENCE}"""'),
        (LONG, 0, "", f"{LONG[:-3]}\n{SENTENCE}" + '"""'),
        (
            '"""Does not\nfit."""',
            0,
            "",
            f'"""Does not\nfit. {SENTENCE}"""',
        ),
        (
            '"""No variance_size override, and a weight of the input\'s dtype."""',
            4,
            "    ",
            '"""No variance_size override, and a weight of the input\'s dtype.\n'
            f'    {SENTENCE}"""',
        ),
    ],
    ids=["fits its line", "a line of its own", "multi-line", "in a def, indented"],
)
def test_a_sentence_goes_where_it_fits_and_comes_out_again(
    literal, column, indent, expected
) -> None:
    added = with_sentence(literal, SENTENCE, column, indent)
    assert added == expected
    assert all(len(line) + column <= 88 for line in added.splitlines()[:1])
    assert all(len(line) <= 88 for line in added.splitlines()[1:])
    assert without_sentence(added, SENTENCE) == literal


@pytest.mark.parametrize(
    "literal", ['r"""Raw."""', '"Single quoted."', '"""Other text."""']
)
def test_other_strings_are_left_alone(literal) -> None:
    assert without_sentence(literal, SENTENCE) is None
    if not literal.startswith('"""'):
        assert with_sentence(literal, SENTENCE, 0, "") is None
