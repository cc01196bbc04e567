"""A client that uses apex the way NVIDIA's DeepLearningExamples BERT does, for the compat venv's checks.

Written for these tests (no code of DeepLearningExamples in it), after what its
``optimization.py`` and ``run_pretraining.py`` do with apex at their last apex.amp commits:

- every apex name is bound when this module is imported: ``amp_C``'s two LAMB stages, its L2
  norm and scale kernels, ``apex_C`` (flatten/unflatten), ``flat_dist_call``, ``_amp_state``,
  ``FusedLAMB``;
- :class:`TwoStageLAMB` runs LAMB as DLE's ``BertLAMB`` does: the global gradient norm and the
  parameter norms from ``multi_tensor_l2norm``, stage 1 (Adam's update plus decay), the update
  norms, stage 2 (the update with each tensor's trust ratio);
- :func:`take_optimizer_step` is the ``--allreduce_post_accumulation`` step: the fp32 master
  gradients rescaled into one flat buffer (``apex_C.unflatten`` views, ``multi_tensor_scale``
  with the loss scale over ranks times micro-batches), one ``all_reduce``, unscaled back with
  the overflow written into the client's own int buffer, that buffer put in the loss scaler's
  ``_overflow_buf``, ``update_scale()``, then the step or, on an overflow, the gradients dropped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import amp_C
import apex_C
from apex import amp
from apex.amp import _amp_state
from apex.multi_tensor_apply import multi_tensor_applier
from apex.optimizers import FusedLAMB  # noqa: F401  bound at import as DLE does; the caller builds it
from apex.parallel.distributed import flat_dist_call

l2_norm = amp_C.multi_tensor_l2norm
compute_update = amp_C.multi_tensor_lamb_stage1_cuda
apply_update = amp_C.multi_tensor_lamb_stage2_cuda
scale_kernel = amp_C.multi_tensor_scale


class TwoStageLAMB(torch.optim.Optimizer):
    """LAMB on fp32 parameters in two amp_C calls, the norms taken in between (DLE's BertLAMB's order)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.max_grad_norm = max_grad_norm
        self.steps_taken = 0
        self._overflow_buf = torch.zeros(1, dtype=torch.int, device=self.param_groups[0]["params"][0].device)

    @torch.no_grad()
    def step(self):
        grads_of_all = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        global_norm = multi_tensor_applier(l2_norm, self._overflow_buf, [grads_of_all], False)[0]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            grads, params, exp_avgs, exp_avg_sqs, updates = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                    state["update"] = torch.empty_like(p)
                for target, tensor in zip((grads, params, exp_avgs, exp_avg_sqs, updates),
                                          (p.grad, p, state["exp_avg"], state["exp_avg_sq"], state["update"])):
                    target.append(tensor)
            if not params:
                continue
            decays = torch.full((len(params),), float(group["weight_decay"]), device=params[0].device)
            param_norms = multi_tensor_applier(l2_norm, self._overflow_buf, [params], True)[1]
            multi_tensor_applier(compute_update, self._overflow_buf, [grads, params, exp_avgs, exp_avg_sqs, updates],
                                 decays, self.steps_taken, beta1, beta2, group["eps"], global_norm,
                                 self.max_grad_norm)
            update_norms = multi_tensor_applier(l2_norm, self._overflow_buf, [updates], True)[1]
            multi_tensor_applier(apply_update, self._overflow_buf, [params, updates], param_norms, update_norms,
                                 group["lr"], group["weight_decay"], False)
        self.steps_taken += 1


def broadcast_initial_weights(model: torch.nn.Module) -> None:
    """Every rank starts from rank 0's weights (run_pretraining's set-up without DDP)."""
    flat_dist_call([param.data for param in model.parameters()], dist.broadcast, (0,))


def take_optimizer_step(optimizer, model, overflow_buf: torch.Tensor, accumulation_steps: int) -> bool:
    """All-reduce the accumulated master gradients by hand, account the overflow, step or drop; True if stepped."""
    scaler = _amp_state.loss_scalers[0]
    loss_scale = scaler.loss_scale()
    master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
    flat_raw = torch.empty(sum(g.numel() for g in master_grads), dtype=torch.float32, device=master_grads[0].device)
    views = apex_C.unflatten(flat_raw, master_grads)
    overflow_buf.zero_()
    scale_kernel(65536, overflow_buf, [master_grads, views], loss_scale / (dist.get_world_size() * accumulation_steps))
    dist.all_reduce(flat_raw)
    overflow_buf.zero_()
    scale_kernel(65536, overflow_buf, [views, master_grads], 1.0 / loss_scale)
    own_buf = scaler._overflow_buf
    scaler._overflow_buf = overflow_buf
    had_overflow = scaler.update_scale()
    scaler._overflow_buf = own_buf
    if not had_overflow:
        optimizer.step()
    elif _amp_state.opt_properties.master_weights:
        for param in optimizer._amp_stash.all_fp32_from_fp16_params:
            param.grad = None
    for param in model.parameters():
        param.grad = None
    return not had_overflow
