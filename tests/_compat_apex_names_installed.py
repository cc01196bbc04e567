"""Run by tests/test_compat_apex_names.py with the python of a throwaway venv that has the compat
distribution installed: every public name of apex's ``__init__`` files (_apex_public_names.py) imported
as clients import it, the behaviour of the ones that work against plain PyTorch, the raising ones
called, and a DeepLearningExamples-BERT-like client (_dle_bert_like.py) imported and trained.
Prints one JSON object: each check's name and "ok" or its error.
"""

import importlib
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _apex_public_names import APEX_PUBLIC_NAMES

CHECKS = {}
assert_close = torch.testing.assert_close


def check(function):
    CHECKS[function.__name__] = function
    return function


def raises(error_type, words, function, *args, **kwargs):
    try:
        function(*args, **kwargs)
    except error_type as error:
        assert all(word in str(error) for word in words), str(error)
        return
    raise AssertionError(f"{function} did not raise {error_type.__name__}")


def one_rank_gloo():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@check
def every_public_name_imports_or_its_module_names_the_replacement():
    problems = []
    for module_name, names in APEX_PUBLIC_NAMES.items():
        for name, (status, replacement) in names.items():
            statement = f"from {module_name} import {name}"
            try:
                exec(statement, {})
            except ImportError as error:
                if status != "refused" or not isinstance(error, ModuleNotFoundError) or replacement not in str(error):
                    problems.append(f"{statement}: {type(error).__name__}: {error}")
                continue
            if status == "refused":
                problems.append(f"{statement}: imported, but the module should be refused")
    assert not problems, problems


@check
def raising_names_raise_only_when_called_and_name_the_replacement():
    from apex import RankInfoFormatter
    from apex.amp import init

    for module_name, names in APEX_PUBLIC_NAMES.items():
        for name, (status, replacement) in names.items():
            if status == "raises":
                target = getattr(importlib.import_module(module_name), name)
                raises(RuntimeError, [replacement], target)
    raises(RuntimeError, ["leave amp out"], init, enabled=False, loss_scale=128.0)
    raises(RuntimeError, ["apex.transformer"], RankInfoFormatter, "%(message)s")


@check
def apex_top_level_helpers_warn_as_apex():
    import apex

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        apex.deprecated_warning("old thing")
        usable = apex.check_cudnn_version_and_warn("--my-option", 10**9)
    assert [w.category for w in seen] == [apex.DeprecatedFeatureWarning, UserWarning], seen
    assert issubclass(apex.DeprecatedFeatureWarning, FutureWarning)
    assert usable is False and "--my-option" in str(seen[1].message)


@check
def apex_c_flatten_unflatten_round_trip_as_torchs_helpers():
    import apex_C

    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 1, 2)]
    flat = apex_C.flatten(tensors)
    assert torch.equal(flat, torch._utils._flatten_dense_tensors(tensors)) and flat.shape == (21,)
    views = apex_C.unflatten(flat, tensors)
    assert isinstance(views, list) and [v.shape for v in views] == [t.shape for t in tensors]
    assert all(torch.equal(v, t) for v, t in zip(views, tensors))
    views[1].fill_(7.0)  # views of the flat buffer, as apex's clients rely on
    assert torch.equal(flat[12:17], torch.full((5,), 7.0))
    empty = torch.empty(21)
    for view, tensor in zip(apex_C.unflatten(empty, tensors), tensors):
        view.copy_(tensor)
    assert torch.equal(empty, torch._utils._flatten_dense_tensors(tensors))
    raises(ValueError, ["at least 21 elements"], apex_C.unflatten, torch.empty(20), tensors)
    raises(TypeError, ["list of tensors"], apex_C.flatten, torch.ones(3))
    raises(ValueError, ["empty"], apex_C.flatten, [])


