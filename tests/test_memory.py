"""PeakMemory: peak bytes of live tensors in a region, checked against counts made by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gnncompile.errors import RuntimeFailure
from gnncompile.runtime.memory import PeakMemory

MiB = 2**20
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _bytes(n: int, device: str) -> torch.Tensor:
    return torch.ones(n, dtype=torch.uint8, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_peak_is_the_high_water_mark_not_the_total(device: str) -> None:
    with PeakMemory(torch.device(device)) as pm:
        a = _bytes(8 * MiB, device)
        del a
        b = _bytes(4 * MiB, device)
    assert abs(pm.peak_bytes - 8 * MiB) <= 4096
    del b


@pytest.mark.parametrize("device", DEVICES)
def test_region_without_allocations_reports_zero(device: str) -> None:
    x = _bytes(MiB, device)
    with PeakMemory(device) as pm:
        y = x            # no tensor is allocated
        n = sum(range(1000))
    assert pm.peak_bytes <= 1024 and y is x and n
    if device == "cpu":
        assert pm.baseline_bytes is None
    else:
        assert pm.baseline_bytes >= MiB


def test_tensors_live_at_entry_are_not_counted_even_when_freed() -> None:
    old = _bytes(4 * MiB, "cpu")
    with PeakMemory("cpu") as pm:
        del old                       # not the region's: freeing it does not lower the count
        new = _bytes(6 * MiB, "cpu")
        del new
        newer = _bytes(MiB, "cpu")
    assert abs(pm.peak_bytes - 6 * MiB) <= 4096
    del newer


def test_tensors_of_an_earlier_region_are_not_counted() -> None:
    with PeakMemory("cpu"):
        earlier = _bytes(4 * MiB, "cpu")
    with PeakMemory("cpu") as pm:
        del earlier                   # the profiler knows its size: still not this region's
        new = _bytes(2 * MiB, "cpu")
    assert abs(pm.peak_bytes - 2 * MiB) <= 4096
    del new


def test_mlp_forward_backward_matches_a_count_by_hand() -> None:
    """Linear(D, H) -> ReLU -> Linear(H, C) -> cross-entropy, then backward, N rows of float32.

    The high-water mark is in ReLU's backward: its saved output (N x H), the incoming gradient
    (N x H, from the second layer's backward) and the gradient it produces (N x H) are live at once:
    3 N H 4 bytes; everything else (N x C logits and their gradients, H x C and D x H weight
    gradients at other moments) is under 1% of it here.
    """
    torch.manual_seed(0)
    n, d, h, c = 4096, 64, 512, 8
    x, y = torch.randn(n, d), torch.randint(0, c, (n,))
    l1, l2 = torch.nn.Linear(d, h), torch.nn.Linear(h, c)
    with PeakMemory("cpu") as pm:
        F.cross_entropy(l2(torch.relu(l1(x))), y).backward()
    by_hand = 3 * n * h * 4
    assert by_hand <= pm.peak_bytes <= 1.1 * by_hand


@pytest.mark.parametrize("device", DEVICES)
def test_nested_regions_are_each_exact(device: str) -> None:
    with PeakMemory(device) as outer:
        a = _bytes(2 * MiB, device)
        with PeakMemory(device) as inner:
            b = _bytes(8 * MiB, device)
            del b
            c = _bytes(MiB, device)
        del a
        d = _bytes(3 * MiB, device)
    assert abs(inner.peak_bytes - 8 * MiB) <= 4096
    assert abs(outer.peak_bytes - 10 * MiB) <= 4096
    del c, d


def test_foreign_profiler_is_refused_clearly() -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeFailure, match="another torch profiler is active"):
            with PeakMemory("cpu"):
                pass
    with PeakMemory("cpu") as pm:     # and nothing is left in a bad state
        keep = _bytes(MiB, "cpu")
    assert abs(pm.peak_bytes - MiB) <= 4096
    del keep


def test_exception_in_region_still_measures_and_stops_the_profiler() -> None:
    with pytest.raises(ZeroDivisionError):
        with PeakMemory("cpu") as pm:
            keep = _bytes(MiB, "cpu")
            1 / 0
    assert abs(pm.peak_bytes - MiB) <= 4096
    assert not torch.autograd._profiler_enabled()
    del keep


def test_unsupported_device() -> None:
    with pytest.raises(ValueError, match="cpu and cuda"):
        PeakMemory(torch.device("meta"))
