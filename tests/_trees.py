"""Exact comparison of nested state (state dicts, checkpoints, snapshots) for the frontend tests."""

from __future__ import annotations

import torch


def assert_same(a, b, path: str = "state") -> None:
    """Assert that two nests of dicts, lists, tuples, tensors and plain values are identical:
    same keys and lengths, tensors of the same dtype and bitwise-equal values (NaN matches NaN)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        if a.is_floating_point():  # NaN where the other has NaN, equal values everywhere else
            nan = a.isnan()
            assert torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]), path
        else:
            assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path
