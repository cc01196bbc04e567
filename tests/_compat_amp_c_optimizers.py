"""The compat amp_C's optimizer kernels against apex's math (tests/_amp_c_reference.py), and a
LAMB optimizer written the way apex's reference optimizers are (amp_C.multi_tensor_l2norm for the
global norm, amp_C.multi_tensor_lamb for the step). Imported by _compat_amp_c_installed.py, in
the compat venv, which runs these checks with its own.
"""

import torch

import amp_C
from apex.multi_tensor_apply import multi_tensor_applier
from apex.optimizers import FusedLAMB

import _amp_c_reference as ref

CHECKS = {}
assert_close = torch.testing.assert_close
HALF_TOLERANCE = {torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
                  torch.float32: dict(rtol=1e-5, atol=1e-6)}


def check(function):
    CHECKS[function.__name__] = function
    return function


def flag(value: int = 0) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.int)


def randn(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


def clones(*lists):
    return [[t.clone() for t in tensors] for tensors in lists]


def unchanged(before, after):
    for b, a in zip(before, after):
        assert torch.equal(b, a), "a skipped step changed a tensor"


SIZES = [(100,), (7, 3)]


@check
def sgd_matches_apex_for_each_option_and_layout():
    options = [(0.0, 0.0, False, False, False), (0.9, 0.1, False, False, True), (0.9, 0.1, False, False, False),
               (0.9, 0.0, True, True, False)]
    for momentum, dampening, nesterov, wd_after, first_run in options:
        for grad_dtype, weight_dtype, copy in ((torch.float32,) * 2 + (False,), (torch.float16,) * 2 + (False,),
                                               (torch.float16, torch.float32, True)):
            grads = [randn(*s, dtype=grad_dtype, seed=i) * 8 for i, s in enumerate(SIZES)]
            weights = [randn(*s, dtype=weight_dtype, seed=10 + i) for i, s in enumerate(SIZES)]
            moms = [randn(*s, dtype=weight_dtype, seed=20 + i) for i, s in enumerate(SIZES)]
            copies = [w.half() for w in weights]
            expected = [ref.sgd(g, w, m, wd=0.01, momentum=momentum, dampening=dampening, lr=0.1, nesterov=nesterov,
                                first_run=first_run, wd_after_momentum=wd_after, scale=1 / 8)
                        for g, w, m in zip(grads, weights, moms)]
            buf = flag()
            multi_tensor_applier(amp_C.multi_tensor_sgd, buf, [grads, weights, moms] + ([copies] if copy else []),
                                 0.01, momentum, dampening, 0.1, nesterov, first_run, wd_after, 1 / 8)
            tolerance = HALF_TOLERANCE[weight_dtype]
            assert_close(weights, [w for w, _ in expected], **tolerance)
            assert_close(moms, [m for _, m in expected], **tolerance)
            if copy:
                assert_close(copies, [w.half() for w, _ in expected], **HALF_TOLERANCE[torch.float16])
            assert int(buf) == 0


@check
def sgd_skips_while_the_flag_is_set_and_never_sets_it():
    lists = [[randn(*s, seed=i) for i, s in enumerate(SIZES)] for _ in range(3)]
    before = clones(*lists)
    buf = flag(1)
    multi_tensor_applier(amp_C.multi_tensor_sgd, buf, lists, 0.01, 0.9, 0.0, 0.1, False, False, False, 1.0)
    for b, a in zip(before, lists):
        unchanged(b, a)
    lists[0][0][0] = float("inf")
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_sgd, buf, lists, 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0)
    assert int(buf) == 0 and lists[1][0][0].isinf()


