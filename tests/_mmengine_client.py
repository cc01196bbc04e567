"""Run inside a throwaway venv with mmengine and the compat ``apex``: mmengine's own Runner with ApexOptimWrapper.

For one opt level (argv[1]) in a work folder (argv[2]): two epochs straight, then one epoch, a
new Runner that resumes from its checkpoint (``resume=True``, as ``tools/train.py --resume``
does) and trains the second. Prints one JSON line of findings for
``tests/test_mmengine_apex.py``. bf16 comes from ``APEX_AMP_HALF_DTYPE`` (mmengine passes no
half dtype), as it would for any unmodified apex client.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
from torch import nn

import apex
from mmengine.model import BaseModel
from mmengine.runner import Runner

OPT_LEVEL, WORK = sys.argv[1], Path(sys.argv[2])


class Classifier(BaseModel):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, inputs, labels, mode="tensor"):
        logits = self.net(inputs)
        if mode == "loss":
            return {"loss": nn.functional.cross_entropy(logits.float(), labels)}
        return logits


class Points(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(96, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0.5).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"inputs": self.x[index], "labels": self.y[index]}


def runner(name: str, epochs: int, **extra) -> Runner:
    torch.manual_seed(0)  # the model is built before the Runner seeds anything
    return Runner(
        model=Classifier(),
        work_dir=str(WORK / name),
        experiment_name=f"{OPT_LEVEL}-{name}",
        train_dataloader=dict(dataset=Points(), batch_size=16, num_workers=0,
                              sampler=dict(type="DefaultSampler", shuffle=True),
                              collate_fn=dict(type="default_collate")),
        optim_wrapper=dict(type="ApexOptimWrapper", opt_level=OPT_LEVEL, loss_scale="dynamic", verbosity=0,
                           optimizer=dict(type="SGD", lr=0.1, momentum=0.9)),
        # An explicit end: a default one would become each run's own max_epochs (1 for the first half).
        param_scheduler=dict(type="MultiStepLR", milestones=[1], gamma=0.5, begin=0, end=2),
        train_cfg=dict(by_epoch=True, max_epochs=epochs),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1),
                           logger=dict(type="LoggerHook", interval=100)),
        randomness=dict(seed=0),
        log_level="WARNING",
        **extra,
    )


def masters(run: Runner) -> list[torch.Tensor]:
    return [p.detach().clone() for group in run.optim_wrapper.optimizer.param_groups for p in group["params"]]


def losses(run: Runner) -> list[float]:
    return [float(v) for v in run.message_hub.get_scalar("train/loss").data[0]]


logging.getLogger("apex_amp").setLevel(logging.ERROR)
straight = runner("straight", 2)
straight.train()
first_half = runner("first", 1)
first_half.train()
checkpoint = WORK / "first" / "epoch_1.pth"
saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
resumed = runner("resumed", 2, load_from=str(checkpoint), resume=True)
resumed.train()

optimizer = resumed.optim_wrapper.optimizer
momentum_restored = all(
    "momentum_buffer" in optimizer.state[p] for group in optimizer.param_groups for p in group["params"])
print(json.dumps({
    "apex_is_compat": apex.amp.__name__ == "apex_amp.amp",
    "has_amp_stash": hasattr(optimizer, "_amp_stash"),
    "saved_amp_keys": sorted(saved["optimizer"]["apex_amp"]),
    "saved_unskipped": saved["optimizer"]["apex_amp"]["loss_scaler0"]["unskipped"],
    "unskipped_after_resume": apex.amp.state_dict()["loss_scaler0"]["unskipped"],
    "momentum_restored": momentum_restored,
    "first_param_dtype": str(next(resumed.model.parameters()).dtype),
    "master_dtype": str(masters(resumed)[0].dtype),
    "losses_straight": losses(straight),
    "resume_is_bitwise": all(torch.equal(a, b) for a, b in zip(masters(straight), masters(resumed))),
    "model_state_is_bitwise": all(torch.equal(value, resumed.model.state_dict()[key])
                                  for key, value in straight.model.state_dict().items()),
}))
