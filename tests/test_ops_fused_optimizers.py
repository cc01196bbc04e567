"""fused_sgd_, fused_adagrad_, fused_novograd_ and fused_lamb_ against apex's math, on both backends.

The reference (tests/_optimizer_reference.py) is written from apex's kernels in float64; the
ops run in fp32. Each case runs several steps over lists of sizes 0, 1, odd and more than one
CPU work unit (16384 elements), then checks dtypes and model copies, unscaling, the skip on
found_inf, layouts and non-finite gradients. fused_adam_ has its own file (test_ops_adam.py).
LAMB's two passes as ops of their own (fused_lamb_moments_, fused_lamb_update_) and NovoGrad with
given gradient norms run every case too, and on tensors split by rows as FSDP2 shards them, with
the per-tensor values combined over the shards, they step as the whole tensors do.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import _optimizer_reference as oref
import _reference as ref
from _errors import raises_naming

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
SIZES = (1, 33, 0, 1031, 16384 + 77)
STEPS = 4
# fp32 kernels against a float64 reference over a few steps.
TOLERANCE = {"rtol": 2e-5, "atol": 2e-6}


class Harness:
    """One op's tensors (params, per-element state, model copy, step) and its float64 reference."""

    op = ""
    state_names: tuple[str, ...] = ()
    counts_steps = False

    def __init__(self, params: list[torch.Tensor], options: dict[str, Any], model_dtype=None):
        self.options = options
        self.params = params
        self.states = {name: [torch.zeros_like(p) for p in params] for name in self.state_names}
        self.model_params = [] if model_dtype is None else [p.to(model_dtype) for p in params]
        self.step = torch.zeros(1, device=params[0].device)
        self.ref_params = oref.f64(params)
        self.ref_states = {name: oref.f64(lists) for name, lists in self.states.items()}
        self.steps_taken = 0

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params, *(t for lists in self.states.values() for t in lists), *self.model_params, self.step]

    def call(self, amp_ops, grads, inv_scale=None, found_inf=None) -> None:
        raise NotImplementedError

    def reference(self, grads) -> None:
        raise NotImplementedError

    def run(self, amp_ops, grads, inv_scale=None, found_inf=None) -> None:
        self.call(amp_ops, grads, None if inv_scale is None else ref.flag(inv_scale),
                  None if found_inf is None else ref.flag(found_inf))

    def step_both(self, amp_ops, grads, grad_scale=1.0) -> None:
        scaled = [g * grad_scale for g in grads]
        self.run(amp_ops, scaled, inv_scale=None if grad_scale == 1.0 else 1.0 / grad_scale)
        self.steps_taken += 1
        self.reference(grads)

    def assert_matches_reference(self, tolerance=TOLERANCE) -> None:
        for got, want in zip(self.params, self.ref_params):
            torch.testing.assert_close(got.double(), want, **tolerance)
        for name in self.state_names:
            for got, want in zip(self.states[name], self.ref_states[name]):
                torch.testing.assert_close(got.double(), want, **tolerance)
        for model, param in zip(self.model_params, self.params):
            assert torch.equal(model, param.to(model.dtype))
        if self.counts_steps:
            assert self.step.item() == self.steps_taken


class Sgd(Harness):
    op = "fused_sgd_"

    def __init__(self, params, options, model_dtype=None):
        self.state_names = ("momentum_buffers",) if options["momentum"] != 0 else ()
        super().__init__(params, options, model_dtype)

    def call(self, amp_ops, grads, inv_scale=None, found_inf=None):
        o = self.options
        amp_ops.fused_sgd_(self.params, grads, self.states.get("momentum_buffers", []), self.model_params, [], [],
                           o["lr"], o["momentum"], o["dampening"], o["weight_decay"], o["nesterov"],
                           self.steps_taken == 0, o["wd_after_momentum"], inv_scale, found_inf)

    def reference(self, grads):
        buffers = self.ref_states.get("momentum_buffers", [None] * len(grads))
        oref.sgd(self.ref_params, grads, buffers, first_run=self.steps_taken == 1, **self.options)


