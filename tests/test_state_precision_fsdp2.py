"""Low-precision optimizer state under FSDP2 on 2 ranks (examples/fsdp.py --state-precision, tests/_launch.py).

The layout is decided from each parameter's global shape, so 1 and 2 ranks store every state in
the same format with the same blocks; the absmaxes are DTensors sharded like their parameter, so
a torch.distributed.checkpoint saved on 2 ranks loads bitwise on 1 and the other way round.
Each launch costs several seconds: marked slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _launch import launch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp.py"
# 64x64 hidden weights: 4096 elements, quantized in 64-element blocks (one per row).
INT8 = ("--state-precision", "int8", "--hidden", "64", "--blocks", "2", "--half-dtype", "bfloat16")


def run(tmp_path: Path, name: str, *args: str, nproc: int) -> dict:
    out = tmp_path / f"{name}.pt"
    result = launch([str(EXAMPLE), *INT8, *args, "--state-out", str(out)], nproc=nproc)
    assert result.returncode == 0 and f"RESULT: all {nproc} ranks agree" in result.stdout, \
        (result.stdout + result.stderr)[-4000:]
    return torch.load(out, weights_only=False)["state"]


def test_one_and_two_ranks_store_the_same_formats_and_blocks(tmp_path):
    one, two = run(tmp_path, "one", "--steps", "3", nproc=1), run(tmp_path, "two", "--steps", "3", nproc=2)
    assert one.keys() == two.keys()
    formats = {name: (value.dtype, value.numel()) for name, value in one.items()}
    assert formats == {name: (value.dtype, value.numel()) for name, value in two.items()}
    assert any(value.dtype == torch.int8 for value in one.values())
    assert any(name.endswith("exp_avg_sq_absmax") for name in one)


@pytest.mark.parametrize("saved_on, loaded_on", [(2, 1), (1, 2)])
def test_an_int8_checkpoint_reshards_bitwise(tmp_path, saved_on, loaded_on):
    common = ("--steps", "3")
    saved = run(tmp_path, "saved", *common, "--save-at", "3", "--checkpoint", str(tmp_path / "ckpt"),
                nproc=saved_on)
    loaded = run(tmp_path, "loaded", *common, "--resume", str(tmp_path / "ckpt"), nproc=loaded_on)
    assert saved.keys() == loaded.keys()
    differ = [name for name, value in saved.items()
              if value.dtype != loaded[name].dtype or not torch.equal(value.view(torch.uint8),
                                                                      loaded[name].view(torch.uint8))]
    assert differ == []
