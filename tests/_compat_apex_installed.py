"""Run by tests/test_compat_apex.py with the python of a throwaway venv that has the compat
distribution `apex` installed: uses it the way third-party code does and prints one JSON object.

- what transformers checks (importlib.metadata / importlib.util) and what it imports;
- a few training steps through the `apex` names only, timm's ApexScaler way (scale_loss,
  master_params, clipping, state_dict), at O1 and O2 with fp16, the dtype such code gets;
- each of apex's fused optimizers, imported by apex's names and module paths, training at O2
  fp16 through one overflow (a skipped step), beside the same optimizer on an fp32 model;
- timm's distributed set-up, in one process (gloo, world size 1): convert_syncbn_model,
  amp.initialize, then DistributedDataParallel(model, delay_allreduce=True);
- every import statement given on the command line, with the error it raised.
"""

import importlib
import importlib.metadata
import importlib.util
import json
import os
import socket
import sys

findings = {
    "version": importlib.metadata.version("apex"),
    "apex_amp_file": importlib.util.find_spec("apex_amp").origin,
    "requires": importlib.metadata.requires("apex"),
    "spec_origin": importlib.util.find_spec("apex").origin,
}

import apex  # noqa: E402
from apex import amp  # noqa: E402
from apex.optimizers import FusedAdam  # noqa: E402

import apex_amp  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import apex.amp as amp_by_import  # noqa: E402
from apex.optimizers.fused_adam import FusedAdam as FusedAdamByModule  # noqa: E402
from apex.parallel import DistributedDataParallel as ApexDDP  # noqa: E402
from apex.parallel import convert_syncbn_model  # noqa: E402

findings["same_amp"] = amp is apex_amp.amp and amp_by_import is apex_amp.amp and apex.amp is apex_amp.amp
findings["same_fused_adam"] = FusedAdam is apex_amp.optimizers.FusedAdam and FusedAdamByModule is FusedAdam
findings["amp_has_state_dict"] = "state_dict" in amp.__dict__  # timm's ApexScaler asks exactly this

torch.manual_seed(0)
torch.set_num_threads(1)
inputs, targets = torch.randn(64, 16), torch.randint(0, 4, (64,))


def fresh_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def train(model, optimizer, steps: int = 30) -> list[float]:
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 5.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


for opt_level in ("O1", "O2"):
    model = fresh_model()
    optimizer = FusedAdam(model.parameters(), lr=1e-2, adam_w_mode=True)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    losses = train(model, optimizer)
    findings[f"losses_{opt_level}"] = [losses[0], losses[-1]]
    findings[f"amp_state_keys_{opt_level}"] = sorted(amp.state_dict())
    findings[f"first_weight_dtype_{opt_level}"] = str(model[0].weight.dtype)

# apex's fused optimizers: the classes, by apex's names and module paths, are apex_amp's own.
FAMILY = {"FusedAdam": ("fused_adam", dict(lr=1e-2)), "FusedSGD": ("fused_sgd", dict(lr=0.1, momentum=0.9)),
          "FusedLAMB": ("fused_lamb", dict(lr=2e-2)),
          "FusedMixedPrecisionLamb": ("fused_mixed_precision_lamb", dict(lr=2e-2)),
          "FusedNovoGrad": ("fused_novograd", dict(lr=0.5)), "FusedAdagrad": ("fused_adagrad", dict(lr=2e-2))}
OVERFLOW_STEP = 3
findings["same_optimizers"] = {
    name: getattr(apex.optimizers, name) is getattr(apex_amp.optimizers, name)
    and getattr(importlib.import_module(f"apex.optimizers.{module}"), name) is getattr(apex_amp.optimizers, name)
    for name, (module, _) in FAMILY.items()}


def train_with_overflow(optimizer_class, options, o2: bool) -> dict:
    # O2 fp16 through amp (a gradient set to inf at OVERFLOW_STEP), or the fp32 model with that step skipped.
    model = fresh_model()
    optimizer = optimizer_class(model.parameters(), **options)
    if o2:
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    losses, skipped_step_kept_weights = [], None
    for step in range(20):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        before = model[0].weight.detach().clone()
        if o2:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                if step == OVERFLOW_STEP:
                    model[0].weight.grad.view(-1)[0] = float("inf")
        else:
            loss.backward()
        if o2 or step != OVERFLOW_STEP:
            optimizer.step()
        if step == OVERFLOW_STEP:
            skipped_step_kept_weights = torch.equal(before, model[0].weight.detach())
        losses.append(loss.item())
    result = {"losses": losses, "skipped_step_kept_weights": skipped_step_kept_weights}
    if o2:
        result["loss_scale"] = amp.state_dict()["loss_scaler0"]["loss_scale"]
    return result


for name, (_, options) in FAMILY.items():
    findings[f"o2_overflow_{name}"] = train_with_overflow(getattr(apex.optimizers, name), options, o2=True)
    findings[f"fp32_{name}"] = train_with_overflow(getattr(apex.optimizers, name), options, o2=False)

# timm's order: SyncBN conversion, amp.initialize, then apex's DDP.
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = convert_syncbn_model(fresh_model())
findings["syncbn_type"] = type(model[1]).__module__ + "." + type(model[1]).__name__
findings["syncbn_is_torch_syncbn"] = isinstance(model[1], nn.SyncBatchNorm)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
model = ApexDDP(model, delay_allreduce=True)
findings["ddp_is_torch_ddp"] = isinstance(model, nn.parallel.DistributedDataParallel)
running_mean_before = model.module[1].running_mean.clone()
losses = train(model, optimizer, steps=10)
findings["losses_ddp"] = [losses[0], losses[-1]]
findings["syncbn_running_mean_moved"] = not torch.equal(running_mean_before, model.module[1].running_mean)
findings["ddp_state_dict_prefix"] = next(iter(model.state_dict())).split(".")[0]
dist.destroy_process_group()

imports = {}
for statement in sys.argv[1:]:
    try:
        exec(statement, {"apex": apex})
        imports[statement] = ["ok", ""]
    except BaseException as error:  # noqa: BLE001 - recorded for the test to judge
        imports[statement] = [type(error).__name__, str(error)]
findings["imports"] = imports

print(json.dumps(findings))
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown after gloo (as examples/distributed.py does)
