"""Every public name of NVIDIA apex's ``__init__`` files under the compat distribution, and the table that lists them.

The names and their statuses are in ``_apex_public_names.py``. The compat distribution is
installed into a throwaway venv and ``_compat_apex_names_installed.py`` runs there: each name
imported (or its whole module refused with the replacement named), the raising ones called, the
working ones against plain PyTorch (apex_C against torch's flatten helpers, flat_dist_call and
Reducer on a one-rank gloo group, the norms against torch.nn.LayerNorm / RMSNorm, functions
decorated at import under O1), and a client written like DeepLearningExamples' BERT
(``_dle_bert_like.py``): it binds amp_C's LAMB stages, apex_C and flat_dist_call at import, its
two-stage LAMB trains like FusedLAMB, and its hand-made all-reduce step (``_overflow_buf``,
``update_scale()``) skips an overflowing step and trains; and the same ``--allreduce_post_accumulation``
flow written out in the script (``scale_loss(..., delay_unscale=..., delay_overflow_check=True)``
micro-batches, ``multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, ...)``, the flat
all-reduce, ``update_scale()``, the skip by dropping the gradients) moves the scale once per step
along apex's trajectory and changes the weights on every clean step only. Each check is one test here.

Costs: the venv and install ~4 s, the script ~6 s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

import apex_amp
from _apex_public_names import APEX_PUBLIC_NAMES
from _throwaway_venv import ROOT, TIMEOUT_S, make_venv, pip_install_compat

TESTS = Path(__file__).resolve().parent
DOCS_PAGE = ROOT / "docs" / "third_party_apex.md"

CHECKS = [
    "every_public_name_imports_or_its_module_names_the_replacement",
    "raising_names_raise_only_when_called_and_name_the_replacement",
    "apex_top_level_helpers_warn_as_apex",
    "apex_c_flatten_unflatten_round_trip_as_torchs_helpers",
    "flat_dist_call_groups_by_type_and_averages_on_a_one_rank_gloo_group",
    "fused_norms_match_torchs_norms_with_apexs_arguments_and_dtypes",
    "functions_decorated_at_import_follow_o1",
    "dle_bert_like_module_imports_and_its_two_stage_lamb_trains_like_fused_lamb",
    "dle_bert_like_allreduce_post_accumulation_skips_overflows_and_trains",
    "dle_bert_like_every_step_the_client_takes_changes_the_weights",
    "dle_bert_flow_updates_the_scale_once_per_step_as_apex",
    "dle_bert_flow_changes_the_weights_on_every_clean_step_and_nothing_on_an_overflow",
]

@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    python = make_venv(tmp_path_factory.mktemp("compat-names-venv") / "venv")
    done = pip_install_compat(python)
    assert done.returncode == 0, f"pip install ./compat/apex failed:\n{done.stdout}\n{done.stderr}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([str(python), str(TESTS / "_compat_apex_names_installed.py"), apex_amp.__file__],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT, env=env)
    assert done.returncode == 0, f"the name checks failed to run:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_check_of_the_script_is_a_test_here(results):
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_apex_names_behave_as_apex(results, name):
    assert results[name] == "ok", results[name]


# The status column (the second) for each status of _apex_public_names.py; the third says more.
STATUS_WORDS = {"works": "works", "differs": "works, with differences", "raises": "raises when called",
                "refused": "module not provided"}


def _documented_statuses() -> dict[str, str]:
    """`dotted.name` -> the status cell, for every name in the first cell of a row of the docs' tables."""
    statuses = {}
    for line in DOCS_PAGE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not line.startswith("|"):
            continue
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", cells[0]):
            statuses[name] = cells[1]
    return statuses


def test_the_docs_table_lists_every_public_name_with_its_status():
    documented = _documented_statuses()
    wrong = {}
    for module, names in APEX_PUBLIC_NAMES.items():
        for name, (status, _) in names.items():
            dotted = f"{module}.{name}"
            cell = documented.get(dotted)
            if cell != STATUS_WORDS[status]:
                wrong[dotted] = (cell, STATUS_WORDS[status])
    assert not wrong, wrong
