"""Scale-collapse guard: a warning, then a RuntimeError, when the scale sits at its floor and still overflows.

An overflow "at the floor" is one after which a dynamic scale is at
``min_loss_scale`` (or any overflow of a static scale): loss scaling can no
longer be the cause. ``collapse_warn_steps`` of them in a row log one
WARNING; ``collapse_raise_steps`` in a row make the next ``scale_loss``
raise. A clean step resets the count. Also: the scale's floor must be a
normal float32, and the count survives a checkpoint.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from apex_amp import amp

COLLAPSE = "Loss scale collapse"
TINY = torch.finfo(torch.float32).tiny


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def make_run(**options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"opt_level": "O2", "verbosity": 0, **options}
    return amp.initialize(model, optimizer, **options)


def step(model, optimizer, overflow: bool) -> None:
    """One training step; ``overflow`` multiplies the loss by inf, which makes every gradient non-finite."""
    optimizer.zero_grad()
    loss = model(torch.randn(8, 4)).float().pow(2).mean()
    if overflow:
        loss = loss * math.inf
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert amp.step_was_skipped(optimizer) == overflow


def assert_scale_loss_raises(model, optimizer, match: str) -> None:
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=match):
        with amp.scale_loss(model(torch.randn(8, 4)).float().sum(), optimizer) as scaled_loss:
            scaled_loss.backward()


def collapse_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and COLLAPSE in r.getMessage()]


def test_every_step_overflowing_warns_once_at_k_then_raises_at_m(caplog):
    # 65536 -> 4096 takes 4 overflows; the 4th leaves the scale at the floor: streak 1.
    model, optimizer = make_run(min_loss_scale=4096.0, collapse_warn_steps=5, collapse_raise_steps=9)
    caplog.set_level(logging.WARNING, logger="apex_amp")
    streak_at = {n: max(n - 3, 0) for n in range(1, 13)}  # overflows so far -> floor streak
    for n in range(1, 12):
        step(model, optimizer, overflow=True)
        assert amp.loss_scale() == max(65536.0 / 2**n, 4096.0)  # never below the floor
        assert len(collapse_warnings(caplog)) == (1 if streak_at[n] >= 5 else 0), f"after overflow {n}"
    (warning,) = collapse_warnings(caplog)
    assert "5 gradient overflows in a row for loss scaler 0" in warning
    assert "min_loss_scale=4096.0" in warning
    for cause in ("NaN or inf in the input data", "loss computed in half precision", "learning rate too high"):
        assert cause in warning
    assert "raises RuntimeError at 9 in a row" in warning

    # Overflow 12 is the 9th at the floor: its step is skipped as usual, the next scale_loss raises.
    step(model, optimizer, overflow=True)
    weights = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):  # and keeps raising
        assert_scale_loss_raises(model, optimizer, r"Loss scale collapse: 9 gradient overflows in a row.*stopped training")
        optimizer.step()  # no gradients: changes nothing
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    # State can still be read and saved.
    assert amp.loss_scale() == 4096.0
    assert amp.state_dict()["loss_scaler0"]["floor_overflow_streak"] == 9
    assert len(collapse_warnings(caplog)) == 1


def test_intermittent_overflows_at_the_floor_never_warn(caplog):
    # The floor is the initial scale: every overflow is at the floor from the start.
    model, optimizer = make_run(min_loss_scale=65536.0, collapse_warn_steps=3, collapse_raise_steps=3)
    caplog.set_level(logging.WARNING, logger="apex_amp")
    pattern = [True, True, False] * 15  # two in a row at most
    for overflow in pattern:
        step(model, optimizer, overflow)
        assert amp.loss_scale() >= 65536.0
    assert not collapse_warnings(caplog)
    assert amp.state_dict()["loss_scaler0"]["overflows"] == 30


def test_a_clean_step_resets_the_count(caplog):
    model, optimizer = make_run(min_loss_scale=65536.0, collapse_warn_steps=4, collapse_raise_steps=6)
    caplog.set_level(logging.WARNING, logger="apex_amp")
    for _ in range(3):
        for _ in range(5):  # past the warning, one short of the error
            step(model, optimizer, overflow=True)
        assert amp.state_dict()["loss_scaler0"]["floor_overflow_streak"] == 5
        step(model, optimizer, overflow=False)
        assert amp.state_dict()["loss_scaler0"]["floor_overflow_streak"] == 0
    # Each run of 5 warned once at its 4th overflow; none reached 6.
    assert len(collapse_warnings(caplog)) == 3


def test_overflows_above_the_floor_do_not_count(caplog):
    # From 2**16 down to the floor 1.0 takes 16 overflows; only the 16th leaves the scale at the floor.
    model, optimizer = make_run(collapse_warn_steps=2, collapse_raise_steps=None)
    caplog.set_level(logging.WARNING, logger="apex_amp")
    for _ in range(16):
        step(model, optimizer, overflow=True)
    assert amp.loss_scale() == 1.0
    assert not collapse_warnings(caplog)
    step(model, optimizer, overflow=True)
    assert len(collapse_warnings(caplog)) == 1


@pytest.mark.parametrize(
    "options",
    [
        dict(opt_level="O3", half_dtype=torch.bfloat16, skip_nonfinite=True),  # static 1.0, checks on
        dict(opt_level="O2", half_dtype=torch.bfloat16),  # bf16's default: static 1.0, checks on
        dict(opt_level="O2", loss_scale=128.0),  # a static scale above 1
    ],
    ids=["O3-skip_nonfinite", "O2-bf16", "O2-static-128"],
)
def test_a_static_scale_counts_every_skipped_step(caplog, options):
    model, optimizer = make_run(collapse_warn_steps=3, collapse_raise_steps=5, **options)
    caplog.set_level(logging.WARNING, logger="apex_amp")
    for n in range(1, 5):
        step(model, optimizer, overflow=True)
        assert len(collapse_warnings(caplog)) == (1 if n >= 3 else 0)
    (warning,) = collapse_warnings(caplog)
    scale = options.get("loss_scale", 1.0)
    assert f"with the static loss scale {scale}" in warning
    if scale > 1.0:
        assert "use loss_scale='dynamic'" in warning
    else:
        assert "loss scaling is not the cause" in warning
    step(model, optimizer, overflow=True)
    assert_scale_loss_raises(model, optimizer, "5 gradient overflows in a row")


def test_the_warning_is_logged_at_verbosity_zero_and_only_once_without_a_limit(caplog):
    model, optimizer = make_run(min_loss_scale=65536.0, collapse_warn_steps=2, collapse_raise_steps=None, verbosity=0)
    caplog.set_level(logging.WARNING, logger="apex_amp")
    for _ in range(30):
        step(model, optimizer, overflow=True)
    (warning,) = collapse_warnings(caplog)
    assert "amp will not stop the run (collapse_raise_steps=None)" in warning
    assert not [r for r in caplog.records if "Gradient overflow" in r.getMessage()]  # verbosity 0


def test_no_guard_when_disabled(caplog):
    model, optimizer = make_run(min_loss_scale=65536.0, collapse_warn_steps=None, collapse_raise_steps=None)
    caplog.set_level(logging.WARNING, logger="apex_amp")
    for _ in range(10):
        step(model, optimizer, overflow=True)
    assert not collapse_warnings(caplog)


def test_the_count_survives_a_checkpoint_and_old_checkpoints_load(caplog):
    options = dict(min_loss_scale=65536.0, collapse_warn_steps=5, collapse_raise_steps=7)
    model, optimizer = make_run(**options)
    for _ in range(4):
        step(model, optimizer, overflow=True)
    saved = amp.state_dict()
    assert saved["loss_scaler0"]["floor_overflow_streak"] == 4

    caplog.set_level(logging.WARNING, logger="apex_amp")
    model, optimizer = make_run(**options)
    amp.load_state_dict(saved)
    step(model, optimizer, overflow=True)  # the 5th in a row: the warning
    assert len(collapse_warnings(caplog)) == 1
    step(model, optimizer, overflow=True)
    step(model, optimizer, overflow=True)
    assert_scale_loss_raises(model, optimizer, "7 gradient overflows in a row")

    # A checkpoint from before the guard (no floor_overflow_streak) loads with the count at 0.
    model, optimizer = make_run(**options)
    old = {key: value for key, value in saved["loss_scaler0"].items() if key != "floor_overflow_streak"}
    amp.load_state_dict({"loss_scaler0": old})
    assert amp.state_dict()["loss_scaler0"]["floor_overflow_streak"] == 0
    with pytest.raises(ValueError, match="floor_overflow_streak must be an integer >= 0, got -1"):
        amp.load_state_dict({"loss_scaler0": {**old, "floor_overflow_streak": -1}})


def test_loading_a_state_clears_a_pending_collapse_error():
    model, optimizer = make_run(min_loss_scale=65536.0, collapse_warn_steps=1, collapse_raise_steps=2)
    saved = amp.state_dict()
    for _ in range(2):
        step(model, optimizer, overflow=True)
    assert_scale_loss_raises(model, optimizer, "Loss scale collapse")
    amp.load_state_dict(saved)  # e.g. back to a good checkpoint with a lower learning rate
    step(model, optimizer, overflow=False)
    assert amp.state_dict()["loss_scaler0"]["floor_overflow_streak"] == 0


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, 1e-40, TINY / 2, math.nan, math.inf, "small", True])
def test_min_loss_scale_must_be_a_normal_float32(bad):
    with pytest.raises(ValueError, match=r"min_loss_scale must be a positive number that float32 holds as a normal"):
        make_run(min_loss_scale=bad)


@pytest.mark.parametrize("bad", [1e-40, 1e39])
def test_a_static_loss_scale_must_be_a_normal_float32(bad):
    with pytest.raises(ValueError, match="is not a normal float32 number"):
        make_run(loss_scale=bad)


def test_a_checkpoint_with_a_denormal_scale_is_rejected():
    make_run()
    saved = amp.state_dict()
    saved["loss_scaler0"]["loss_scale"] = 1e-42
    with pytest.raises(ValueError, match=r"loss_scale must be a positive finite number, got 1e-42 \(a normal float32"):
        amp.load_state_dict(saved)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(collapse_warn_steps=0), "collapse_warn_steps must be None \\(never\\) or an integer >= 1, got 0"),
        (dict(collapse_raise_steps=2.5), "collapse_raise_steps must be None \\(never\\) or an integer >= 1, got 2.5"),
        (dict(collapse_warn_steps=True), "collapse_warn_steps must be None"),
        (dict(collapse_warn_steps=10, collapse_raise_steps=5), "collapse_raise_steps=5 is below collapse_warn_steps=10"),
    ],
)
def test_bad_collapse_options_are_rejected(options, message):
    with pytest.raises(ValueError, match=message):
        make_run(**options)


def test_the_smallest_floor_is_reached_but_never_crossed():
    # 2**16 -> 2**-126 (float32's smallest normal) takes 142 halvings; a few more overflows stay there.
    model, optimizer = make_run(min_loss_scale=TINY, collapse_warn_steps=None, collapse_raise_steps=None)
    for _ in range(146):
        step(model, optimizer, overflow=True)
    scale = amp.loss_scale()
    assert scale == TINY and math.isfinite(1.0 / scale)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    step(model, optimizer, overflow=False)