@check
def adam_matches_apex_for_modes_and_dtypes_and_ignores_the_flag():
    for mode in (0, 1):
        for bias_correction in (0, 1):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                grads = [randn(*s, dtype=dtype, seed=i) for i, s in enumerate(SIZES)]
                params = [randn(*s, dtype=dtype, seed=10 + i) for i, s in enumerate(SIZES)]
                ms = [randn(*s, seed=20 + i) * 0.1 for i, s in enumerate(SIZES)]
                vs = [randn(*s, seed=30 + i).abs() * 0.01 for i, s in enumerate(SIZES)]
                expected = [ref.adam(g, p, m, v, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, step=3, mode=mode,
                                     bias_correction=bool(bias_correction), decay=0.05)
                            for g, p, m, v in zip(grads, params, ms, vs)]
                buf = flag(1)  # apex's multi_tensor_adam steps whatever the flag
                multi_tensor_applier(amp_C.multi_tensor_adam, buf, [grads, params, ms, vs], 1e-2, 0.9, 0.99, 1e-8,
                                     3, mode, bias_correction, 0.05)
                assert_close(params, [p.to(dtype) for p, _, _ in expected], **HALF_TOLERANCE[dtype])
                assert_close((ms, vs), ([m for _, m, _ in expected], [v for _, _, v in expected]),
                             **HALF_TOLERANCE[torch.float32])
                assert int(buf) == 1


@check
def adam_capturable_unscales_grads_in_place_and_skips_on_the_flag():
    for master in (False, True):
        dtype = torch.float16 if master else torch.float32
        grads = [randn(*s, seed=i).to(dtype) * 1024 for i, s in enumerate(SIZES)]
        masters = [randn(*s, seed=10 + i) for i, s in enumerate(SIZES)]
        params = [m.to(dtype) for m in masters]
        ms = [torch.zeros(s) for s in SIZES]
        vs = [torch.zeros(s) for s in SIZES]
        lists = [grads, params, ms, vs] + ([masters] if master else [])
        op = amp_C.multi_tensor_adam_capturable_master if master else amp_C.multi_tensor_adam_capturable
        args = (torch.tensor(1e-2), 0.9, 0.999, 1e-8, torch.tensor([2], dtype=torch.int), 1, 1, 0.0,
                torch.full((1,), 1 / 1024.0))
        skipped = clones(*lists)
        multi_tensor_applier(op, flag(1), skipped, *args)
        for b, a in zip(lists, skipped):
            unchanged(b, a)
        expected = [ref.adam(g, p, torch.zeros(p.shape), torch.zeros(p.shape), lr=1e-2, beta1=0.9, beta2=0.999,
                             eps=1e-8, step=2, mode=1, bias_correction=True, decay=0.0, inv_scale=1 / 1024.0)
                    for g, p in zip(grads, masters)]
        unscaled = [(g.float() / 1024).to(dtype) for g in grads]
        buf = flag()
        multi_tensor_applier(op, buf, lists, *args)
        assert_close(params, [p.to(dtype) for p, _, _ in expected], **HALF_TOLERANCE[dtype])
        if master:
            assert_close(masters, [p for p, _, _ in expected], **HALF_TOLERANCE[torch.float32])
        assert_close(grads, unscaled, rtol=0, atol=0)
        assert int(buf) == 0


@check
def adagrad_matches_apex_for_both_modes():
    for mode in (0, 1):
        for dtype in (torch.float32, torch.float16):
            grads = [randn(*s, dtype=dtype, seed=i) for i, s in enumerate(SIZES)]
            params = [randn(*s, dtype=dtype, seed=10 + i) for i, s in enumerate(SIZES)]
            sums = [randn(*s, seed=20 + i).abs().to(dtype) for i, s in enumerate(SIZES)]
            expected = [ref.adagrad(g, p, h, lr=0.1, eps=1e-10, mode=mode, decay=0.05)
                        for g, p, h in zip(grads, params, sums)]
            multi_tensor_applier(amp_C.multi_tensor_adagrad, flag(), [grads, params, sums], 0.1, 1e-10, mode, 0.05)
            assert_close(params, [p.to(dtype) for p, _ in expected], **HALF_TOLERANCE[dtype])
            assert_close(sums, [h.to(dtype) for _, h in expected], **HALF_TOLERANCE[dtype])