@check
def flat_dist_call_groups_by_type_and_averages_on_a_one_rank_gloo_group():
    from apex.parallel import Reducer
    from apex.parallel.distributed import flat_dist_call, split_by_type

    one_rank_gloo()
    tensors = [torch.ones(3), torch.full((2,), 2.0, dtype=torch.float64), torch.full((4,), 3.0)]
    seen = []

    def doubling_call(flat, *extra):
        seen.append((flat.dtype, flat.numel(), extra))
        flat.mul_(2)

    flat_dist_call(tensors, doubling_call, (0,))
    assert seen == [(torch.float32, 7, (0,)), (torch.float64, 2, (0,))], seen
    assert [t.tolist() for t in tensors] == [[2.0] * 3, [4.0] * 2, [6.0] * 4]
    assert list(split_by_type(tensors)) == ["torch.FloatTensor", "torch.DoubleTensor"]
    flat_dist_call(tensors, dist.broadcast, (0,))
    flat_dist_call(tensors, dist.all_reduce)  # the sum over 1 rank, divided by the world size 1
    assert [t.tolist() for t in tensors] == [[2.0] * 3, [4.0] * 2, [6.0] * 4]
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    Reducer(model).reduce()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


@check
def fused_norms_match_torchs_norms_with_apexs_arguments_and_dtypes():
    from apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm

    torch.manual_seed(0)
    x = torch.randn(4, 5, 6, requires_grad=True)
    for ours, theirs in ((FusedLayerNorm([5, 6], eps=1e-5), nn.LayerNorm([5, 6], eps=1e-5)),
                         (FusedRMSNorm(6, eps=1e-6), nn.RMSNorm(6, eps=1e-6))):
        with torch.no_grad():
            for p in list(ours.parameters()) + list(theirs.parameters()):
                p.uniform_(0.5, 1.5)
            theirs.load_state_dict(ours.state_dict())  # the same parameter names: weight (, bias)
        out, expected = ours(x), theirs(x)
        assert_close(out, expected, rtol=1e-6, atol=1e-6)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, [x, *ours.parameters()], grad)
        want = torch.autograd.grad(expected, [x, *theirs.parameters()], grad)
        assert_close(got, want, rtol=1e-5, atol=1e-5)
        half = ours(x.detach().half())
        assert half.dtype == torch.float16
        assert_close(half, expected.detach().half(), rtol=2e-3, atol=2e-3)
    bare = FusedLayerNorm(6, elementwise_affine=False)
    assert bare.weight is None and bare.bias is None and list(bare.parameters()) == []
    assert_close(bare(x), F.layer_norm(x, (6,)), rtol=0, atol=0)
    assert FusedRMSNorm(6, elementwise_affine=False).weight is None
    assert "elementwise_affine=False" in repr(bare)
    for mixed in (MixedFusedLayerNorm(6), MixedFusedRMSNorm(6)):
        assert mixed(x.detach().half()).dtype == torch.float32  # the weight's dtype
        assert mixed.half()(x.detach()).dtype == torch.float16
    raises(RuntimeError, ["elementwise_affine = False"], MixedFusedLayerNorm, 6, elementwise_affine=False)
    weight, bias = torch.rand(6), torch.rand(6)
    assert_close(fused_layer_norm_affine(x.detach(), weight, bias, (6,), 1e-5),
                 F.layer_norm(x.detach(), (6,), weight, bias, 1e-5), rtol=0, atol=0)
    assert_close(fused_rms_norm(x.detach(), 6, 1e-6), F.rms_norm(x.detach(), [6], eps=1e-6), rtol=0, atol=0)


@check
def functions_decorated_at_import_follow_o1():
    from apex import amp

    @amp.half_function
    def matmul_in_half(a, b):
        return a @ b

    @amp.float_function
    def log_in_fp32(a):
        return torch.log(a)

    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    a = torch.rand(3, 4)
    assert matmul_in_half(a, a.t()).dtype == torch.bfloat16
    assert log_in_fp32(a.bfloat16()).dtype == torch.float32


@check
def dle_bert_like_module_imports_and_its_two_stage_lamb_trains_like_fused_lamb():
    import _dle_bert_like as client
    from apex.optimizers import FusedLAMB

    torch.manual_seed(0)
    inputs, targets = torch.randn(64, 16), torch.randint(0, 4, (64,))
    models = []
    for _ in range(2):
        torch.manual_seed(1)
        models.append(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 4)))

    def groups(model):  # DLE's split: no decay for biases and LayerNorm
        decay = [p for n, p in model.named_parameters() if not n.endswith("bias") and not n.startswith("2.")]
        rest = [p for n, p in model.named_parameters() if n.endswith("bias") or n.startswith("2.")]
        return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]

    two_stage = client.TwoStageLAMB(groups(models[0]), lr=0.05, max_grad_norm=1.0)
    fused = FusedLAMB(groups(models[1]), lr=0.05, eps=1e-6, max_grad_norm=1.0)
    losses = []
    for _ in range(15):
        for model, optimizer in zip(models, (two_stage, fused)):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            if optimizer is two_stage:
                losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert_close(list(models[0].parameters()), list(models[1].parameters()), rtol=1e-4, atol=1e-5)


