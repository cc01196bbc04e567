"""The fused ops' masters and states in fp32, and their write-back: the pure-PyTorch side of the state formats.

A fused op's fallback reads its masters and per-element states through :class:`StepOperands`
and runs its fp32 rule on them, unchanged; the write-back stores the results in each tensor's
own format. That is the contract of the kernels (csrc/state_formats.h), stated with
:mod:`.state_formats`' reference functions:

* the fp32 master of params[i] is params[i] itself (fp32), or ``join_master(params[i],
  master_remainders[i])`` (a bf16 weight with its int16 remainder), or, for fp16/bf16 params
  without a master, their value in fp32;
* each state is ``dequantize(state, absmax)``: fp32 and bf16 states are read as they are,
  fp8/int8/uint8 ones with their absmax (``state_absmaxes[k * len(params) + i]`` for state
  list k, one fp32 value per block of ``state.numel() // absmax.numel()`` elements);
* after the rule, each state is ``quantize(value, state.dtype, B)`` (codes and absmax), and the
  master is written back (``split_master`` for a remainder, a rounding for half params);
* with ``state_rounding`` (the ops' optional (params, 2) int64 rows: stream key, index of the
  first element in the whole parameter), a bf16 state of an fp32 or remainder master is
  ``round_bf16_stochastic(value, key, k, offset)`` instead of rounded to nearest even.

Tensors in the dtype of their params without a remainder are read and written exactly as
before state formats existed, so those steps are bitwise unchanged.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from .._checks import BLOCKED_STATE_DTYPES
from .._fallback import as_fp32, commit, shaped_like
from .state_formats import dequantize, join_master, quantize, round_bf16_stochastic, split_master

__all__ = ["StepOperands"]


class StepOperands:
    """The fp32 masters and states of one fused step (a fallback's view), and their write-back.

    Args:
        params: the op's params (fp32 masters, bf16 weights with remainders, or fp16/bf16 params).
        states: the per-element state lists in the op's order (Adam: exp_avgs, exp_avg_sqs).
        remainders: the op's master_remainders ([] or one per param).
        absmaxes: the op's state_absmaxes ([] or one per state and param, state-list-major).
        rounding: the op's state_rounding (None: bf16 states round to nearest even).

    Example::

        >>> operands = StepOperands(params, [exp_avgs], [], absmaxes)
        >>> new_master, new_avg = rule(operands.masters, operands.states[0])
        >>> operands.write_states(0, new_avg, taken=True)
        >>> operands.write_masters(new_master, taken=True)
    """

    def __init__(self, params: Sequence[Tensor], states: Sequence[Sequence[Tensor]], remainders: Sequence[Tensor],
                 absmaxes: Sequence[Tensor], rounding: Tensor | None = None) -> None:
        self.params = list(params)
        self.rounding = rounding
        self.remainders = list(remainders)
        # Each state list as views shaped like the params (paired element by element in memory order).
        self.stored = [shaped_like(list(state), self.params) for state in states]
        count = len(self.params)
        self.absmaxes = [list(absmaxes[k * count:(k + 1) * count]) if absmaxes else [None] * count
                         for k in range(len(self.stored))]
        if self.remainders:
            self.masters = [join_master(p, r) for p, r in zip(self.params, self.remainders)]
        else:
            self.masters = as_fp32(self.params)
        self.states = [[self._read(state, absmax) for state, absmax in zip(stored, absmaxes_k)]
                       for stored, absmaxes_k in zip(self.stored, self.absmaxes)]

    @staticmethod
    def _read(state: Tensor, absmax: Tensor | None) -> Tensor:
        if state.dtype in BLOCKED_STATE_DTYPES and state.numel() > 0:
            return dequantize(state, absmax)
        return state.float()  # (an empty blocked state has no block to read)

    def keeps_legacy_state(self, k: int, i: int) -> bool:
        """Whether state k of param i is stored in its params' dtype with no master (fp16/bf16 params,
        or fp32 state of fp32 params): the rules that re-read stored states round to it (LAMB)."""
        return not self.remainders and self.stored[k][i].dtype == self.params[i].dtype

    def as_stored(self, k: int, i: int, value: Tensor) -> Tensor:
        """``value`` (state k of param i, fp32) as a later pass of the same step reads it: rounded to a
        legacy state's dtype (LAMB's rule for half params), else as computed (formats are quantized
        only when written: the kernels keep the fp32 value for the rest of the step)."""
        if self.keeps_legacy_state(k, i):
            return value.to(self.stored[k][i].dtype).float()
        return value

    def write_states(self, k: int, values: Sequence[Tensor], taken: Union[bool, Tensor]) -> None:
        """Store the fp32 ``values`` of state list k, each in its format (codes and absmax)."""
        plain, plain_values = [], []
        for i, (state, value) in enumerate(zip(self.stored[k], values)):
            if self._rounds_stochastically(k, i):
                laid_out = torch.empty_like(state, dtype=torch.float32).copy_(value)  # the state's memory order
                rounded = round_bf16_stochastic(laid_out, self.rounding[i, 0], k, self.rounding[i, 1])
                commit([state], [rounded], taken)
                continue
            if state.dtype not in BLOCKED_STATE_DTYPES:
                plain.append(state)
                plain_values.append(value)
                continue
            absmax = self.absmaxes[k][i]
            if absmax.numel() == 0:
                continue  # an empty state: no block, nothing to write
            codes, new_absmax = quantize(value.float(), state.dtype, state.numel() // absmax.numel())
            commit([state, absmax.view(-1)], [codes, new_absmax.reshape(-1)], taken)
        commit(plain, plain_values, taken)

    def _rounds_stochastically(self, k: int, i: int) -> bool:
        # A bf16 state in a format (of an fp32 or remainder master), with the op's rounding rows.
        return (self.rounding is not None and self.stored[k][i].dtype == torch.bfloat16
                and not self.keeps_legacy_state(k, i))

    def write_masters(self, values: Sequence[Tensor], taken: Union[bool, Tensor],
                      model_params: Sequence[Tensor] = ()) -> None:
        """Store the updated fp32 masters: params (split into weight and remainder, or rounded to the
        params' dtype) and the model copy."""
        if self.remainders:
            pairs = [split_master(value) for value in values]
            commit(self.params, [weight for weight, _ in pairs], taken)
            commit(self.remainders, [remainder for _, remainder in pairs], taken)
        else:
            commit(self.params, list(values), taken)
        commit(list(model_params), list(values), taken)
