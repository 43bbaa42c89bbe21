"""Test-wide settings: tests not marked ``gpu`` run their plans on the CPU.

On a machine with CUDA, ``plan.run`` and ``check_plan`` would otherwise default to the GPUs, and
tests written against CPU references (CPU dropout streams, CPU memory accounting) would compare
across devices; the ``gpu`` tests cover the CUDA path explicitly.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _plans_on_the_cpu_unless_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("GNNCOMPILE_DEVICE", "cpu")


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one intra-op thread for a module's tests (for modules of tiny ops), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