_DLE_RUN = {}


def dle_bert_like_pretraining_run():
    """12 steps of 4 micro-batches through run_pretraining's hand-made all-reduce step, once per process.

    FusedLAMB at O2 from DLE's initial scale 2**20 (the first steps overflow, each backing the
    scale off once, as BERT's do), a micro-batch of step 6 made to overflow. Returns per step: whether the client stepped,
    whether the weights changed, the scale after it, the mean loss before it.
    """
    if _DLE_RUN:
        return _DLE_RUN
    import _dle_bert_like as client
    from apex import amp
    from apex.optimizers import FusedLAMB

    one_rank_gloo()
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    client.broadcast_initial_weights(model)
    optimizer = FusedLAMB(model.parameters(), lr=0.02)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic", verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0**20
    overflow_buf = torch.zeros(1, dtype=torch.int)
    inputs, targets = torch.randn(4, 8, 16), torch.randint(0, 4, (4, 8))
    for step in range(12):
        total = 0.0
        for micro in range(4):
            loss = F.cross_entropy(model(inputs[micro].half()).float(), targets[micro])
            total += loss.item()
            blow_up = 1e30 if step == 6 and micro == 2 else 1.0
            with amp.scale_loss(loss * blow_up, optimizer, delay_overflow_check=True) as scaled:
                scaled.backward()
        before = [p.detach().clone() for p in amp.master_params(optimizer)]
        _DLE_RUN.setdefault("stepped", []).append(client.take_optimizer_step(optimizer, model, overflow_buf, 4))
        _DLE_RUN.setdefault("changed", []).append(
            any(not torch.equal(b, p) for b, p in zip(before, amp.master_params(optimizer))))
        _DLE_RUN.setdefault("scales", []).append(amp._amp_state.loss_scalers[0].loss_scale())
        _DLE_RUN.setdefault("losses", []).append(total / 4)
        _DLE_RUN.setdefault("finite", []).append(
            all(torch.isfinite(p).all() for p in [*amp.master_params(optimizer), *model.parameters()]))
    return _DLE_RUN


@check
def dle_bert_like_allreduce_post_accumulation_skips_overflows_and_trains():
    run = dle_bert_like_pretraining_run()
    assert all(run["finite"]), run
    assert run["stepped"][0] is False and run["stepped"][6] is False, run  # 2**20 overflows; the blown-up step
    assert not run["changed"][0] and not run["changed"][6], run
    assert run["scales"][0] == 2.0**19 and run["scales"][6] == run["scales"][5] / 2, run  # once per step
    assert sum(run["stepped"]) >= 6 and sum(run["changed"]) >= 6, run
    assert run["losses"][-1] < 0.95 * run["losses"][0], run


@check
def dle_bert_like_every_step_the_client_takes_changes_the_weights():
    # The client skips an overflowing step by not calling optimizer.step() and dropping the
    # gradients with `param.grad = None`; amp must not skip the next clean step for it.
    run = dle_bert_like_pretraining_run()
    taken = [changed for stepped, changed in zip(run["stepped"], run["changed"]) if stepped]
    assert all(taken), run


def _apex_scale_rule(scale, unskipped, overflowed, window):
    """apex's dynamic LossScaler.update_scale: halve on an overflow, double after `window` clean updates."""
    if overflowed:
        return scale / 2.0, 0
    unskipped += 1
    return (scale * 2.0, 0) if unskipped == window else (scale, unskipped)


_BERT_FLOW = {}