class Adagrad(Harness):
    op = "fused_adagrad_"
    state_names = ("state_sums",)

    def call(self, amp_ops, grads, inv_scale=None, found_inf=None):
        o = self.options
        amp_ops.fused_adagrad_(self.params, grads, self.states["state_sums"], self.model_params, [], [], o["lr"],
                               o["eps"], o["weight_decay"], o["adagrad_w_mode"], inv_scale, found_inf)

    def reference(self, grads):
        oref.adagrad(self.ref_params, grads, self.ref_states["state_sums"], **self.options)


class NovoGrad(Harness):
    op = "fused_novograd_"
    state_names = ("exp_avgs",)
    counts_steps = True

    def __init__(self, params, options, model_dtype=None):
        super().__init__(params, options, model_dtype)
        self.moments = [torch.full((1,), -1.0, device=p.device) for p in params]
        self.ref_moments = [None] * len(params)

    def tensors(self):
        return [*super().tensors(), *self.moments]

    def call(self, amp_ops, grads, inv_scale=None, found_inf=None):
        o = self.options
        amp_ops.fused_novograd_(self.params, grads, self.states["exp_avgs"], self.moments, self.model_params, [], [],
                                self.step, o["lr"], o["beta1"], o["beta2"], o["eps"], o["weight_decay"],
                                o["bias_correction"], o["grad_averaging"], o["reg_inside_moment"], o["norm_type"],
                                inv_scale, found_inf)

    def reference(self, grads):
        oref.novograd(self.ref_params, grads, self.ref_states["exp_avgs"], self.ref_moments, self.steps_taken,
                      **self.options)

    def assert_matches_reference(self, tolerance=TOLERANCE):
        super().assert_matches_reference(tolerance)
        for got, want in zip(self.moments, self.ref_moments):
            assert got.item() == pytest.approx(want, rel=2e-6, abs=1e-30)


class Lamb(Harness):
    op = "fused_lamb_"
    state_names = ("exp_avgs", "exp_avg_sqs")
    counts_steps = True

    def call(self, amp_ops, grads, inv_scale=None, found_inf=None):
        o = self.options
        # The optimizer hands the op the norm of the gradients as they are (still scaled).
        grad_norm = ref.flag(ref.l2norm(grads)[0], self.params[0].device)
        amp_ops.fused_lamb_(self.params, grads, self.states["exp_avgs"], self.states["exp_avg_sqs"],
                            self.model_params, [], [], self.step, grad_norm, o["lr"], o["beta1"], o["beta2"], o["eps"],
                            o["weight_decay"], o["bias_correction"], o["grad_averaging"], o["adam_w_mode"],
                            o["max_grad_norm"], o["use_nvlamb"], inv_scale, found_inf)

    def reference(self, grads):
        state_dtype = None if self.params[0].dtype == F32 else self.params[0].dtype
        oref.lamb(self.ref_params, grads, self.ref_states["exp_avgs"], self.ref_states["exp_avg_sqs"],
                  self.steps_taken, state_dtype=state_dtype, **self.options)


class LambPasses(Lamb):
    """fused_lamb_ as the two ops of its passes (FusedLAMB's step under FSDP2, without the ranks)."""

    op = "fused_lamb_moments_"

    def call(self, amp_ops, grads, inv_scale=None, found_inf=None):
        o = self.options
        grad_norm = ref.flag(ref.l2norm(grads)[0], self.params[0].device)
        lists = (self.params, grads, self.states["exp_avgs"], self.states["exp_avg_sqs"], self.model_params, [], [],
                 self.step, grad_norm)
        moments = _lamb_moment_options(o)
        norm_squares = amp_ops.fused_lamb_moments_(*lists, *moments, inv_scale, found_inf)
        assert norm_squares.shape == (2, len(self.params)) and norm_squares.dtype == F32
        amp_ops.fused_lamb_update_(*lists, norm_squares, o["lr"], *moments, o["use_nvlamb"], inv_scale, found_inf)


def _lamb_moment_options(o):
    return (o["beta1"], o["beta2"], o["eps"], o["weight_decay"], o["bias_correction"], o["grad_averaging"],
            o["adam_w_mode"], o["max_grad_norm"])


def _grad_norms(grads, norm_type):
    """Each gradient's norm in fp32 as the op would compute it: L2, or the largest |g| (norm_type 0)."""
    norms = [(g.float().norm() if norm_type == 2 else g.float().abs().amax()) if g.numel() else torch.zeros(())
             for g in grads]
    return torch.stack(norms).to(grads[0].device) if norms else torch.zeros(0)


