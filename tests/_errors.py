"""Checking the ops' argument errors: the error type, the op, and the argument named.

The compiled ops (csrc/validate.h, the authority) and the fake kernels and
fallback (apex_amp/_fallback.py) word their messages independently, so tests
check what every message must carry, not its words.
"""

from __future__ import annotations

import re

import pytest


def raises_naming(op: str, argument: str):
    """pytest.raises for a RuntimeError of ``apex_amp.<op>`` whose message names ``argument``
    (for example ``grads[1]`` or ``found_inf``) as a whole word."""
    pattern = rf"^apex_amp\.{re.escape(op)}: (.*\W)?{re.escape(argument)}(\W|$)"
    return pytest.raises(RuntimeError, match=pattern)
