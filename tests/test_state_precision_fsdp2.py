"""Low-precision optimizer state under FSDP2 on 2 ranks (examples/fsdp.py --state-precision, tests/_launch.py).

The layout is decided from each parameter's global shape, so 1 and 2 ranks store every state in
the same format with the same blocks; the absmaxes are DTensors sharded like their parameter, so
a torch.distributed.checkpoint saved on 2 ranks loads bitwise on 1 and the other way round, and
2 -> 1 -> 2 gives back the 2-rank state bit for bit (tests/_remainder_fsdp2_ranks.py ``run``,
remainder masters included). Each launch costs several seconds: marked slow.
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
RANKS = Path(__file__).resolve().parent / "_remainder_fsdp2_ranks.py"
# 64x64 hidden weights: 4096 elements, quantized in 64-element blocks (one per row).
INT8 = ("--state-precision", "int8", "--hidden", "64", "--blocks", "2", "--half-dtype", "bfloat16")


def run(tmp_path: Path, name: str, *args: str, nproc: int, options=INT8) -> dict:
    out = tmp_path / f"{name}.pt"
    result = launch([str(EXAMPLE), *options, *args, "--state-out", str(out)], nproc=nproc)
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


def run_ranks(tmp_path: Path, name: str, *args: str, nproc: int) -> None:
    result = launch([str(RANKS), "run", *args], nproc=nproc)
    assert result.returncode == 0 and f"RESULT: bitwise on {nproc} rank(s)" in result.stdout, \
        (result.stdout + result.stderr)[-4000:]


def saved(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def differing(a: dict, b: dict) -> list[str]:
    assert a["state"].keys() == b["state"].keys()
    return [name for name, value in a["state"].items()
            if value.dtype != b["state"][name].dtype or value.shape != b["state"][name].shape
            or not torch.equal(value.reshape(-1).view(torch.uint8), b["state"][name].reshape(-1).view(torch.uint8))]


@pytest.mark.parametrize("precision, masters", [("int8", "fp32 shards"), ("int8", "remainder"), ("fp8", "remainder")])
def test_a_checkpoint_resharded_two_one_two_is_the_two_rank_state_bitwise_and_steps_alike(tmp_path, precision, masters):
    # Saved on 2 ranks after 4 steps (one skipped), loaded on 1 and saved again without a step,
    # loaded on 2: every code, absmax, remainder, weight and step count is the original's, and
    # one more step from either gives the same state.
    common = ("--precision", precision, *(("--remainder",) if masters == "remainder" else ()))
    first, second = str(tmp_path / "two"), str(tmp_path / "one")
    out = {name: tmp_path / f"{name}.pt" for name in ("two", "one", "two_again", "two_next", "two_again_next")}
    run_ranks(tmp_path, "two", *common, "--train", "0:4", "--save", first, "--out", str(out["two"]),
              "--then", "1", "--then-out", str(out["two_next"]), nproc=2)
    run_ranks(tmp_path, "one", *common, "--train", "4:4", "--load", first, "--save", second,
              "--out", str(out["one"]), nproc=1)
    run_ranks(tmp_path, "two_again", *common, "--train", "4:4", "--load", second, "--out", str(out["two_again"]),
              "--then", "1", "--then-out", str(out["two_again_next"]), nproc=2)
    original = saved(out["two"])
    codes = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
    assert {codes.get(v.dtype) for v in original["state"].values()} >= {precision}
    assert any(name.endswith("_absmax") for name in original["state"])
    assert any(name.endswith("master_remainder") for name in original["state"]) == (masters == "remainder")
    assert original["state"]["group 0 step"].item() == 3.0  # 4 steps, one skipped
    assert differing(original, saved(out["one"])) == []
    assert differing(original, saved(out["two_again"])) == []
    assert original["amp"] == saved(out["two_again"])["amp"]
    stepped, stepped_again = saved(out["two_next"]), saved(out["two_again_next"])
    assert differing(stepped, stepped_again) == [] and stepped["amp"] == stepped_again["amp"]
    assert len(differing(original, stepped)) > len(original["state"]) // 2  # the step changed the state


# bf16 moments rounded stochastically: the seed and the step counter are param-group entries that DCP
# saves and restores, so a resumed run rounds (and so steps) bitwise as the run that saved went on.
BF16_STOCHASTIC = ("--state-precision", "bf16", "--state-rounding", "stochastic", "--hidden", "64", "--blocks", "2",
                   "--half-dtype", "bfloat16")


def test_a_stochastically_rounded_run_resumes_bitwise_from_its_checkpoint(tmp_path):
    through = run(tmp_path, "through", "--steps", "5", "--save-at", "3", "--checkpoint", str(tmp_path / "ckpt"),
                  nproc=2, options=BF16_STOCHASTIC)
    resumed = run(tmp_path, "resumed", "--steps", "5", "--resume", str(tmp_path / "ckpt"), nproc=2,
                  options=BF16_STOCHASTIC)
    assert any(value.dtype == torch.bfloat16 and "exp_avg" in name for name, value in through.items())
    assert through.keys() == resumed.keys()
    differ = [name for name, value in through.items() if not torch.equal(value.view(torch.uint8),
                                                                         resumed[name].view(torch.uint8))]
    assert differ == []
