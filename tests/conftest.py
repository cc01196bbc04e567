"""Shared pytest set-up: markers, and the backend and device fixtures.

Op tests take ``amp_ops`` (the torch.ops namespace of each backend in turn,
see tests/_backends.py) and ``device`` ("cpu", and "cuda" marked ``cuda``).
Tests marked ``cuda`` are skipped without a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# The tests import their helpers (_backends, _reference) by plain name, also
# under pytest's --import-mode=importlib, which does not add this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _backends import BACKENDS, namespace_of  # noqa: E402
from apex_amp import ops  # noqa: E402

DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))

# tests/emulation/ runs in its own sanitized process (tests/test_cuda_emulation.py
# starts it); collected here, its tests would find no emulation library.
collect_ignore = ["emulation"]


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated so the suite runs without it.
    config.addinivalue_line("markers", "slow: takes more than a few seconds (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip_cuda)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    namespace_of(request.param)
    return request.param


@pytest.fixture
def amp_ops(backend):
    """The torch.ops namespace under test (parametrised over both backends)."""
    return ops.backend_namespace(backend)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _o1_casts_off_after_each_test():
    """O1's casts are process-wide (as in apex, initialize turns them on for good): a test that
    initializes at O1 must not leave them on for the tests after it."""
    from apex_amp.amp import casting

    was_active = casting.is_active()
    yield
    if casting.is_active() and not was_active:
        casting.deactivate()


@pytest.fixture
def one_thread():
    """One intra-op thread for tests of tiny tensors: a second thread only spins against the other
    processes of a busy 2-core box (measured: 200 fault-injection steps in 1.2 s on one thread, 22 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def process_group(tmp_path):
    """A one-rank gloo process group in this process, for the in-process distributed tests."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def max_reductions(monkeypatch):
    """The MAX all-reduces issued through torch.distributed.all_reduce (amp's found-inf sync)."""
    calls = []
    original = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.MAX:
            calls.append(tensor.clone())
        return original(tensor, op=op, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", counting)
    return calls
