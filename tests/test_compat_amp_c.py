"""The compat distribution's ``amp_C`` and ``apex.multi_tensor_apply``: apex's kernel calls on apex_amp's ops.

The compat distribution is installed into a throwaway venv (``_throwaway_venv.py``) and
``_compat_amp_c_installed.py`` runs there: every amp_C function against a plain-PyTorch
computation of what apex's CUDA kernel computes (``_amp_c_reference.py``), apex's return shapes,
the noop flag (skipped on where apex skipped, set on inf/NaN where apex set it), Megatron-style
clipping and a LAMB written as apex's reference optimizers are. Each check is one test here, on
each of apex_amp's backends.

Costs: the venv and install ~4 s, the script ~5 s per backend (compiled kernels, fallback).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import apex_amp
from _throwaway_venv import ROOT, TIMEOUT_S, make_venv, pip_install_compat

TESTS = Path(__file__).resolve().parent

CHECKS = [
    "applier_calls_amp_c_with_apex_chunk_size_first",
    "scale_converts_dtypes_and_flags_only_nonfinite_inputs",
    "scale_in_place_through_data_views_and_never_clears_the_flag",
    "axpby_writes_out_y_or_x_and_checks_the_chosen_inputs",
    "l2norm_returns_apex_shapes_and_values",
    "l2norm_flags_inf_and_nan_and_never_skips",
    "megatron_style_clipping_matches_torch_clip_grad_norm",
    "l2norm_mp_skips_while_the_flag_is_set",
    "unscale_l2norm_measures_unscaled_values_and_leaves_tensors",
    "l2norm_scale_measures_in_and_writes_scaled_out",
    "update_scale_hysteresis_follows_apex_step_by_step",
    "malformed_calls_raise_with_the_fix",
    "sgd_matches_apex_for_each_option_and_layout",
    "sgd_skips_while_the_flag_is_set_and_never_sets_it",
    "adam_matches_apex_for_modes_and_dtypes_and_ignores_the_flag",
    "adam_capturable_unscales_grads_in_place_and_skips_on_the_flag",
    "adagrad_matches_apex_for_both_modes",
    "novograd_blends_grad_norms_in_place_and_flags_inf",
    "lamb_matches_apex_for_modes_decay_and_nvlamb",
    "lamb_steps_whatever_the_flag_and_sets_it_on_inf",
    "lamb_mp_updates_masters_and_model_copy_and_skips_on_the_flag",
    "lamb_stages_match_apex_and_leave_the_flag_alone",
    "lamb_stages_propagate_inf_and_check_their_arguments",
    "reference_lamb_on_amp_c_trains_like_fused_lamb",
]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    python = make_venv(tmp_path_factory.mktemp("compat-amp-c-venv") / "venv")
    done = pip_install_compat(python)
    assert done.returncode == 0, f"pip install ./compat/apex failed:\n{done.stdout}\n{done.stderr}"
    return python


# amp_C calls apex_amp.ops, which run the compiled kernels or the pure-PyTorch fallback.
@pytest.fixture(scope="module", params=["extension", "fallback"])
def results(installed, request) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", APEX_AMP_FORCE_FALLBACK="1" if request.param == "fallback" else "0")
    done = subprocess.run([str(installed), str(TESTS / "_compat_amp_c_installed.py"), apex_amp.__file__],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT, env=env)
    assert done.returncode == 0, f"the amp_C checks failed to run:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_check_of_the_script_is_a_test_here(results):
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_amp_c_behaves_as_apex(results, name):
    assert results[name] == "ok", results[name]
