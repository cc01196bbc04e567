"""Models for the ``python -m apex_amp inspect`` tests (imported by name in a subprocess)."""

from torch import nn


def misaligned() -> nn.Module:
    """A small CNN with a deliberately misaligned Linear(30, 64) and Conv2d(3, 20, 3)."""
    return nn.Sequential(
        nn.Conv2d(3, 20, 3),
        nn.BatchNorm2d(20),
        nn.Flatten(),
        nn.Linear(30, 64),
        nn.LayerNorm(64),
    )


ALIGNED = nn.Linear(64, 32)  # an instance, not a factory
NOT_A_MODEL = 42


def returns_a_number() -> int:
    return 7


def wide_linears() -> nn.Module:
    """Two bias-free 512x512 Linears (``python -m apex_amp memory`` tests): every tensor is quantizable."""
    return nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False))


def frozen() -> nn.Module:
    """A Linear without trainable parameters."""
    return nn.Linear(64, 64).requires_grad_(False)


# Specs that name no model, and what the CLI's error says for each (inspect and memory alike).
BAD_SPECS = [
    ("_diag_models", "expected MODULE:FACTORY"),
    ("no_such_module_xyz:build", "module 'no_such_module_xyz' not found"),
    ("_diag_models:missing", "has no attribute 'missing'"),
    ("_diag_models:NOT_A_MODEL", "neither an nn.Module nor a callable"),
    ("_diag_models:returns_a_number", "not a torch.nn.Module"),
]