@check
def novograd_blends_grad_norms_in_place_and_flags_inf():
    for mode in (0, 1):
        for norm_type in (0, 2):
            for grad_averaging in (0, 1):
                grads = [randn(*s, seed=i) for i, s in enumerate(SIZES)]
                params = [randn(*s, seed=10 + i) for i, s in enumerate(SIZES)]
                ms = [randn(*s, seed=20 + i) * 0.1 for i, s in enumerate(SIZES)]
                grad_norms = torch.tensor([0.5, 2.0])
                expected = ref.novograd(grads, params, ms, grad_norms, lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8,
                                        step=4, bias_correction=True, decay=0.01, grad_averaging=bool(grad_averaging),
                                        mode=mode, norm_type=norm_type)
                buf = flag()
                multi_tensor_applier(amp_C.multi_tensor_novograd, buf, [grads, params, ms], grad_norms, 1e-2, 0.95,
                                     0.98, 1e-8, 4, 1, 0.01, grad_averaging, mode, norm_type)
                assert_close((params, ms, grad_norms), expected, **HALF_TOLERANCE[torch.float32])
                assert int(buf) == 0
    grads[0][0] = float("inf")
    multi_tensor_applier(amp_C.multi_tensor_novograd, buf, [grads, params, ms], grad_norms, 1e-2, 0.95, 0.98, 1e-8,
                         5, 1, 0.01, 1, 1, 2)
    assert int(buf) == 1


def _lamb_lists(dtype, scale=1.0):
    grads = [(randn(*s, seed=i) * scale).to(dtype) for i, s in enumerate(SIZES)]
    params = [randn(*s, seed=10 + i).to(dtype) for i, s in enumerate(SIZES)]
    ms = [(randn(*s, seed=20 + i) * 0.1).to(dtype) for i, s in enumerate(SIZES)]
    vs = [(randn(*s, seed=30 + i).abs() * 0.01).to(dtype) for i, s in enumerate(SIZES)]
    return grads, params, ms, vs


@check
def lamb_matches_apex_for_modes_decay_and_nvlamb():
    for mode, decay, use_nvlamb, max_grad_norm in ((1, 0.01, False, 1.0), (0, 0.01, False, 1.0),
                                                   (1, 0.0, False, 1.0), (1, 0.0, True, 100.0)):
        for dtype in (torch.float32, torch.float16):
            grads, params, ms, vs = _lamb_lists(dtype)
            buf = flag()
            norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, buf, [grads], False)
            expected = ref.lamb(grads, params, ms, vs, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, step=2,
                                bias_correction=True, decay=decay, grad_averaging=True, mode=mode,
                                grad_norm=float(norm), max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb)
            multi_tensor_applier(amp_C.multi_tensor_lamb, buf, [grads, params, ms, vs], 1e-2, 0.9, 0.999, 1e-6, 2, 1,
                                 decay, 1, mode, norm, max_grad_norm, use_nvlamb)
            assert_close((params, ms, vs), [[t.to(dtype) for t in ts] for ts in expected], **HALF_TOLERANCE[dtype])
            assert int(buf) == 0


@check
def lamb_steps_whatever_the_flag_and_sets_it_on_inf():
    grads, params, ms, vs = _lamb_lists(torch.float32)
    before = [p.clone() for p in params]
    norm = torch.ones(1)
    buf = flag(1)
    multi_tensor_applier(amp_C.multi_tensor_lamb, buf, [grads, params, ms, vs], 1e-2, 0.9, 0.999, 1e-6, 1, 1, 0.01,
                         1, 1, norm, 1.0, False)
    assert not torch.equal(before[0], params[0]) and int(buf) == 1
    grads[1][0, 0] = float("nan")
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_lamb, buf, [grads, params, ms, vs], 1e-2, 0.9, 0.999, 1e-6, 2, 1, 0.01,
                         1, 1, norm, 1.0, False)
    assert int(buf) == 1


