"""The kernels' state-format tables (csrc/state_formats.h) against the reference (state_formats.py)."""

from __future__ import annotations

import pytest
import torch

from apex_amp._extension import STATUS
from apex_amp.optimizers.state_formats import dynamic_map

pytestmark = pytest.mark.skipif(not STATUS.loaded, reason="needs the compiled extension")


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_kernels_build_the_dynamic_maps_of_the_reference_bit_for_bit(signed):
    built = torch.tensor(STATUS.module.state_format_map(signed), dtype=torch.float32)
    assert torch.equal(built.view(torch.int32), dynamic_map(signed).view(torch.int32))


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_kernels_search_the_fp32_midpoints_of_the_reference(signed):
    table = dynamic_map(signed)
    midpoints = torch.tensor(STATUS.module.state_format_midpoints(signed), dtype=torch.float32)
    assert torch.equal(midpoints.view(torch.int32), ((table[:-1] + table[1:]) * 0.5).view(torch.int32))
