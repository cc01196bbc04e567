"""apex_amp._dtypes.map_tensors: the one walk over nested arguments (model inputs/outputs, O1 op arguments)."""

from __future__ import annotations

import collections

import torch

from apex_amp import amp
from apex_amp._dtypes import map_tensors

Pair = collections.namedtuple("Pair", "first second")


def to_half(t):
    return t.half() if t.is_floating_point() else t


def test_tensors_inside_lists_tuples_namedtuples_and_dicts_are_mapped_and_the_containers_kept():
    value = {"pair": Pair(torch.ones(2), 3), "list": [torch.zeros(1), "text", (torch.ones(1),)],
             "ordered": collections.OrderedDict(x=torch.ones(1))}
    mapped = map_tensors(value, to_half)
    assert type(mapped["pair"]) is Pair and mapped["pair"].first.dtype == torch.float16 and mapped["pair"].second == 3
    assert mapped["list"][0].dtype == torch.float16 and mapped["list"][1] == "text"
    assert mapped["list"][2][0].dtype == torch.float16
    assert type(mapped["ordered"]) is collections.OrderedDict and mapped["ordered"]["x"].dtype == torch.float16
    assert value["pair"].first.dtype == torch.float32  # the input is not changed


def test_torch_return_types_keep_their_type():
    result = torch.max(torch.arange(6.0).reshape(2, 3), dim=1)
    mapped = map_tensors(result, to_half)
    assert type(mapped) is type(result) and mapped.values.dtype == torch.float16


def test_containers_without_a_changed_tensor_are_returned_as_the_same_object():
    sizes = torch.Size([2, 3])
    assert map_tensors(sizes, to_half) is sizes
    ints = [1, (2, 3), {"k": torch.arange(3)}]  # an integer tensor: to_half leaves it alone
    assert map_tensors(ints, to_half) is ints


def test_a_dict_subclass_with_another_constructor_becomes_a_dict():
    value = collections.defaultdict(list, x=torch.ones(1))
    mapped = map_tensors(value, to_half)
    assert type(mapped) is dict and mapped["x"].dtype == torch.float16


def test_o2_model_outputs_in_a_namedtuple_come_back_fp32_in_the_same_namedtuple():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, x):
            out = self.linear(x)
            return Pair(out, out.sum())

    model = TwoHeads()
    model = amp.initialize(model, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    out = model(torch.randn(4, 3))
    assert type(out) is Pair and out.first.dtype == out.second.dtype == torch.float32
    assert model.linear.weight.dtype == torch.bfloat16
