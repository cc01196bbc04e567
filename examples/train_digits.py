"""Train a small MLP on scikit-learn's bundled digits with apex_amp (no downloads).

    python examples/train_digits.py                       # O2, bf16, FusedAdam
    python examples/train_digits.py --opt-level O1 --half-dtype float16 --epochs 5

Prints per-epoch loss and test accuracy, then the final loss scale and the
number of skipped steps.
"""

from __future__ import annotations

import argparse
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

from apex_amp import amp
from apex_amp.optimizers import FusedAdam


def load_data(seed: int = 0):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "FusedAdam":
        return FusedAdam(params, lr=lr, weight_decay=1e-4)
    if name == "Adam":
        return torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    return torch.optim.SGD(params, lr=lr * 50, momentum=0.9)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=amp.OPT_LEVELS)
    parser.add_argument("--half-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--optimizer", default="FusedAdam", choices=["FusedAdam", "Adam", "SGD"])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    model = make_model()
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      half_dtype=getattr(torch, args.half_dtype), verbosity=0)
    print(f"digits: {len(x_train)} train / {len(x_test)} test, {args.opt_level} {args.half_dtype} {args.optimizer}")
    skipped = 0
    for epoch in range(args.epochs):
        start = time.perf_counter()
        model.train()
        order = torch.randperm(len(x_train))
        total = 0.0
        for batch in order.split(args.batch_size):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            skipped += amp.step_was_skipped(optimizer)  # one host read per step: fine for an example
            total += loss.item() * len(batch)
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        print(f"epoch {epoch + 1:2d}  loss {total / len(x_train):.4f}  test accuracy {accuracy:.3f}  "
              f"({time.perf_counter() - start:.2f}s)")
    print(f"final loss scale {amp.loss_scale():g}, skipped steps {skipped}")


if __name__ == "__main__":
    main()
