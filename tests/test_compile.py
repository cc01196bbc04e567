"""torch.compile with amp: compiled models train like eager ones, the fused ops and FusedAdam.step trace whole.

Compiling is slow on a small CPU: the first inductor compile of a model's
forward and backward spends tens of seconds in the C++ compiler (cold cache).
The default suite therefore traces models with ``aot_eager`` (dynamo,
functionalization and AOT autograd: everywhere amp's hooks and O1's kernels
meet the compiler) and compiles with inductor only the fused-op graphs, whose
ops run as extern kernels; the inductor model runs are marked slow.

Tolerances: ``aot_eager`` runs the same aten kernels as eager, so losses agree
to fp32 rounding (rtol 1e-6). Inductor fuses the elementwise ops and computes
half-precision intermediates in fp32, so its losses differ from eager by a few
units in the last place of the half dtype: rtol 2e-2 over 5 steps (bf16 has 8
significant bits, 2**-8 = 0.4%; fp16 has 11). The weights after those steps
may differ by a fraction of Adam's step size (lr 1e-2, about the size of every
update) where a gradient element is near zero and its rounding flips the
update's direction: atol 2e-3.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn

from apex_amp import amp, ops
from apex_amp.amp import casting
from apex_amp.amp.casting.policy import STATE as O1_STATE
from apex_amp.optimizers import FusedAdam

INF = float("inf")
STEPS = 5
LOSS_RTOL = {"aot_eager": 1e-6, "inductor": 2e-2}
WEIGHT_ATOL = {"aot_eager": 1e-8, "inductor": 2e-3}


@pytest.fixture(autouse=True)
def _fresh_compiler_and_o1_off():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    if casting.is_active():
        casting.deactivate()


@pytest.fixture
def ops_backend(backend, monkeypatch):
    """apex_amp.ops (and so FusedAdam and the loss scaler) calling ``backend``'s implementation."""
    monkeypatch.setattr(ops, "_ops", ops.backend_namespace(backend))
    return backend


