"""O2 as code written for apex runs it: how it clears gradients, GAN training, a Trainer-like loop.

Written from the patterns of real clients (apex's DCGAN example, the Hugging Face
Trainer's apex path), not from amp's own assumptions. Each loop is compared
with a plain fp32 PyTorch loop over the same data that skips the step amp
must skip. fp16 models stay tiny (fp16 matrix products are slow on CPU).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from apex_amp import amp
from apex_amp.optimizers import FusedAdam

STEPS = 4
CLEARING_STYLES = ("optimizer", "optimizer-zeros", "model", "model-zeros", "grad-none")


def clear_grads(style: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if style == "optimizer":
        optimizer.zero_grad()
    elif style == "optimizer-zeros":
        optimizer.zero_grad(set_to_none=False)
    elif style == "model":
        model.zero_grad()
    elif style == "model-zeros":
        model.zero_grad(set_to_none=False)
    elif style == "grad-none":
        for param in model.parameters():
            param.grad = None
    else:
        raise ValueError(style)


def bn_model(seed: int = 0) -> nn.Module:
    # BatchNorm stays fp32 under O2: its parameters are their own masters ("direct" parameters).
    # No bias before it (its true gradient is 0, and Adam would turn rounding noise into steps).
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "SGD":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "Adam":
        return torch.optim.Adam(params, lr=1e-2)
    return FusedAdam(params, lr=1e-2)


def batches(seed: int = 1, n: int = STEPS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def loss_multiplier(step: int, overflow_at) -> float:
    # 1e6 on top of the default scale 65536 overflows fp16 gradients; the fp32 reference skips that step.
    return 1e6 if step == overflow_at else 1.0


def fp32_reference(kind: str, skip: set, data, model_fn=bn_model) -> list[torch.Tensor]:
    model = model_fn()
    optimizer = make_optimizer(kind, model.parameters())
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step not in skip:
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def o2_fp16_run(kind: str, style: str, where: str, overflow_at, data, model_fn=bn_model):
    model = model_fn()
    optimizer = make_optimizer(kind, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    skipped = []
    for step, (x, y) in enumerate(data):
        if where == "before_forward":
            clear_grads(style, model, optimizer)
        loss = F.cross_entropy(model(x), y) * loss_multiplier(step, overflow_at)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        skipped.append(amp.step_was_skipped(optimizer))
        if where == "after_step":
            clear_grads(style, model, optimizer)
    return [p.detach().clone() for p in amp.master_params(optimizer)], skipped, amp.state_dict()["loss_scaler0"]


@pytest.mark.parametrize("overflow_at", [None, 0, 2], ids=["no-overflow", "overflow-at-0", "overflow-at-2"])
@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("where", ["before_forward", "after_step"])
@pytest.mark.parametrize("style", CLEARING_STYLES)
def test_every_way_of_clearing_gradients_trains_like_fp32_with_the_overflowed_step_skipped(
    style, where, kind, overflow_at, one_thread
):
    data = batches()
    masters, skipped, scaler = o2_fp16_run(kind, style, where, overflow_at, data)
    assert skipped == [step == overflow_at for step in range(STEPS)]
    # Every skip comes from a reported overflow, and the counters say so.
    assert scaler["overflows"] == (overflow_at is not None)
    assert scaler["loss_scale"] == (32768.0 if overflow_at is not None else 65536.0)
    clean_since = STEPS if overflow_at is None else STEPS - 1 - overflow_at
    assert scaler["unskipped"] == clean_since
    expected = fp32_reference(kind, {overflow_at}, data)
    for got, want in zip(masters, expected):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_every_way_of_clearing_gradients_gives_bitwise_the_same_masters(kind, one_thread):
    data = batches()
    runs = {
        (style, where): o2_fp16_run(kind, style, where, 1, data)[0]
        for style, where in itertools.product(CLEARING_STYLES, ["before_forward", "after_step"])
    }
    first = next(iter(runs.values()))
    for key, masters in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(masters, first)), key


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
def test_never_clearing_a_model_without_direct_params_trains_like_clearing(kind, one_thread):
    # Under O2 every parameter of this model has a master, and each step consumes the masters'
    # gradients: a loop that never clears anything trains exactly like one that does.
    def half_only(seed=0):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

    data = batches()
    model = half_only()
    optimizer = make_optimizer(kind, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    for step, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x), y) * loss_multiplier(step, 1)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    never = [p.detach().clone() for p in amp.master_params(optimizer)]
    cleared = o2_fp16_run(kind, "optimizer", "before_forward", 1, data, model_fn=half_only)[0]
    assert all(torch.equal(a, b) for a, b in zip(never, cleared))


def test_issue_reproducer_skips_only_the_overflowed_step_and_matches_fp32(one_thread):
    torch.manual_seed(0)
    net = nn.Linear(8, 1)
    reference = nn.Linear(8, 1)
    reference.load_state_dict(net.state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2)
    net, opt = amp.initialize(net, opt, opt_level="O2", verbosity=0)
    g = torch.Generator().manual_seed(3)
    skipped = []
    for it in range(4):
        x = torch.randn(16, 8, generator=g)
        net.zero_grad()
        loss = net(x).float().pow(2).mean() * (1e6 if it == 0 else 1.0)
        with amp.scale_loss(loss, opt) as scaled_loss:
            scaled_loss.backward()
        opt.step()
        skipped.append(amp.step_was_skipped(opt))
        ref_opt.zero_grad()
        reference(x).pow(2).mean().backward()
        if it != 0:
            ref_opt.step()
    assert skipped == [True, False, False, False]
    for got, want in zip(amp.master_params(opt), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)


# ---- a GAN as apex's DCGAN example trains it --------------------------------------------------


def gan(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(4, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 6), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return generator, discriminator


def train_gan(kind: str, use_amp: bool, overflow_at: int, iterations: int = 5):
    """apex's DCGAN loop: netD.zero_grad(), two D losses (loss_id 0, 1), netG.zero_grad(), G's loss (2)."""
    net_g, net_d = gan()
    opt_d = make_optimizer(kind, net_d.parameters())
    opt_g = make_optimizer(kind, net_g.parameters())
    if use_amp:
        [net_d, net_g], [opt_d, opt_g] = amp.initialize([net_d, net_g], [opt_d, opt_g], opt_level="O2",
                                                        num_losses=3, verbosity=0)

    def backward(loss, optimizer, loss_id):
        if use_amp:
            with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()

    g = torch.Generator().manual_seed(7)
    skipped_d, skipped_g, d_params = [], [], []
    for it in range(iterations):
        real = torch.rand(8, 6, generator=g) * 2 - 1
        noise = torch.randn(8, 4, generator=g)
        net_d.zero_grad()
        out = net_d(real).float()
        err_real = F.binary_cross_entropy_with_logits(out, torch.ones_like(out))
        if it == overflow_at:
            err_real = err_real * (1e6 if use_amp else 1.0)
        backward(err_real, opt_d, 0)
        fake = net_g(noise)
        out = net_d(fake.detach()).float()
        backward(F.binary_cross_entropy_with_logits(out, torch.zeros_like(out)), opt_d, 1)
        if use_amp or it != overflow_at:
            opt_d.step()
        skipped_d.append(use_amp and amp.step_was_skipped(opt_d))
        net_g.zero_grad()
        out = net_d(fake).float()  # G's loss runs back through D too: gradients D's optimizer must not use
        backward(F.binary_cross_entropy_with_logits(out, torch.ones_like(out)), opt_g, 2)
        opt_g.step()
        skipped_g.append(use_amp and amp.step_was_skipped(opt_g))
        d_params.append([p.detach().clone() for p in (amp.master_params(opt_d) if use_amp else net_d.parameters())])
    g_params = [p.detach().clone() for p in (amp.master_params(opt_g) if use_amp else net_g.parameters())]
    return skipped_d, skipped_g, d_params, g_params


@pytest.mark.parametrize("kind", ["Adam", "FusedAdam"])
def test_gan_with_model_zero_grad_keeps_training_both_nets_after_an_overflow(kind, one_thread):
    skipped_d, skipped_g, d_params, g_params = train_gan(kind, use_amp=True, overflow_at=1)
    assert skipped_d == [False, True, False, False, False]
    assert skipped_g == [False] * 5
    state = amp.state_dict()
    assert [state[f"loss_scaler{i}"]["loss_scale"] for i in range(3)] == [32768.0, 65536.0, 65536.0]
    assert [state[f"loss_scaler{i}"]["overflows"] for i in range(3)] == [1, 0, 0]
    # D is unchanged by the skipped step and changes at every later one.
    assert all(torch.equal(a, b) for a, b in zip(d_params[0], d_params[1]))
    for before, after in zip(d_params[1:], d_params[2:]):
        assert not all(torch.equal(a, b) for a, b in zip(before, after))
    _, _, ref_d, ref_g = train_gan(kind if kind == "Adam" else "Adam", use_amp=False, overflow_at=1)
    for got, want in zip(d_params[-1] + g_params, ref_d[-1] + ref_g):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-3)


# ---- a Trainer-like loop (Hugging Face Trainer's apex path) ----------------------------------------


def lm_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 5))


def trainer_loop(kind: str, half_dtype, use_amp: bool, inf_at: int, steps: int = 6, accumulate: int = 2):
    """model.zero_grad() after each step, clipping amp.master_params, an LR scheduler stepped every step."""
    model = lm_model()
    optimizer = make_optimizer(kind, model.parameters())
    if use_amp:
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", half_dtype=half_dtype, verbosity=0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * steps))
    g = torch.Generator().manual_seed(5)
    norms, skipped = [], []
    model.zero_grad()
    for step in range(steps):
        for micro in range(accumulate):
            x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
            loss = F.cross_entropy(model(x).float(), y) / accumulate
            if step == inf_at and micro == 0:
                loss = loss * (float("inf") if use_amp else 0.0)  # the reference drops that micro-batch's step anyway
            if use_amp:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
        params = amp.master_params(optimizer) if use_amp else model.parameters()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
        if use_amp or step != inf_at:
            optimizer.step()
            norms.append(float(norm))
        skipped.append(use_amp and amp.step_was_skipped(optimizer))
        scheduler.step()  # the Trainer steps its scheduler whether or not apex skipped the step
        model.zero_grad()
    params = amp.master_params(optimizer) if use_amp else model.parameters()
    return [p.detach().clone() for p in params], norms, skipped


@pytest.mark.parametrize("half_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["FusedAdam", "Adam", "SGD"])
def test_trainer_like_loop_matches_fp32_with_the_overflowed_step_skipped(kind, half_dtype, one_thread):
    masters, norms, skipped = trainer_loop(kind, half_dtype, use_amp=True, inf_at=2)
    reference, ref_norms, _ = trainer_loop("Adam" if kind == "FusedAdam" else kind, None, use_amp=False, inf_at=2)
    assert skipped == [False, False, True, False, False, False]
    # The norms clipped on the masters are each step's own gradients, not a running sum.
    del norms[2]  # the skipped step's norm is inf
    rtol = 2e-2 if half_dtype == torch.float16 else 5e-2
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=rtol, atol=0)
    for got, want in zip(masters, reference):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol / 10)
