"""The Example:: blocks of apex_amp.ops are real doctests: they must keep printing what they show."""

import doctest

import apex_amp.ops


def test_ops_examples_run_and_print_what_they_show():
    result = doctest.testmod(apex_amp.ops, optionflags=doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.attempted > 40, "the op docstrings lost their examples"
    assert result.failed == 0, f"{result.failed} docstring example lines in apex_amp/ops.py print something else"