class NovoGradGivenNorms(NovoGrad):
    """fused_novograd_ handed the gradient norms (FusedNovoGrad's step under FSDP2)."""

    def call(self, amp_ops, grads, inv_scale=None, found_inf=None):
        o = self.options
        amp_ops.fused_novograd_(self.params, grads, self.states["exp_avgs"], self.moments, self.model_params, [], [],
                                self.step, o["lr"], o["beta1"], o["beta2"], o["eps"], o["weight_decay"],
                                o["bias_correction"], o["grad_averaging"], o["reg_inside_moment"], o["norm_type"],
                                inv_scale, found_inf, grad_norms=_grad_norms(grads, o["norm_type"]))


SGD = dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False)
ADAGRAD = dict(lr=0.05, eps=1e-10, weight_decay=0.0, adagrad_w_mode=False)
NOVOGRAD = dict(lr=0.01, beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.0, bias_correction=True,
                grad_averaging=True, reg_inside_moment=False, norm_type=2)
LAMB = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction=True,
            grad_averaging=True, adam_w_mode=True, max_grad_norm=1.0, use_nvlamb=False)

CASES = [
    (Sgd, SGD, "sgd-momentum"),
    (Sgd, dict(SGD, momentum=0.0), "sgd-plain"),
    (Sgd, dict(SGD, nesterov=True, weight_decay=0.01), "sgd-nesterov"),
    (Sgd, dict(SGD, dampening=0.3, weight_decay=0.01, wd_after_momentum=True), "sgd-dampening-wd-after"),
    (Adagrad, ADAGRAD, "adagrad"),
    (Adagrad, dict(ADAGRAD, weight_decay=0.1), "adagrad-l2"),
    (Adagrad, dict(ADAGRAD, weight_decay=0.1, adagrad_w_mode=True), "adagrad-w"),
    (NovoGrad, NOVOGRAD, "novograd"),
    (NovoGrad, dict(NOVOGRAD, norm_type=0, weight_decay=0.01), "novograd-linf"),
    (NovoGrad, dict(NOVOGRAD, reg_inside_moment=True, weight_decay=0.01, grad_averaging=False,
                    bias_correction=False), "novograd-reg-inside"),
    (Lamb, LAMB, "lamb"),
    (Lamb, dict(LAMB, max_grad_norm=float("inf"), adam_w_mode=False), "lamb-l2-no-clip"),
    (Lamb, dict(LAMB, weight_decay=0.0, use_nvlamb=True, grad_averaging=False, bias_correction=False), "nvlamb"),
    (Lamb, dict(LAMB, weight_decay=0.0), "lamb-no-trust-ratio"),
    (LambPasses, LAMB, "lamb-passes"),
    (LambPasses, dict(LAMB, max_grad_norm=float("inf"), adam_w_mode=False), "lamb-passes-l2-no-clip"),
    (LambPasses, dict(LAMB, weight_decay=0.0, use_nvlamb=True), "nvlamb-passes"),
    (NovoGradGivenNorms, NOVOGRAD, "novograd-given-norms"),
    (NovoGradGivenNorms, dict(NOVOGRAD, norm_type=0, weight_decay=0.01), "novograd-linf-given-norms"),
]
CASE_IDS = [case_id for _, _, case_id in CASES]


def _params(device, sizes=SIZES, dtype=F32, seed=1):
    return ref.random_tensors(sizes, [dtype], seed=seed, device=device)


def _grads(device, sizes=SIZES, step=0, dtype=F32):
    return ref.random_tensors(sizes, [dtype], seed=100 + step, device=device)


@pytest.mark.parametrize(("harness", "options", "case_id"), CASES, ids=CASE_IDS)
def test_op_matches_apexs_math_over_several_steps(amp_ops, device, harness, options, case_id):
    state = harness(_params(device), options)
    for step in range(STEPS):
        state.step_both(amp_ops, _grads(device, step=step))
    state.assert_matches_reference()


