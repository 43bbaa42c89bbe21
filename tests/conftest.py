"""Test-wide settings: tests not marked ``gpu`` run their plans on the CPU, and no test reads or
writes the user's saved calibration profiles.

On a machine with CUDA, ``plan.run`` and ``check_plan`` would otherwise default to the GPUs, and
tests written against CPU references (CPU dropout streams, CPU memory accounting) would compare
across devices; the ``gpu`` tests cover the CUDA path explicitly. ``Cluster.parse`` applies a
profile saved by ``gnncompile calibrate`` (``~/.cache/gnncompile/``: the CPU's, and each GPU
model's); every test gets a profile path of its own that does not exist until the test writes it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

from gnncompile.cost_models.hardware import PROFILE_ENV


@pytest.fixture(scope="session")
def _profiles_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(autouse=True)
def no_saved_profile(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, _profiles_root: Path) -> Path:
    """This test's default CPU profile path (``$GNNCOMPILE_PROFILE``; GPU profiles go beside it): a
    file of its own that does not exist until the test writes it."""
    key = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    path = _profiles_root / key / "cpu_profile.json"
    monkeypatch.setenv(PROFILE_ENV, str(path))
    return path


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


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """A function ``(name, count, memory, **properties)`` that makes ``torch.cuda`` report ``count``
    GPUs called ``name`` with ``memory`` bytes (and ``properties``) for the test: what the planner
    and calibration read of CUDA, on any machine."""
    def fake(name: str, count: int, memory: int, **properties: Any) -> None:
        props = SimpleNamespace(total_memory=memory, **properties)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    return fake



def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker computes with its share of the cores (``torch.set_num_threads``):
    torch's default, every core in every worker, oversubscribes them, and OpenMP threads waiting at
    a barrier spin on cores the other workers need (measured here, 2 workers on 2 cores: a fifth
    of the suite's modules ran 75-81 s with the default, 53-55 s with one thread each). Tests that
    need more threads set them and restore them."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // int(workers)))
