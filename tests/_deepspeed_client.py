"""Run inside a throwaway venv with DeepSpeed and the compat ``apex``: DeepSpeed's engine in its amp mode.

DeepSpeed's config ``"amp": {"enabled": true, "opt_level": argv[1]}`` makes its engine call
``apex.amp.initialize`` on the model and the client's optimizer, run ``amp.scale_loss`` in
``engine.backward`` and step through apex's optimizer. The engine is DeepSpeed's own, on its CPU
accelerator (``DS_ACCELERATOR=cpu``), one process with the gloo backend (the environment
variables of a one-rank launch). Prints one JSON line of findings for
``tests/test_deepspeed_apex.py``: the dtype the model's layers computed in inside the engine's
forward, what torch's autocast flags read there, the losses.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
from torch import nn

import apex
import deepspeed

OPT_LEVEL = sys.argv[1]
STEPS = 30


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.seen = []  # per forward: (the first Linear's output dtype, autocast flags cpu/cuda)

    def forward(self, x):
        hidden = self.net[0](x)
        self.seen.append((str(hidden.dtype), torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")))
        return self.net[2](self.net[1](hidden))


def main() -> None:
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = {"train_batch_size": 16, "gradient_accumulation_steps": 1,
              "amp": {"enabled": True, "opt_level": OPT_LEVEL, "verbosity": 0}}
    engine, engine_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                          dist_init_required=True)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=generator)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    losses = []
    for _ in range(STEPS):
        out = engine(x)
        loss = (out.float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    print(json.dumps({
        "apex_is_compat": "apex_amp" in repr(getattr(apex, "amp")),
        "deepspeed": deepspeed.__version__,
        "amp_enabled": engine.amp_enabled(),
        "first_param_dtype": str(next(model.parameters()).dtype),
        "hidden_dtypes": sorted({dtype for dtype, _, _ in model.seen}),
        "autocast_flags_in_forward": sorted({(cpu, cuda) for _, cpu, cuda in model.seen}),
        "autocast_flags_outside": [torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")],
        "losses": losses,
        "world_size": int(os.environ["WORLD_SIZE"]),
    }))


if __name__ == "__main__":
    main()