class TinyNet(nn.Module):
    """Linear, LayerNorm, GELU, Linear: half matmuls and an fp32 norm under O1."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.norm(self.inp(x))))


def batch(seed: int, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def train(level, half_dtype, backend=None, steps=STEPS, inject_at=None, width=16):
    """Train TinyNet with FusedAdam; ``backend`` compiles the model after initialize.

    Returns the losses, the logits' dtype, the final fp32 weights, which steps were skipped
    and the number of compiled frames (after the first step, after the last).
    """
    torch.manual_seed(0)
    model = TinyNet(width)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, optimizer, opt_level=level, half_dtype=half_dtype, verbosity=0)
    counter = None
    forward = model
    if backend is not None:
        counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
        forward = torch.compile(model, backend=counter)
    x, y = batch(0)
    losses, skipped = [], []
    for step in range(steps):
        optimizer.zero_grad()
        logits = forward(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            if step == inject_at:
                next(model.parameters()).grad.view(-1)[0] = INF
        optimizer.step()
        losses.append(loss.item())
        skipped.append(amp.step_was_skipped(optimizer))
        if step == 0 and counter is not None:
            first_step_frames = counter.frame_count
    weights = [p.detach().float().clone() for p in amp.master_params(optimizer)]
    if casting.is_active():
        casting.deactivate()
    return {"losses": losses, "logits_dtype": logits.dtype, "weights": weights, "skipped": skipped,
            "frames": None if counter is None else (first_step_frames, counter.frame_count)}


def assert_compiled_matches_eager(level, half_dtype, backend, width=16):
    eager = train(level, half_dtype, width=width, inject_at=2)
    torch._dynamo.reset()
    compiled = train(level, half_dtype, backend, width=width, inject_at=2)
    rtol = LOSS_RTOL[backend]
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=rtol, atol=0)
    assert compiled["logits_dtype"] == eager["logits_dtype"]
    assert compiled["skipped"] == eager["skipped"] == [step == 2 for step in range(STEPS)]
    for got, want in zip(compiled["weights"], eager["weights"]):
        torch.testing.assert_close(got, want, rtol=rtol, atol=WEIGHT_ATOL[backend])
    assert compiled["losses"][-1] < compiled["losses"][0]
    # Compiled at the first step only: no recompiles from amp's hooks, the O1
    # switches flipped around backward and step, the skipped step or the updated weights.
    first_step_frames, all_frames = compiled["frames"]
    assert all_frames == first_step_frames
    # torch.compile(model) runs module hooks outside the model's frame, so O2's
    # input and output casts (forward hooks) are frames of their own; O1 has no hooks.
    assert all_frames == (1 if level == "O1" else 3)
    return eager, compiled


# ---- compiled models --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("level", "half_dtype"),
    [("O1", torch.bfloat16), ("O2", torch.bfloat16), ("O1", torch.float16), ("O2", torch.float16)],
    ids=["O1-bf16", "O2-bf16", "O1-fp16", "O2-fp16"],
)
def test_traced_model_trains_like_eager(level, half_dtype):
    eager, _ = assert_compiled_matches_eager(level, half_dtype, "aot_eager")
    expected = half_dtype if level == "O1" else torch.float32  # O2 casts the model's outputs to fp32
    assert eager["logits_dtype"] == expected


@pytest.mark.slow
@pytest.mark.parametrize(
    ("level", "half_dtype", "width"),
    [("O1", torch.bfloat16, 16), ("O2", torch.bfloat16, 16), ("O1", torch.float16, 4), ("O2", torch.float16, 4)],
    ids=["O1-bf16", "O2-bf16", "O1-fp16", "O2-fp16"],
)
def test_inductor_compiled_model_trains_like_eager(level, half_dtype, width):
    assert_compiled_matches_eager(level, half_dtype, "inductor", width=width)


def test_o2_casts_trace_into_the_model_graph_with_wrap_top_frame():
    # With dynamo's wrap_top_frame the hooks are traced with the forward: one graph.
    with torch._dynamo.config.patch(wrap_top_frame=True):
        compiled = train("O2", torch.bfloat16, "aot_eager", steps=2)
    eager = train("O2", torch.bfloat16, steps=2)
    assert compiled["frames"] == (1, 1)
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=LOSS_RTOL["aot_eager"], atol=0)


def o1_probe(weight, cell, x):
    # Ops whose O1 rule differs from torch's own CPU autocast (softmax, log_softmax,
    # sum, cumsum stay half there; einsum, mv and RNN cells are not cast), a Python-level
    # rule (F.normalize) and torch's own half ops (linear).
    hidden = nn.functional.linear(x, weight)
    return (
        hidden,
        torch.softmax(hidden, -1),
        nn.functional.log_softmax(hidden, -1),
        hidden.sum(),
        torch.cumsum(hidden, 0),
        nn.functional.normalize(hidden, dim=-1),
        torch.einsum("ij,jk->ik", x, weight),
        torch.mv(weight, x[0]),
        cell(x),
    )


def test_o1_rules_hold_inside_a_compiled_graph_without_graph_breaks():
    torch.manual_seed(0)
    weight, cell, x = nn.Parameter(torch.randn(8, 8)), nn.GRUCell(8, 8), torch.randn(4, 8)
    casting.activate(torch.bfloat16)
    O1_STATE.cache.cast(weight, torch.bfloat16)  # a cached eager cast must not confuse the tracer
    eager = o1_probe(weight, cell, x)
    explanation = torch._dynamo.explain(o1_probe)(weight, cell, x)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    compiled = torch.compile(o1_probe, backend="aot_eager", fullgraph=True)(weight, cell, x)
    assert [t.dtype for t in eager] == [torch.bfloat16, *[torch.float32] * 5, *[torch.bfloat16] * 3]
    assert [t.dtype for t in compiled] == [t.dtype for t in eager]
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Gradients flow through the casts traced into the graph (the weight cache is bypassed).
    sum(t.float().sum() for t in compiled).backward()
    assert weight.grad is not None and weight.grad.dtype == torch.float32


def test_graph_traced_under_o1_is_not_reused_once_o1_is_off():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    probe = torch.compile(lambda x, w: torch.softmax(x @ w, -1) + (x @ w), backend=counter)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    casting.activate(torch.bfloat16)
    assert probe(x, w).dtype == torch.float32  # softmax fp32 (O1), promoted with the bf16 matmul
    with amp.disable_casts():
        torch.testing.assert_close(probe(x, w), torch.softmax(x @ w, -1) + x @ w, rtol=0, atol=0)
    casting.deactivate()
    torch.testing.assert_close(probe(x, w), torch.softmax(x @ w, -1) + x @ w, rtol=0, atol=0)
    # Autocast state is guarded: O1 on, casts disabled (autocast cache still off), O1 off.
    assert counter.frame_count == 3


# ---- fused ops and FusedAdam.step ---------------------------------------------------------------
def amp_step(model_grads, master_grads, stash, masters, exp_avgs, exp_avg_sqs, model_params, step,
             scale, growth_tracker, hysteresis_tracker, found_inf, inv_scale, one):
    """What one O2 step does with the fused ops: unscale into the masters, accumulate, clip, Adam, scale.

    Only apex_amp ops: inductor then generates no kernel of its own (no C++ compile, seconds not minutes).
    """
    ops.check_finite(model_grads, found_inf)
    ops.scale_(model_grads, master_grads, inv_scale, found_inf)
    ops.axpby_(stash, master_grads, one, 1.0, found_inf)
    ops.unscale_(stash, found_inf, inv_scale)
    total_norm, _ = ops.l2norm(master_grads)
    ops.fused_adam_(masters, master_grads, exp_avgs, exp_avg_sqs, step, lr=1e-2, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.01, model_params=model_params, found_inf=found_inf)
    ops.update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, growth_interval=2)
    return total_norm


def amp_step_state(poison: bool):
    g = torch.Generator().manual_seed(3)
    shapes = ((6, 5), (5,), (3,))
    masters = [torch.randn(s, generator=g) for s in shapes]
    model_grads = [(torch.randn(s, generator=g) * 256).to(torch.bfloat16) for s in shapes]
    if poison:
        model_grads[1][2] = INF
    return [
        model_grads, [torch.empty(s) for s in shapes], [torch.randn(s, generator=g) for s in shapes],
        masters, [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes],
        [m.to(torch.bfloat16) for m in masters], torch.zeros(1), torch.full((1,), 256.0),
        torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.zeros(1),
        torch.full((1,), 1 / 256.0), torch.ones(1),
    ]


def assert_same_state(got, want):
    for got_item, want_item in zip(got, want):
        for g, w in zip(*((x if isinstance(x, list) else [x]) for x in (got_item, want_item))):
            assert torch.equal(g, w)


def test_fused_ops_trace_into_one_graph_and_compile_with_inductor(ops_backend):
    explanation = torch._dynamo.explain(amp_step)(*amp_step_state(poison=False))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(amp_step, backend=counter, fullgraph=True)
    for poison in (False, True):  # a clean step, then a skipped one, through the same graph
        eager_state, compiled_state = amp_step_state(poison), amp_step_state(poison)
        eager_norm = amp_step(*eager_state)
        compiled_norm = compiled(*compiled_state)
        if not poison:
            torch.testing.assert_close(compiled_norm, eager_norm, rtol=0, atol=0)
        assert_same_state(compiled_state, eager_state)
        assert compiled_state[11].item() == float(poison)
        masters_untouched = all(torch.equal(a, b) for a, b in zip(compiled_state[3], amp_step_state(poison)[3]))
        assert masters_untouched == poison
        assert compiled_state[8].item() == (128.0 if poison else 256.0)
    assert counter.frame_count == 1


def train_with_compiled_step(level, backend, half_dtype=torch.bfloat16, steps=4, inject_at=1):
    """FusedAdam with ``optimizer.step`` compiled (fullgraph) under ``level`` (None: no amp)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    if level is not None:
        amp.initialize(model, optimizer, opt_level=level, half_dtype=half_dtype, loss_scale=128.0, verbosity=0)
    counter = None
    step = optimizer.step
    if backend is not None:
        counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
        step = torch.compile(optimizer.step, backend=counter, fullgraph=True)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    losses, skipped = [], []
    for i in range(steps):
        optimizer.zero_grad()
        loss = model(x).float().pow(2).mean()
        if level is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                if i == inject_at:
                    model[0].weight.grad[0, 0] = INF
        if level == "O1":
            O1_STATE.cache.cast(model[0].weight, torch.bfloat16)  # an entry for the post-hook to drop
        step()
        losses.append(loss.item())
        if level is not None:
            skipped.append(amp.step_was_skipped(optimizer))
        if level == "O1":  # the pre/post hooks turned casting off and back on, and cleared the cache
            assert len(O1_STATE.cache) == 0
            assert casting.is_active() and casting.carrier.is_on() and not torch.is_autocast_enabled("cpu")
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in (amp.master_params(optimizer) if level else model.parameters())]
    if casting.is_active():
        casting.deactivate()
    return losses, skipped, weights, masters, optimizer.param_groups[0], counter


@pytest.mark.parametrize("level", [None, "O1", "O2"], ids=["no-amp", "O1", "O2"])
def test_fused_adam_step_compiles_to_one_graph_and_matches_eager(ops_backend, level):
    eager = train_with_compiled_step(level, None)
    torch._dynamo.reset()
    compiled = train_with_compiled_step(level, "aot_eager")
    assert compiled[0] == eager[0]  # losses, bit for bit: the same op calls
    assert compiled[1] == eager[1]
    if level is not None:
        assert compiled[1] == [False, True, False, False]  # the injected inf skipped step 1 on the device
    for index in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(compiled[index], eager[index]))
    assert float(compiled[4]["step"]) == float(eager[4]["step"]) == (4.0 if level is None else 3.0)
    # The first step creates the optimizer state, which changes the traced code once.
    assert compiled[5].frame_count <= 2


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fused_adam_step_compiles_with_inductor(level):
    eager = train_with_compiled_step(level, None)
    torch._dynamo.reset()
    compiled = train_with_compiled_step(level, "inductor")
    assert compiled[0] == eager[0] and compiled[1] == eager[1]
    for index in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(compiled[index], eager[index]))
