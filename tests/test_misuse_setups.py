"""Awkward but valid setups that must simply work: frozen parameters under O2, a weight tied across
two models, an optimizer that starts empty, a model without parameters, a parameter on another device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _misuse import batch, small_model, train_step
from apex_amp import amp
from apex_amp.optimizers import FusedAdam

F32, BF16 = torch.float32, torch.bfloat16


def _plain_run(model, optimizer, steps):
    for seed in range(steps):
        optimizer.zero_grad()
        model(batch(seed)).float().pow(2).mean().backward()
        optimizer.step()


@pytest.mark.parametrize("kind", ["SGD", "FusedAdam"])
@pytest.mark.parametrize("only_trainable", [False, True], ids=["all-params-in-optimizer", "filtered-params"])
def test_o2_trains_around_frozen_parameters(kind, only_trainable):
    def build():
        model = small_model()
        model[0].weight.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad or not only_trainable]
        if kind == "SGD":
            return model, torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
        return model, FusedAdam(params, lr=1e-2, weight_decay=0.01)

    reference, reference_optimizer = build()
    initial = {name: value.clone() for name, value in reference.state_dict().items()}
    _plain_run(reference, reference_optimizer, 4)
    model, optimizer = build()
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    for seed in range(4):
        train_step(model, optimizer, seed)
    # The frozen weight: untouched in the model, in its master, and without optimizer state.
    assert torch.equal(model[0].weight, initial["0.weight"].to(BF16)) and model[0].weight.grad is None
    frozen_masters = [p for p in amp.master_params(optimizer) if not p.requires_grad]
    assert len(frozen_masters) == (0 if only_trainable else 1)
    for master in frozen_masters:
        assert torch.equal(master, initial["0.weight"]) and master not in optimizer.state
    # The others: moved as in the fp32 run (same direction and size, up to bf16 noise).
    trained, expected = model.state_dict(), reference.state_dict()  # the fp32 masters under O2
    names = ("0.bias", "1.weight", "1.bias", "3.weight", "3.bias")
    update = torch.cat([(trained[n] - initial[n]).flatten() for n in names])
    expected_update = torch.cat([(expected[n] - initial[n]).flatten() for n in names])
    assert torch.nn.functional.cosine_similarity(update, expected_update, dim=0) > 0.9
    assert 0.8 < update.norm() / expected_update.norm() < 1.25


def _tied_encoder_decoder():
    torch.manual_seed(0)
    encoder, decoder = nn.Linear(4, 4), nn.Linear(4, 4)
    decoder.weight = encoder.weight
    return encoder, decoder


def _train_tied(encoder, decoder, optimizer, use_amp, steps=3):
    for seed in range(steps):
        optimizer.zero_grad()
        loss = decoder(encoder(batch(seed))).float().pow(2).mean()
        if use_amp:
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        else:
            loss.backward()
        optimizer.step()


def test_weight_tied_across_two_models_gets_one_master_and_stays_tied():
    reference = _tied_encoder_decoder()
    _train_tied(*reference, torch.optim.SGD(nn.ModuleList(reference).parameters(), lr=0.05), use_amp=False)
    encoder, decoder = _tied_encoder_decoder()
    # Built from unique parameters: the tied weight once (listing it twice is refused, see above).
    optimizer = torch.optim.SGD(nn.ModuleList([encoder, decoder]).parameters(), lr=0.05)
    amp.initialize([encoder, decoder], optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    masters = list(amp.master_params(optimizer))
    assert len(masters) == 3  # the tied weight and two biases
    _train_tied(encoder, decoder, optimizer, use_amp=True)
    assert decoder.weight is encoder.weight and encoder.weight.dtype == BF16
    assert torch.equal(encoder.weight, masters[0].detach().to(BF16))
    assert torch.equal(encoder.state_dict()["weight"], decoder.state_dict()["weight"])
    assert encoder.state_dict()["weight"].dtype == F32
    torch.testing.assert_close(encoder.state_dict()["weight"], reference[0].weight.detach(), rtol=0.03, atol=0.01)


def test_optimizer_with_no_params_yet_takes_groups_added_later():
    model = small_model()
    optimizer = torch.optim.SGD([{"params": []}], lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    assert list(amp.master_params(optimizer)) == []
    optimizer.add_param_group({"params": list(model.parameters())})
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    assert len(before) == 6 and all(p.dtype == F32 for p in before)
    train_step(model, optimizer)
    after = list(amp.master_params(optimizer))
    assert not torch.equal(before[0], after[0]) and torch.equal(model[0].weight, after[0].detach().to(BF16))


def test_model_without_parameters_is_accepted():
    model = nn.ReLU()
    assert amp.initialize(model, opt_level="O2", half_dtype=BF16, verbosity=0) is model
    assert model(torch.randn(3)).dtype == F32  # inputs cast to bf16, outputs back to fp32


def test_optimizer_holding_a_param_on_another_device_trains_the_cpu_params():
    # A parameter on another device (meta stands in for a GPU) that this backward does not reach:
    # amp leaves it alone (no master, no cross-device op call) and trains the rest.
    model = small_model()
    elsewhere = nn.Parameter(torch.ones(3, device="meta"))
    optimizer = torch.optim.SGD([*model.parameters(), elsewhere], lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0)
    assert any(p is elsewhere for p in amp.master_params(optimizer))
    before = model[0].weight.detach().clone()
    train_step(model, optimizer)
    assert not torch.equal(model[0].weight, before) and not amp.step_was_skipped(optimizer)
    assert elsewhere.device.type == "meta" and elsewhere.grad is None