@check
def lamb_mp_updates_masters_and_model_copy_and_skips_on_the_flag():
    for model_dtype in (torch.bfloat16, None):
        grads, masters, ms, vs = _lamb_lists(torch.float32, scale=1024.0)
        if model_dtype is not None:
            grads = [g.to(model_dtype) for g in grads]
        lists = [grads, masters, ms, vs] + ([[m.to(model_dtype) for m in masters]] if model_dtype else [])
        buf = flag()
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm_mp, buf, [grads], False)
        args = (torch.tensor(1e-2), 0.9, 0.999, 1e-6, torch.tensor([3], dtype=torch.int), 1, 0.01, 1, 1, norm,
                torch.tensor([1024.0]), False, torch.zeros(1), torch.full((1,), 1 / 1024.0))
        skipped = clones(*lists)
        multi_tensor_applier(amp_C.multi_tensor_lamb_mp, flag(1), skipped, *args)
        for b, a in zip(lists, skipped):
            unchanged(b, a)
        expected = ref.lamb(grads, masters, ms, vs, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, step=3,
                            bias_correction=True, decay=0.01, grad_averaging=True, mode=1, grad_norm=float(norm),
                            max_grad_norm=1024.0, use_nvlamb=False, inv_scale=1 / 1024.0)
        multi_tensor_applier(amp_C.multi_tensor_lamb_mp, buf, lists, *args)
        assert_close((masters, ms, vs), expected, **HALF_TOLERANCE[torch.float32])
        if model_dtype is not None:
            assert_close(lists[4], [p.to(model_dtype) for p in expected[0]], rtol=0, atol=0)
        assert int(buf) == 0


@check
def lamb_stages_match_apex_and_leave_the_flag_alone():
    # DLE BERT's lists: fp32 grads, params and moments, an fp16 update buffer for one of them.
    grads, params, ms, vs = _lamb_lists(torch.float32)
    updates = [torch.empty_like(params[0]), torch.empty_like(params[1], dtype=torch.float16)]
    decays = torch.tensor([0.01, 0.0])
    for norm, max_norm in ((torch.tensor([0.5]), 1.0), (torch.tensor([8.0]), 2.0), (3.0, 1.0)):
        lists = clones(grads, params, ms, vs, updates)
        for buf_value in (0, 1):
            buf = flag(buf_value)
            run = clones(*lists)
            multi_tensor_applier(amp_C.multi_tensor_lamb_stage1_cuda, buf, run, decays, 4, 0.9, 0.999, 1e-6, norm,
                                 max_norm)
            assert int(buf) == buf_value  # neither read nor set
            for i in range(2):
                update, m, v = ref.lamb_stage1(grads[i], params[i], ms[i], vs[i], decay=float(decays[i]), step=4,
                                               beta1=0.9, beta2=0.999, eps=1e-6, grad_norm=float(norm),
                                               max_grad_norm=max_norm)
                assert_close(run[4][i], update.to(updates[i].dtype), **HALF_TOLERANCE[updates[i].dtype])
                assert_close((run[2][i], run[3][i]), (m, v), **HALF_TOLERANCE[torch.float32])
            unchanged(grads + params, run[0] + run[1])
    param_norms = torch.tensor([2.0, 0.0])
    update_norms = torch.tensor([0.5, 3.0])
    for weight_decay, use_nvlamb in ((None, None), (0.01, False), (0.0, False), (0.0, True)):
        for update_dtype in (torch.float32, torch.float16):
            params_now = [p.clone() for p in params]
            update_list = [randn(*s, seed=40 + i).to(update_dtype) for i, s in enumerate(SIZES)]
            extra = () if weight_decay is None else (weight_decay, use_nvlamb)
            buf = flag()
            multi_tensor_applier(amp_C.multi_tensor_lamb_stage2_cuda, buf, [params_now, update_list], param_norms,
                                 update_norms, 0.1, *extra)
            trust = weight_decay is None or use_nvlamb or weight_decay != 0
            expected = [ref.lamb_stage2(p, u, param_norm=float(pn), update_norm=float(un), lr=0.1, trust=trust)
                        for p, u, pn, un in zip(params, update_list, param_norms, update_norms)]
            assert_close(params_now, expected, **HALF_TOLERANCE[torch.float32])
            assert int(buf) == 0


