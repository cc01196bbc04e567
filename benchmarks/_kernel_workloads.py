"""The workloads of bench_kernels.py: transformer-like tensor lists and, per section, the calls to time.

Each ``*_cases`` function builds every implementation of one workload on ``copies``
independent copies of its data (see ``_timing.cache_rotation_count``) and returns
:class:`Case` objects whose ``fn`` steps through those copies one call at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Optional

import torch

# Hyper-parameters of every Adam here (AdamW, as in transformer training).
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPES = {"fp32": torch.float32, **HALF_DTYPES}
# Unscaling in place is repeated on the same grads; alternating x0.5 and x2 keeps their
# magnitude (and so the work: no denormals, no overflow) the same from call to call.
INV_SCALES = (0.5, 2.0)


@dataclasses.dataclass
class Case:
    """One implementation of one workload: the call to time and what it moves per element."""

    impl: str
    fn: Optional[Callable[[], object]]  # None: could not run here, see note
    bytes_per_element: float
    read_only: bool = False
    compare_with: tuple[str, ...] = ()  # apex_amp cases this peer's time is divided by
    note: str = ""


# ----------------------------------------------------------------------------- tensor lists


def transformer_like_shapes(total: int) -> tuple[list[tuple[int, ...]], str]:
    """Shapes of a pre-LayerNorm transformer with about ``total`` parameters, and a description.

    4 layers below 4M parameters, else 8, with d_model (a multiple of 64) chosen so that
    about 85% of the parameters sit in the layers' four matrices (qkv, out, fc1, fc2) and
    the rest in the token embedding. Every layer also has four bias vectors and two
    LayerNorms (weight and bias), so most tensors are small vectors, as in real models.
    """
    planned_layers = 4 if total < 4 * 10**6 else 8
    d = max(64, 64 * round(math.sqrt(0.85 * total / (12 * planned_layers)) / 64))
    per_layer = 12 * d * d + 13 * d
    layers = max(1, round(0.85 * total / per_layer))
    while layers > 1 and layers * per_layer + 3 * d > total:  # leave room for the embedding
        layers -= 1
    vocab = max(1, (total - layers * per_layer - 2 * d) // d)
    layer = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes = [(vocab, d)] + layer * layers + [(d,), (d,)]
    elements = sum(math.prod(s) for s in shapes)
    description = (f"d_model={d}, {layers} layers x (qkv, out, fc1, fc2 matrices + 4 biases + 2 LayerNorms), "
                   f"({vocab}, {d}) embedding, final LayerNorm: {len(shapes)} tensors, {elements:,} elements, "
                   f"smallest {d}")
    return shapes, description


def make_list(shapes, dtype, fill: str, generator: torch.Generator) -> list[torch.Tensor]:
    if fill == "zeros":
        return [torch.zeros(s, dtype=dtype) for s in shapes]
    scale = {"param": 0.02, "grad": 1e-3}[fill]
    return [(torch.randn(s, generator=generator) * scale).to(dtype) for s in shapes]


def rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    # Each timed call takes the next independent copy of the data, so a copy is cold
    # again by the time it comes back (see _timing.cache_rotation_count).
    cycle = itertools.cycle(calls)
    return lambda: next(cycle)()


def half_model_with_masters(shapes, half_dtype, gen):
    """A peer's O2 tensors: the half model, its fp32 masters (whose .grad are the fp32 master
    grads), the half grads the backward would leave, and the master grads."""
    model = make_list(shapes, half_dtype, "param", gen)
    masters = [torch.nn.Parameter(t.float()) for t in model]
    grads = make_list(shapes, half_dtype, "grad", gen)
    master_grads = [torch.zeros_like(p) for p in masters]
    for p, g in zip(masters, master_grads):
        p.grad = g
    return model, masters, grads, master_grads


def inv_scale_cycle() -> Callable[[], torch.Tensor]:
    cycle = itertools.cycle([torch.full((1,), s) for s in INV_SCALES])
    return lambda: next(cycle)


# ----------------------------------------------------------------------------- sections


def adam_cases(ops, shapes, copies, gen, deepspeed) -> list[Case]:
    def apex_call():
        params, grads = make_list(shapes, torch.float32, "param", gen), make_list(shapes, torch.float32, "grad", gen)
        m, v = make_list(shapes, torch.float32, "zeros", gen), make_list(shapes, torch.float32, "zeros", gen)
        step = torch.zeros(1)
        return lambda: ops.fused_adam_(params, grads, m, v, [], [], [], step, LR, *BETAS, EPS, WEIGHT_DECAY,
                                       True, True, None, None)

    def torch_optimizer(**flags):
        params = [torch.nn.Parameter(t) for t in make_list(shapes, torch.float32, "param", gen)]
        for p, g in zip(params, make_list(shapes, torch.float32, "grad", gen)):
            p.grad = g
        optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **flags)
        optimizer.step()  # creates the state, so the timed steps allocate nothing
        return optimizer

    def torch_fused_op(optimizer):
        params = optimizer.param_groups[0]["params"]
        states = [optimizer.state[p] for p in params]
        lists = [params, [p.grad for p in params], [s["exp_avg"] for s in states],
                 [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states]]
        return lambda: torch._fused_adamw_(*lists, lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                                           weight_decay=WEIGHT_DECAY, eps=EPS, amsgrad=False, maximize=False)

    fused = [torch_optimizer(fused=True) for _ in range(copies)]
    apex, apex_optimizer = "apex_amp fused_adam_", "apex_amp FusedAdam.step()"
    cases = [
        Case(apex, rotating([apex_call() for _ in range(copies)]), 28),
        apex_optimizer_case(apex_optimizer, ops, shapes, copies, gen),
        Case("torch AdamW(fused=True).step()", rotating([o.step for o in fused]), 28,
             compare_with=(apex, apex_optimizer)),
        # Its own optimizers: on the step row's tensors it would run right after the step row's
        # call on the same data, and at 1M find that data in the last-level cache.
        Case("torch._fused_adamw_ (bare op)", rotating([torch_fused_op(torch_optimizer(fused=True))
                                                        for _ in range(copies)]), 28, compare_with=(apex,),
             note="same op as the row above, without the optimizer's Python"),
        Case("torch AdamW(foreach=True).step()", rotating([torch_optimizer(foreach=True).step for _ in range(copies)]),
             28, compare_with=(apex,), note="unfused: several passes"),
    ]
    deepspeed_optimizer, reason = deepspeed
    if deepspeed_optimizer is None:
        cases.append(Case("DeepSpeedCPUAdam.step()", None, 28, compare_with=(apex,), note=f"not run: {reason}"))
    else:
        # One optimizer with a param group per data copy, each call stepping one group: its
        # constructor probes the CPU with py-cpuinfo, which takes seconds per instance.
        groups = []
        for _ in range(copies):
            params = [torch.nn.Parameter(t) for t in make_list(shapes, torch.float32, "param", gen)]
            for p, g in zip(params, make_list(shapes, torch.float32, "grad", gen)):
                p.grad = g
            groups.append({"params": params})
        optimizer = deepspeed_optimizer(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                        adamw_mode=True)
        optimizer.step()  # creates the state of every group
        all_groups = list(optimizer.param_groups)

        def step_group(group):
            def step():
                optimizer.param_groups = [group]
                optimizer.step()
            return step
        cases.append(Case("DeepSpeedCPUAdam.step()", rotating([step_group(g) for g in all_groups]), 28,
                          compare_with=(apex,)))
    return cases


def apex_optimizer_case(name, ops, shapes, copies, gen) -> Case:
    # The optimizer a user steps (its Python included), beside torch's optimizer step.
    import apex_amp.ops as amp_ops

    note = "the op above plus the optimizer's Python"
    if ops is not amp_ops.backend_namespace():
        return Case(name, None, 28, note=f"not run: FusedAdam uses the {amp_ops.BACKEND} backend")
    try:
        from apex_amp.optimizers import FusedAdam

        def make():
            params = [torch.nn.Parameter(t) for t in make_list(shapes, torch.float32, "param", gen)]
            for p, g in zip(params, make_list(shapes, torch.float32, "grad", gen)):
                p.grad = g
            optimizer = FusedAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adam_w_mode=True)
            optimizer.step()
            return optimizer.step
        return Case(name, rotating([make() for _ in range(copies)]), 28, note=note)
    except Exception as error:  # noqa: BLE001  (the frontend is optional for a kernel benchmark)
        return Case(name, None, 28, note=f"not run: {type(error).__name__}: {str(error)[:120]}")


def o2_cases(ops, shapes, copies, gen, half_dtype, deepspeed=(None, "not requested")) -> list[Case]:
    def apex_call():
        model = make_list(shapes, half_dtype, "param", gen)
        masters = [t.float() for t in model]
        grads = make_list(shapes, half_dtype, "grad", gen)
        m, v = make_list(shapes, torch.float32, "zeros", gen), make_list(shapes, torch.float32, "zeros", gen)
        step, found_inf, next_inv_scale = torch.zeros(1), torch.zeros(1), inv_scale_cycle()

        def o2_step():
            found_inf.zero_()
            ops.check_finite(grads, found_inf)
            ops.fused_adam_(masters, grads, m, v, model, [], [], step, LR, *BETAS, EPS, WEIGHT_DECAY, True, True,
                            next_inv_scale(), found_inf)
        return o2_step

    def torch_call():
        model, masters, grads, master_grads = half_model_with_masters(shapes, half_dtype, gen)
        optimizer = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
        optimizer.step()
        found_inf, next_inv_scale = torch.zeros(()), inv_scale_cycle()  # 0-dim, as GradScaler makes it
        # What torch.amp.GradScaler.step does for a fused optimizer: hand it found_inf, so
        # the kernel skips the step on overflow without a host sync.
        optimizer.found_inf, optimizer.grad_scale = found_inf, None

        def o2_step():
            found_inf.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, next_inv_scale())
            torch._foreach_copy_(master_grads, grads)
            optimizer.step()
            torch._foreach_copy_(model, masters)
        return o2_step

    apex = "apex_amp check_finite + fused_adam_"
    cases = [
        Case(apex, rotating([apex_call() for _ in range(copies)]), 30,
             note="check 2 + Adam (p 8, g 2, m 8, v 8, model 2)"),
        Case("torch unscale + copy + AdamW(fused).step() + copy", rotating([torch_call() for _ in range(copies)]), 44,
             compare_with=(apex,), note="unscale 4 + copy 6 + Adam 28 + copy 6"),
    ]
    cases.append(deepspeed_o2_case(shapes, copies, gen, half_dtype, deepspeed, apex))
    return cases


def deepspeed_o2_case(shapes, copies, gen, half_dtype, deepspeed, apex) -> Case:
    """DeepSpeed's CPU Adam in the O2 step: its 0.19 API writes no half parameter copy.

    DeepSpeedCPUAdam.step() of DeepSpeed 0.19 updates fp32 params from fp32 grads of the
    same dtype and nothing else (the ``fp16_param_groups`` argument of older releases is
    gone); ZeRO-Offload copies the fp32 partition into the half params afterwards and checks
    for overflow on the host. So the peer is: torch's check and unscale of the half grads, a
    copy into the fp32 grads, DeepSpeed's step unless found_inf (read on the host: free on
    CPU), and a copy into the half model: the same bytes as torch's composition.
    """
    name, note = "DeepSpeed: unscale + copy + DeepSpeedCPUAdam.step() + copy", "as torch's row, DeepSpeed's Adam"
    deepspeed_optimizer, reason = deepspeed
    if deepspeed_optimizer is None:
        return Case(name, None, 44, compare_with=(apex,), note=f"not run: {reason}")
    groups, calls = [], []
    for _ in range(copies):
        model, masters, grads, master_grads = half_model_with_masters(shapes, half_dtype, gen)
        groups.append({"params": masters})
        calls.append((model, masters, grads, master_grads))
    # One optimizer with a param group per data copy (see adam_cases: its constructor is slow).
    optimizer = deepspeed_optimizer(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    optimizer.step()
    all_groups = list(optimizer.param_groups)

    def o2_step_of(group, model, masters, grads, master_grads):
        found_inf, next_inv_scale = torch.zeros(1), inv_scale_cycle()

        def o2_step():
            found_inf.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, next_inv_scale())
            torch._foreach_copy_(master_grads, grads)
            if found_inf.item() == 0:
                optimizer.param_groups = [group]
                optimizer.step()
            torch._foreach_copy_(model, masters)
        return o2_step
    return Case(name, rotating([o2_step_of(g, *c) for g, c in zip(all_groups, calls)]), 44, compare_with=(apex,),
                note=note)


def in_cache_calls(ops, section, dtype, gen) -> tuple[Callable[[], object], Callable[[], object], int]:
    """apex_amp's kernel of ``section`` on data that stays in cache: the arithmetic bound.

    The op refuses a list that names one tensor twice, and below 64K elements it runs on
    the calling thread alone (csrc/cpu/list_parallel.h), so the bound is taken on one
    thread: two lists of one 4K- and one 28K-element set of tensors (at most 0.86 MB at
    30 B/el: in a core's 1 MB L2), each call made CALLS_PER_SAMPLE times per sample. The
    difference of the two times over the difference of their elements is the kernel's
    time per element without its fixed cost per call (Python, validation); divided by the
    thread count (two real cores: see benchmarks/README.md) it is the bound of the
    multi-threaded kernel. Returns (small call, large call, element difference per call).
    """
    half = HALF_DTYPES.get(dtype)

    def lists(n):
        shapes = [(n,)]
        params = make_list(shapes, torch.float32, "param", gen)
        grads = make_list(shapes, half or torch.float32, "grad", gen)
        m, v = make_list(shapes, torch.float32, "zeros", gen), make_list(shapes, torch.float32, "zeros", gen)
        return params, grads, m, v, [p.to(half) for p in params] if half else []

    def call(n):
        tensors = lists(n)
        step, found_inf, inv_scale = torch.zeros(1), torch.zeros(1), torch.ones(1)

        def adam():
            for _ in range(CALLS_PER_SAMPLE):
                ops.fused_adam_(*tensors, [], [], step, LR, *BETAS, EPS, WEIGHT_DECAY, True, True, None, None)

        def o2_step():
            for _ in range(CALLS_PER_SAMPLE):
                found_inf.zero_()
                ops.check_finite(tensors[1], found_inf)
                ops.fused_adam_(*tensors, [], [], step, LR, *BETAS, EPS, WEIGHT_DECAY, True, True, inv_scale, found_inf)
        return adam if section == "adam" else o2_step

    small, large = 4096, 28672
    return call(small), call(large), (large - small) * CALLS_PER_SAMPLE


CALLS_PER_SAMPLE = 64


def check_cases(ops, shapes, copies, gen, dtype) -> list[Case]:
    size = torch.empty((), dtype=dtype).element_size()

    def lists():
        return [make_list(shapes, dtype, "grad", gen) for _ in range(copies)]

    def apex_check(grads):
        found_inf = torch.zeros(1)
        return lambda: ops.check_finite(grads, found_inf)

    def unscale(op, grads):
        found_inf, next_inv_scale = torch.zeros(1), inv_scale_cycle()
        return lambda: op(grads, found_inf, next_inv_scale())

    check, apex_unscale = "apex_amp check_finite", "apex_amp unscale_"
    return [
        Case(check, rotating([apex_check(g) for g in lists()]), size, read_only=True),
        Case(apex_unscale, rotating([unscale(ops.unscale_, g) for g in lists()]), 2 * size),
        Case("torch._amp_foreach_non_finite_check_and_unscale_",
             rotating([unscale(torch._amp_foreach_non_finite_check_and_unscale_, g) for g in lists()]),
             2 * size, compare_with=(check, apex_unscale)),
    ]


def load_deepspeed_cpu_adam():
    """DeepSpeedCPUAdam with its compiled op loaded, or (None, why not)."""
    try:
        import logging
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
        CPUAdamBuilder().load()  # JIT-compiles with ninja on first use (~1-2 min), cached afterwards
    except Exception as error:  # noqa: BLE001  (any failure means: report the peer as missing)
        message = str(error).strip().splitlines()[-1:] or [""]
        if isinstance(error, ModuleNotFoundError):
            return None, "deepspeed not installed (optional; see benchmarks/README.md)"
        return None, f"{type(error).__name__}: {message[0][:160]}"
    return DeepSpeedCPUAdam, ""


# ----------------------------------------------------------------------------- the rest of the family

FAMILY = ("sgd", "adagrad", "novograd", "lamb")
# Bytes per element: SGD/Adagrad read param, grad, state and write param, state; NovoGrad reads the
# grads once more for their norms; LAMB's two passes read param, grad and both moments then write
# the moments, and read param and moments then write the param (its global norm reads the grads once more).
FAMILY_BYTES = {"sgd": 20, "adagrad": 20, "novograd": 24, "lamb": 44}


def _foreach_novograd(params, grads, exp_avgs, norms, step, lr=LR, beta1=0.95, beta2=0.98, eps=EPS,
                      weight_decay=WEIGHT_DECAY):
    """NovoGrad in torch's foreach ops (no torch optimizer has it): the peer of fused_novograd_."""
    step += 1
    new_norms = torch.stack(torch._foreach_norm(grads))
    norms.copy_(torch.sqrt(beta2 * norms * norms + (1 - beta2) * new_norms * new_norms))
    bc1, bc2 = 1 - beta1**step, math.sqrt(1 - beta2**step)
    denoms = (norms / bc2 + eps).unbind()
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    updates = torch._foreach_div(exp_avgs, bc1)
    torch._foreach_div_(updates, denoms)
    torch._foreach_add_(updates, params, alpha=weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)
    return step


def _foreach_lamb(params, grads, exp_avgs, exp_avg_sqs, step, lr=LR, max_grad_norm=1.0):
    """LAMB in torch's foreach ops (no torch optimizer has it): the peer of fused_lamb_."""
    step += 1
    global_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    clip = torch.clamp(global_norm / max_grad_norm, min=1.0)
    scaled = torch._foreach_div(grads, clip)
    torch._foreach_lerp_(exp_avgs, scaled, 1 - BETAS[0])
    torch._foreach_mul_(exp_avg_sqs, BETAS[1])
    torch._foreach_addcmul_(exp_avg_sqs, scaled, scaled, value=1 - BETAS[1])
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    denoms = torch._foreach_sqrt(torch._foreach_div(exp_avg_sqs, bc2))
    torch._foreach_add_(denoms, EPS)
    updates = torch._foreach_div(torch._foreach_div(exp_avgs, bc1), denoms)
    torch._foreach_add_(updates, params, alpha=WEIGHT_DECAY)
    ratios = [lr * pn / un for pn, un in zip(torch._foreach_norm(params), torch._foreach_norm(updates))]
    torch._foreach_mul_(updates, ratios)
    torch._foreach_sub_(params, updates)
    return step


def family_cases(ops, shapes, copies, gen, name) -> list[Case]:
    """One optimizer of the family: its fused op against torch's best equivalent, in fp32."""
    def lists():
        return (make_list(shapes, torch.float32, "param", gen), make_list(shapes, torch.float32, "grad", gen),
                make_list(shapes, torch.float32, "zeros", gen))

    apex = f"apex_amp fused_{name}_"
    bytes_per_element = FAMILY_BYTES[name]

    def apex_call():
        params, grads, state = lists()
        if name == "sgd":
            return lambda: ops.fused_sgd_(params, grads, state, [], [], [], LR, 0.9, 0.0, WEIGHT_DECAY, False, False, False,
                                          None, None)
        if name == "adagrad":
            return lambda: ops.fused_adagrad_(params, grads, state, [], [], [], LR, 1e-10, WEIGHT_DECAY, False, None, None)
        step = torch.zeros(1)
        if name == "novograd":
            norms = [torch.full((1,), -1.0) for _ in params]
            return lambda: ops.fused_novograd_(params, grads, state, norms, [], [], [], step, LR, 0.95, 0.98, EPS,
                                               WEIGHT_DECAY, True, True, False, 2, None, None)
        exp_avg_sqs = make_list(shapes, torch.float32, "zeros", gen)
        grad_norm = torch.stack(torch._foreach_norm(grads)).norm().reshape(1)
        return lambda: ops.fused_lamb_(params, grads, state, exp_avg_sqs, [], [], [], step, grad_norm, LR, *BETAS, EPS,
                                       WEIGHT_DECAY, True, True, True, 1.0, False, None, None)

    def peer_call():
        params, grads, state = lists()
        if name in ("sgd", "adagrad"):
            tensors = [torch.nn.Parameter(p) for p in params]
            for p, g in zip(tensors, grads):
                p.grad = g
            optimizer = (torch.optim.SGD(tensors, lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY, fused=True)
                         if name == "sgd" else torch.optim.Adagrad(tensors, lr=LR, weight_decay=WEIGHT_DECAY,
                                                                   fused=True))
            optimizer.step()
            return optimizer.step
        steps = [0]
        if name == "novograd":
            norms = torch.stack(torch._foreach_norm(grads))

            def step():
                steps[0] = _foreach_novograd(params, grads, state, norms, steps[0])
            return step
        exp_avg_sqs = make_list(shapes, torch.float32, "zeros", gen)

        def step():
            steps[0] = _foreach_lamb(params, grads, state, exp_avg_sqs, steps[0])
        return step

    peer = {"sgd": "torch SGD(fused=True).step()", "adagrad": "torch Adagrad(fused=True).step()",
            "novograd": "NovoGrad in torch._foreach_* ops", "lamb": "LAMB in torch._foreach_* ops"}[name]
    return [
        Case(apex, rotating([apex_call() for _ in range(copies)]), bytes_per_element),
        Case(peer, rotating([peer_call() for _ in range(copies)]), bytes_per_element, compare_with=(apex,),
             note="no fused torch equivalent: several passes" if name in ("novograd", "lamb") else ""),
    ]
