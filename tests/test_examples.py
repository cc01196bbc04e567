"""The examples run: the digits job writes a sane table, JSON and plot; the three-line script trains."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

pytest.importorskip("sklearn", reason="the examples extra is not installed: pip install -e '.[examples]'")
pytest.importorskip("matplotlib", reason="the examples extra is not installed: pip install -e '.[examples]'")
pytest.importorskip("tqdm", reason="the examples extra is not installed: pip install -e '.[examples]'")


def _load_train_digits():
    spec = importlib.util.spec_from_file_location("train_digits", EXAMPLES / "train_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_digits_writes_table_json_and_plot(tmp_path):
    from apex_amp.amp import casting

    train_digits = _load_train_digits()
    out = tmp_path / "digits"
    # O2 then O1: the job must leave O1's process-wide casting off again when it ends.
    results = train_digits.main(["--epochs", "1", "--opt-level", "O2", "O1", "--out", str(out), "--no-progress"])

    assert not casting.is_active()
    assert [r["opt_level"] for r in results] == ["O2", "O1"]
    for r in results:
        assert r["precision"] == "bf16"
        assert r["test_accuracy"] > 0.5, f"{r['opt_level']} learnt nothing in one epoch: {r['test_accuracy']}"
        assert r["skipped_steps"] == 0 and r["final_loss_scale"] == 1.0  # bf16: static scale, no overflow
        assert len(r["step_loss"]) == len(r["step_loss_scale"]) == len(r["step_skipped"]) == 23  # 1437 / 64
        assert 0 < r["activation_bytes"] < r["memory_bytes"]

    table = (out / "results.md").read_text(encoding="utf-8")
    assert "| O2 | bf16 |" in table and "| O1 | bf16 |" in table and "tensor KiB (counted)" in table
    saved = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert saved["config"]["epochs"] == 1
    assert [r["test_accuracy"] for r in saved["results"]] == [r["test_accuracy"] for r in results]
    png = (out / "results.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_train_digits_rejects_bad_arguments(capsys):
    train_digits = _load_train_digits()
    with pytest.raises(SystemExit):
        train_digits.parse_args(["--loss-scale", "lots"])
    assert "--loss-scale must be 'dynamic' or a number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_digits.parse_args(["--opt-level", "O4"])


def test_train_digits_uses_a_tiny_network_for_fp16_on_cpu():
    train_digits = _load_train_digits()
    assert train_digits.parse_args(["--half-dtype", "float16", "--device", "cpu"]).hidden == (32,)
    assert train_digits.parse_args(["--device", "cpu"]).hidden == (256, 128)


def test_three_line_example_runs():
    done = subprocess.run([sys.executable, str(EXAMPLES / "three_line.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Random data and labels, no seed: the value varies; it must be a real, finite cross-entropy.
    loss = float(done.stdout.split("loss")[-1])
    assert math.isfinite(loss) and loss > 0


def _load_transformer():
    spec = importlib.util.spec_from_file_location("transformer_example", EXAMPLES / "transformer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_transformer_example_lowers_the_loss(opt_level, tmp_path):
    from apex_amp.amp import casting

    transformer = _load_transformer()
    out = tmp_path / "lm.json"
    result = transformer.main(["--quick", "--opt-level", opt_level, "--accumulate", "2", "--no-progress",
                               "--json", str(out)])

    assert not casting.is_active()  # O1's process-wide casts are off again after main()
    first, last = result["epochs"][0], result["epochs"][-1]
    # Untrained, the model is near uniform over 96 characters (ln 96 = 4.56); 12 steps must cut that clearly.
    assert result["initial_val_loss"] > 4.0
    assert last["val_loss"] < result["initial_val_loss"] - 0.8, result
    assert last["train_loss"] < first["train_loss"], result
    assert math.isclose(last["val_perplexity"], math.exp(last["val_loss"]))
    assert result["skipped_steps"] == 0 and result["final_loss_scale"] == 1.0  # bf16: static scale
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert saved["opt_level"] == opt_level and saved["epochs"] == result["epochs"]


def test_transformer_example_reads_a_given_text_and_rejects_bad_arguments(tmp_path, capsys):
    transformer = _load_transformer()
    short = tmp_path / "short.txt"
    short.write_text("too short\n", encoding="utf-8")
    with pytest.raises(RuntimeError, match="--text PATH"):
        transformer.load_text(short)
    ids = transformer.encode("ab\tc\u00e9\n")  # the tab becomes 4 spaces, the accented letter is dropped
    assert ids.tolist() == [transformer.ALPHABET.index(c) for c in "ab    c\n"]
    with pytest.raises(SystemExit):
        transformer.parse_args(["--d-model", "100"])
    assert "multiple of 8" in capsys.readouterr().err
    with pytest.raises(ValueError, match="multiple of 8"):
        transformer.make_model(d_model=60, heads=4)


def test_train_digits_fp8_adds_an_fp8_row_with_its_gemm_errors(tmp_path, one_thread):
    train_digits = _load_train_digits()
    results = train_digits.main(["--epochs", "2", "--opt-level", "O2", "--fp8", "--out", str(tmp_path),
                                 "--no-progress"])
    assert [(r["opt_level"], r["precision"]) for r in results] == [("O2", "bf16"), ("O2", "fp8 + bf16")]
    plain, fp8 = results
    assert abs(fp8["test_accuracy"] - plain["test_accuracy"]) < 0.05
    gemms = {(row["layer"], row["gemm"]) for row in fp8["gemm_errors"]}
    assert gemms == {(layer, gemm) for layer in ("0", "3") for gemm in ("forward", "input grad", "weight grad")}
    # fp8 is far less exact than bf16, and still close: the errors are real measurements
    assert all(row["half"] < row["fp8"] < 0.3 for row in fp8["gemm_errors"])


def test_transformer_example_with_int8_state_and_remainder_masters_holds_about_8_bytes_per_parameter():
    transformer = _load_transformer()
    result = transformer.main(["--quick", "--state-precision", "int8", "--master-weights", "remainder",
                               "--no-progress"])
    last = result["epochs"][-1]
    assert last["val_loss"] < result["initial_val_loss"] - 0.8, result
    # bf16 weights and gradients (2 + 2), remainders (2), int8 moments (2 + 1/32); the small
    # tensors (norms, biases) keep fp32 state, the step count adds a few bytes.
    assert result["memory"]["masters"] == pytest.approx(2.0, abs=0.01)
    assert 8.0 < result["memory"]["total"] < 8.6, result["memory"]