@check
def lamb_stages_propagate_inf_and_check_their_arguments():
    grads, params, ms, vs = _lamb_lists(torch.float32)
    grads[0][3] = float("inf")
    updates = [torch.empty_like(p) for p in params]
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_lamb_stage1_cuda, buf, [grads, params, ms, vs, updates],
                         torch.zeros(2), 0, 0.9, 0.999, 1e-6, torch.ones(1), 1.0)
    assert not torch.isfinite(updates[0]).all() and torch.isfinite(updates[1]).all() and int(buf) == 0
    for bad in (torch.zeros(1), [0.01, 0.0], torch.zeros(2, dtype=torch.float64)):
        try:
            multi_tensor_applier(amp_C.multi_tensor_lamb_stage1_cuda, flag(), [grads, params, ms, vs, updates], bad,
                                 0, 0.9, 0.999, 1e-6, torch.ones(1), 1.0)
        except TypeError as error:
            assert "per_tensor_decay" in str(error) and "one entry per tensor (2)" in str(error), str(error)
        else:
            raise AssertionError(f"per_tensor_decay={bad!r} was accepted")
    try:
        multi_tensor_applier(amp_C.multi_tensor_lamb_stage2_cuda, flag(), [params], torch.ones(2), torch.ones(2), 0.1)
    except ValueError as error:
        assert "takes 2" in str(error), str(error)
    else:
        raise AssertionError("stage 2 with one list was accepted")


class KernelLAMB(torch.optim.Optimizer):
    """LAMB on amp_C, as apex's reference optimizers call it: the global gradient norm blended from
    one ``multi_tensor_l2norm`` per dtype, then ``multi_tensor_lamb`` per dtype."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.max_grad_norm = max_grad_norm
        device = self.param_groups[0]["params"][0].device
        self._dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device=device)

    @torch.no_grad()
    def step(self):
        by_dtype = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_dtype.setdefault(p.dtype, []).append(p.grad)
        norms = [multi_tensor_applier(amp_C.multi_tensor_l2norm, self._dummy_overflow_buf, [grads], False)[0]
                 for grads in by_dtype.values()]
        global_norm = multi_tensor_applier(amp_C.multi_tensor_l2norm, self._dummy_overflow_buf, [norms], False)[0]
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            lists = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                for target, tensor in zip(lists.setdefault(p.dtype, [[], [], [], []]),
                                          (p.grad, p, state["exp_avg"], state["exp_avg_sq"])):
                    target.append(tensor)
            for tensor_lists in lists.values():
                multi_tensor_applier(amp_C.multi_tensor_lamb, self._dummy_overflow_buf, tensor_lists, group["lr"],
                                     beta1, beta2, group["eps"], group["step"], 1, group["weight_decay"], 1, 1,
                                     global_norm, self.max_grad_norm, False)


@check
def reference_lamb_on_amp_c_trains_like_fused_lamb():
    torch.manual_seed(0)
    inputs, targets = torch.randn(64, 16), torch.randint(0, 4, (64,))
    models = []
    for _ in range(2):
        torch.manual_seed(1)
        models.append(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
    kernel = KernelLAMB(models[0].parameters(), lr=0.1)
    fused = FusedLAMB(models[1].parameters(), lr=0.1, eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
    losses = []
    for _ in range(20):
        for model, optimizer in zip(models, (kernel, fused)):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            if optimizer is kernel:
                losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert_close(list(models[0].parameters()), list(models[1].parameters()), rtol=1e-4, atol=1e-5)
    assert int(kernel._dummy_overflow_buf) == 0