def dle_bert_flow_run():
    """10 steps of run_pretraining's --allreduce_post_accumulation flow, written here from scratch.

    3 micro-batches per step through scale_loss(..., delay_overflow_check=True) (the first two also
    with delay_unscale=True, as a client accumulating in half would), the master gradients
    pre-divided into one flat buffer with amp_C.multi_tensor_scale, all-reduced over a one-rank
    gloo group, scaled back with the overflow written into the client's own int buffer, that
    buffer in the scaler's _overflow_buf, update_scale(), then the step or the gradients dropped.
    FusedLAMB at O2 from BERT's scale 2**20, scale_window=3, a micro-batch of steps 4 and 8 blown
    up. Per step: the client's own overflow reading, whether it stepped, whether the masters
    changed, the scale before and after, the scaler's overflow count after.
    """
    if _BERT_FLOW:
        return _BERT_FLOW
    import amp_C
    import apex_C
    from apex import amp
    from apex.amp import _amp_state
    from apex.multi_tensor_apply import multi_tensor_applier
    from apex.optimizers import FusedLAMB

    one_rank_gloo()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = FusedLAMB(model.parameters(), lr=0.02)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic", scale_window=3,
                                      verbosity=0)
    _amp_state.loss_scalers[0]._loss_scale = 2.0**20
    overflow_buf = torch.zeros(1, dtype=torch.int)
    inputs, targets = torch.randn(3, 8, 16), torch.randint(0, 4, (3, 8))
    accumulation = 3
    for step in range(10):
        scale_before = _amp_state.loss_scalers[0].loss_scale()
        for micro in range(accumulation):
            loss = F.cross_entropy(model(inputs[micro].half()).float(), targets[micro])
            blow_up = 1e30 if step in (4, 8) and micro == 1 else 1.0
            with amp.scale_loss(loss * blow_up, optimizer, delay_unscale=micro < accumulation - 1,
                                delay_overflow_check=True) as scaled:
                scaled.backward()
        scaler = _amp_state.loss_scalers[0]
        loss_scale = scaler.loss_scale()
        master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
        flat = torch.empty(sum(g.numel() for g in master_grads), dtype=torch.float32)
        views = apex_C.unflatten(flat, master_grads)
        overflow_buf.zero_()
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [master_grads, views],
                             loss_scale / (dist.get_world_size() * accumulation))
        dist.all_reduce(flat)
        overflow_buf.zero_()
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [views, master_grads], 1.0 / loss_scale)
        client_saw_overflow = bool(overflow_buf.item())
        own_buf, scaler._overflow_buf = scaler._overflow_buf, overflow_buf
        skip = scaler.update_scale()
        scaler._overflow_buf = own_buf
        before = [p.detach().clone() for p in amp.master_params(optimizer)]
        if not skip:
            optimizer.step()
        else:
            for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                param.grad = None
        for param in model.parameters():
            param.grad = None
        run = _BERT_FLOW
        run.setdefault("client_overflow", []).append(client_saw_overflow)
        run.setdefault("skipped", []).append(bool(skip))
        run.setdefault("changed", []).append(
            any(not torch.equal(b, p) for b, p in zip(before, amp.master_params(optimizer))))
        run.setdefault("scale_before", []).append(scale_before)
        run.setdefault("scale_after", []).append(scaler.loss_scale())
        run.setdefault("overflows", []).append(amp.state_dict()["loss_scaler0"]["overflows"])
    return _BERT_FLOW


@check
def dle_bert_flow_updates_the_scale_once_per_step_as_apex():
    run = dle_bert_flow_run()
    assert run["client_overflow"][0] and run["client_overflow"][4] and run["client_overflow"][8], run
    assert run["skipped"] == run["client_overflow"], run
    scale, unskipped, grew = 2.0**20, 0, False
    for step, overflowed in enumerate(run["client_overflow"]):
        assert run["scale_before"][step] == scale, (step, run)
        scale, unskipped = _apex_scale_rule(scale, unskipped, overflowed, window=3)
        grew = grew or scale > run["scale_before"][step]
        assert run["scale_after"][step] == scale, (step, run)
        assert run["overflows"][step] == sum(run["client_overflow"][:step + 1]), (step, run)
    assert grew, run


@check
def dle_bert_flow_changes_the_weights_on_every_clean_step_and_nothing_on_an_overflow():
    run = dle_bert_flow_run()
    assert run["changed"] == [not overflowed for overflowed in run["client_overflow"]], run


if __name__ == "__main__":
    torch.set_num_threads(1)
    results = {}
    for name, function in CHECKS.items():
        try:
            function()
            results[name] = "ok"
        except Exception as error:  # noqa: BLE001 - reported to the test, which names the check
            results[name] = f"{type(error).__name__}: {error}"
    print(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)