@pytest.mark.parametrize(("harness", "options", "case_id"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("grad_dtype", [F16, BF16], ids=ref.dtype_id)
@pytest.mark.parametrize("model_dtype", [F16, BF16, F32], ids=ref.dtype_id)
def test_fp32_masters_with_half_grads_and_a_model_copy(amp_ops, harness, options, case_id, grad_dtype, model_dtype):
    # O2: fp32 masters, half gradients, the half model copy written in the same pass. Gradients
    # exactly representable in the half dtype give the fp32-gradient run bit for bit.
    sizes = (7, 300)
    half_run = harness(_params("cpu", sizes), options, model_dtype=model_dtype)
    fp32_run = harness(_params("cpu", sizes), options)
    for step in range(STEPS):
        grads = [g.to(grad_dtype) for g in _grads("cpu", sizes, step)]
        half_run.run(amp_ops, grads)
        fp32_run.run(amp_ops, [g.float() for g in grads])
    for a, b in zip(half_run.params, fp32_run.params):
        assert torch.equal(a, b)
    for model, master in zip(half_run.model_params, half_run.params):
        assert model.dtype == model_dtype and torch.equal(model, master.to(model_dtype))


@pytest.mark.parametrize(("harness", "options", "case_id"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=ref.dtype_id)
def test_half_params_with_their_own_grads(amp_ops, harness, options, case_id, dtype):
    # O3 / no masters: the state takes the params' dtype, the math runs in fp32.
    sizes = (5, 64)
    state = harness(_params("cpu", sizes, dtype=dtype), options)
    for step in range(2):
        grads = _grads("cpu", sizes, step, dtype=dtype)
        state.step_both(amp_ops, grads)
    assert all(p.dtype == dtype for p in state.params)
    assert all(s.dtype == dtype for lists in state.states.values() for s in lists)
    state.assert_matches_reference({"rtol": 2e-2, "atol": 2e-2})


@pytest.mark.parametrize(("harness", "options", "case_id"), CASES, ids=CASE_IDS)
def test_inv_scale_unscales_as_it_reads(amp_ops, harness, options, case_id):
    # A power-of-two scale is undone exactly: the scaled run equals the unscaled one bit for bit.
    scaled = harness(_params("cpu", (9, 130)), options)
    plain = harness(_params("cpu", (9, 130)), options)
    for step in range(STEPS):
        grads = _grads("cpu", (9, 130), step)
        scaled.run(amp_ops, [g * 1024.0 for g in grads], inv_scale=1 / 1024.0)
        plain.run(amp_ops, grads)
    for a, b in zip(scaled.tensors(), plain.tensors()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("harness", "options", "case_id"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("found_inf", [1.0, float("nan")], ids=("one", "nan"))
def test_found_inf_makes_the_whole_op_a_no_op(amp_ops, harness, options, case_id, found_inf):
    state = harness(_params("cpu", (9, 130)), options, model_dtype=BF16)
    state.run(amp_ops, _grads("cpu", (9, 130), 0))  # non-trivial state first
    before = [t.clone() for t in state.tensors()]
    state.run(amp_ops, [torch.full_like(g, float("inf")) for g in _grads("cpu", (9, 130), 1)], found_inf=found_inf)
    for a, b in zip(before, state.tensors()):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


@pytest.mark.parametrize(("harness", "options", "case_id"), CASES, ids=CASE_IDS)
def test_channels_last_state_updates_like_contiguous(amp_ops, harness, options, case_id):
    # A conv weight in channels_last with its grad and state alike: the same values as contiguous.
    shape = (8, 3, 3, 3)
    base = _params("cpu", (8 * 27,))[0].view(shape)
    grads = [_grads("cpu", (8 * 27,), step)[0].view(shape) for step in range(STEPS)]
    contiguous = harness([base.clone()], options, model_dtype=BF16)
    channels_last = harness([base.clone().to(memory_format=torch.channels_last)], options, model_dtype=BF16)
    assert channels_last.params[0].stride() != contiguous.params[0].stride()
    for grad in grads:
        contiguous.run(amp_ops, [grad])
        channels_last.run(amp_ops, [grad.to(memory_format=torch.channels_last)])
    for a, b in zip(contiguous.tensors(), channels_last.tensors()):
        if issubclass(harness, (NovoGrad, Lamb)):  # per-tensor norms sum in memory order: rounding differs
            tolerance = {"rtol": 1e-6, "atol": 1e-7} if a.dtype == F32 else {"rtol": 8e-3, "atol": 1e-5}
            torch.testing.assert_close(a, b, **tolerance)
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize(("harness", "options", "case_id"), CASES, ids=CASE_IDS)
def test_backends_agree(harness, options, case_id):
    # The fallback restates each kernel's fp32 arithmetic: a few ulp apart at most.
    pytest.importorskip("apex_amp._C")
    from apex_amp._extension import STATUS

    if not STATUS.loaded:
        pytest.skip(f"compiled extension not in use: {STATUS.reason}")
    runs = {}
    for backend in ("extension", "fallback"):
        state = harness(_params("cpu"), options, model_dtype=BF16)
        for step in range(STEPS):
            state.run(getattr(torch.ops, "apex_amp" if backend == "extension" else "apex_amp_fallback"),
                      _grads("cpu", step=step))
        runs[backend] = state
    for a, b in zip(runs["extension"].tensors(), runs["fallback"].tensors()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("harness", "options", "case_id"), CASES, ids=CASE_IDS)
def test_a_nonfinite_gradient_without_found_inf_reaches_the_params(amp_ops, harness, options, case_id):
    # Without amp's flag the op does what apex's did: the inf propagates (amp is what skips).
    state = harness(_params("cpu", (5, 40)), options)
    grads = _grads("cpu", (5, 40), 0)
    grads[1][3] = float("inf")
    state.run(amp_ops, grads)
    assert not torch.isfinite(state.params[1]).all()


def test_lamb_clips_by_the_global_norm_of_all_lists(amp_ops):
    # Gradients far above max_grad_norm: the update equals that of the gradients divided by
    # norm / max_grad_norm (clip), i.e. of gradients with global norm max_grad_norm.
    options = dict(LAMB, max_grad_norm=0.5)
    big = Lamb(_params("cpu", (20, 30)), options)
    small = Lamb(_params("cpu", (20, 30)), dict(options, max_grad_norm=float("inf")))
    grads = _grads("cpu", (20, 30), 0)
    norm = ref.l2norm(grads)[0]
    big.run(amp_ops, [g * 64.0 for g in grads])
    small.run(amp_ops, [g * 0.5 / norm for g in grads])
    for a, b in zip(big.params, small.params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_novograd_second_moments_start_from_the_first_norm_or_zero(amp_ops):
    state = NovoGrad(_params("cpu", (6, 10)), NOVOGRAD)
    grads = _grads("cpu", (6, 10), 0)
    state.run(amp_ops, grads)
    assert [m.item() for m in state.moments] == pytest.approx([float(g.norm()) for g in grads], rel=1e-6)
    zero_start = NovoGrad(_params("cpu", (6, 10)), NOVOGRAD)
    zero_start.moments = [torch.zeros(1) for _ in zero_start.moments]
    zero_start.run(amp_ops, grads)
    expected = [(1 - NOVOGRAD["beta2"]) ** 0.5 * float(g.norm()) for g in grads]
    assert [m.item() for m in zero_start.moments] == pytest.approx(expected, rel=1e-6)


def test_sgd_first_run_takes_the_gradient_as_the_buffer(amp_ops):
    options = dict(SGD, dampening=0.5)
    state = Sgd(_params("cpu", (5,)), options)
    grads = _grads("cpu", (5,), 0)
    state.run(amp_ops, grads)
    assert torch.equal(state.states["momentum_buffers"][0], grads[0])
    later = copy.deepcopy(state)
    later.steps_taken = 1  # not a first run: the buffer is damped
    later.run(amp_ops, grads)
    torch.testing.assert_close(later.states["momentum_buffers"][0], grads[0] * (0.9 + 0.5))


# ---- FSDP2's shards: dim-0 row blocks of each tensor, the per-tensor values combined over them -----------
SHARDED_SHAPES = ((7, 33), (1, 5), (3, 130), (5, 16384 // 4 + 9))  # (1, 5): the second shard is empty
SHARDS = 2


def _rows_of(tensors, shard):
    # FSDP2's Shard(0): ceil(rows / shards) rows per shard, the last ones short (or empty).
    out = []
    for t in tensors:
        per = -(-t.shape[0] // SHARDS)
        out.append(t[shard * per:(shard + 1) * per].clone())
    return out


def _whole_and_shards(seed):
    g = torch.Generator().manual_seed(seed)
    whole = [torch.randn(shape, generator=g) for shape in SHARDED_SHAPES]
    return whole, [_rows_of(whole, r) for r in range(SHARDS)]


def _joined(shards):
    return [torch.cat(parts) for parts in zip(*shards)]


@pytest.mark.parametrize("options", [LAMB, dict(LAMB, weight_decay=0.0, use_nvlamb=True, max_grad_norm=0.5)],
                         ids=["lamb", "nvlamb-clipped"])
def test_lamb_passes_on_shards_with_summed_norm_squares_step_as_the_whole_tensors(amp_ops, options):
    moments = _lamb_moment_options(options)
    whole_params, shard_params = _whole_and_shards(seed=5)
    own_norms = [[p.clone() for p in params] for params in shard_params]  # each shard on its own: no sum

    def states(params):
        return [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]

    whole_states, shard_states = states(whole_params), [states(p) for p in shard_params]
    own_states = [states(p) for p in own_norms]
    whole_step, shard_steps, own_steps = torch.zeros(1), [torch.zeros(1) for _ in range(SHARDS)], \
        [torch.zeros(1) for _ in range(SHARDS)]
    for step in range(STEPS):
        g = torch.Generator().manual_seed(50 + step)
        whole_grads = [torch.randn(p.shape, generator=g) * 1024.0 for p in whole_params]
        shard_grads = [_rows_of(whole_grads, r) for r in range(SHARDS)]
        inv_scale = ref.flag(1 / 1024.0)
        grad_norm = ref.flag(ref.l2norm(whole_grads)[0])  # the global norm, as FusedLAMB computes it
        amp_ops.fused_lamb_(whole_params, whole_grads, *whole_states, [], [], [], whole_step, grad_norm,
                            options["lr"], *moments, options["use_nvlamb"], inv_scale, None)
        lists = [(shard_params[r], shard_grads[r], *shard_states[r], [], [], [], shard_steps[r], grad_norm)
                 for r in range(SHARDS)]
        squares = [amp_ops.fused_lamb_moments_(*lists[r], *moments, inv_scale, None) for r in range(SHARDS)]
        summed = sum(squares)
        for r in range(SHARDS):
            amp_ops.fused_lamb_update_(*lists[r], summed, options["lr"], *moments, options["use_nvlamb"],
                                       inv_scale, None)
            own = (own_norms[r], shard_grads[r], *own_states[r], [], [], [], own_steps[r], grad_norm)
            own_squares = amp_ops.fused_lamb_moments_(*own, *moments, inv_scale, None)
            amp_ops.fused_lamb_update_(*own, own_squares, options["lr"], *moments, options["use_nvlamb"],
                                       inv_scale, None)
    for got, want in zip(_joined(shard_params), whole_params):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for k in range(2):
        for got, want in zip(_joined([s[k] for s in shard_states]), whole_states[k]):
            assert torch.equal(got, want)  # elementwise: the moments do not depend on the sharding
    assert all(s.item() == STEPS for s in shard_steps)
    # The shards' own norms give other trust ratios: the sum is what makes the shards agree.
    differ = [not torch.allclose(got, want, rtol=1e-4) for got, want in zip(_joined(own_norms), whole_params)]
    assert any(differ)


@pytest.mark.parametrize("norm_type", [2, 0], ids=["l2", "linf"])
def test_novograd_on_shards_given_the_whole_gradient_norms_steps_as_the_whole_tensors(amp_ops, norm_type):
    options = dict(NOVOGRAD, norm_type=norm_type, weight_decay=0.01)
    whole_params, shard_params = _whole_and_shards(seed=6)
    whole_avgs, shard_avgs = [torch.zeros_like(p) for p in whole_params], \
        [[torch.zeros_like(p) for p in params] for params in shard_params]
    whole_moments = [torch.full((1,), -1.0) for _ in whole_params]
    shard_moments = [[torch.full((1,), -1.0) for _ in whole_params] for _ in range(SHARDS)]
    whole_step, shard_steps = torch.zeros(1), [torch.zeros(1) for _ in range(SHARDS)]
    hyper = (options["lr"], options["beta1"], options["beta2"], options["eps"], options["weight_decay"],
             options["bias_correction"], options["grad_averaging"], options["reg_inside_moment"], norm_type)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(60 + step)
        whole_grads = [torch.randn(p.shape, generator=g) for p in whole_params]
        shard_grads = [_rows_of(whole_grads, r) for r in range(SHARDS)]
        amp_ops.fused_novograd_(whole_params, whole_grads, whole_avgs, whole_moments, [], [], [], whole_step, *hyper,
                                None, None)
        per_shard = torch.stack([_grad_norms(grads, norm_type) for grads in shard_grads])
        norms = per_shard.square().sum(0).sqrt() if norm_type == 2 else per_shard.amax(0)
        for r in range(SHARDS):
            amp_ops.fused_novograd_(shard_params[r], shard_grads[r], shard_avgs[r], shard_moments[r], [], [], [],
                                    shard_steps[r], *hyper, None, None, grad_norms=norms)
    for got, want in zip(_joined(shard_params), whole_params):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for moments in shard_moments:  # every shard holds the whole tensor's second moment
        torch.testing.assert_close(torch.cat(moments), torch.cat(whole_moments), rtol=1e-6, atol=0)


def test_novograd_given_norms_are_taken_instead_of_the_gradients_own(amp_ops):
    state = NovoGrad(_params("cpu", (6, 10)), NOVOGRAD)
    grads = _grads("cpu", (6, 10), 0)
    given = torch.tensor([3.0, 0.25])
    amp_ops.fused_novograd_(state.params, grads, state.states["exp_avgs"], state.moments, [], [], [], state.step,
                            *(NOVOGRAD[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "bias_correction",
                                                    "grad_averaging", "reg_inside_moment", "norm_type")),
                            ref.flag(0.5), None, grad_norms=given)
    assert [m.item() for m in state.moments] == [1.5, 0.125]  # the given norms times inv_scale: the first moments


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(1, 2)],
                         ids=["length", "dtype", "shape"])
def test_novograd_refuses_grad_norms_that_are_not_one_fp32_value_per_param(amp_ops, bad):
    params = [torch.zeros(4), torch.zeros(3)]
    with raises_naming("fused_novograd_", "grad_norms"):
        amp_ops.fused_novograd_(params, [torch.ones_like(p) for p in params], [torch.zeros_like(p) for p in params],
                                [torch.full((1,), -1.0) for _ in params], [], [], [], torch.zeros(1), 0.01, 0.95, 0.98,
                                1e-8, 0.0, True, True, False, 2, None, None, grad_norms=bad)


@pytest.mark.parametrize("bad", [torch.ones(2), torch.ones(2, 3), torch.ones(2, 2, dtype=torch.float64),
                                 torch.ones(2, 2).t()], ids=["one-row", "length", "dtype", "transposed"])
def test_lamb_update_refuses_norm_squares_that_are_not_two_fp32_rows_per_param(amp_ops, bad):
    params = [torch.ones(4), torch.ones(3)]
    lists = (params, [torch.ones_like(p) for p in params], [torch.zeros_like(p) for p in params],
             [torch.zeros_like(p) for p in params], [], [], [], torch.zeros(1), ref.flag(1.0))
    with raises_naming("fused_lamb_update_", "norm_squares"):
        amp_ops.fused_lamb_update_(*lists, bad, 0.01, *_lamb_moment_options(LAMB), False, None, None)
    assert all(torch.equal(p, torch.ones_like(p)) for p in params) and lists[7].item() == 0.0


def test_lamb_moments_of_a_skipped_step_are_zeros_and_write_nothing(amp_ops):
    params = [torch.randn(5, 3), torch.randn(7)]
    grads = [torch.randn_like(p) for p in params]
    exp_avgs, exp_avg_sqs = [torch.full_like(p, 0.5) for p in params], [torch.full_like(p, 0.25) for p in params]
    squares = amp_ops.fused_lamb_moments_(params, grads, exp_avgs, exp_avg_sqs, [], [], [], torch.zeros(1),
                                          ref.flag(1.0), *_lamb_moment_options(LAMB), None, ref.flag(1.0))
    assert torch.equal(squares, torch.zeros(2, 2))
    assert all(torch.equal(m, torch.full_like(m, 0.5)) for m in exp_avgs)
    assert all(torch.equal(v, torch.full_like(v, 0.25)) for v in exp_avg_sqs)
