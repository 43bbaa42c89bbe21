"""Peak memory of live tensors in a region of code, per device.

:class:`PeakMemory` is a context manager that reports how far the bytes held by live tensors rose
above their level at entry while the region ran::

    with PeakMemory(torch.device("cpu")) as pm:
        loss = model(x).sum(); loss.backward()
    pm.peak_bytes   # e.g. activations + gradients + temporaries at their high-water mark

What is counted:

- **CUDA**: the caching allocator's statistics. ``baseline_bytes`` is
  ``torch.cuda.memory_allocated(device)`` at entry; ``peak_bytes`` is
  ``torch.cuda.max_memory_allocated(device)`` during the region minus the baseline (allocated
  blocks, rounded up by the allocator to 512 bytes; the allocator's cached but unused memory is not
  counted).
- **CPU**: every allocation and free made through PyTorch's CPU allocator (tensor storages,
  including autograd's saved tensors, gradients and the temporaries kernels allocate inside an
  operator), taken from the PyTorch profiler's memory events (``profile_memory=True``): the events
  are put in time order and ``peak_bytes`` is the largest running sum, i.e. the high-water mark of
  (live tensor bytes - live tensor bytes at entry). Frees of tensors that were already live at
  entry count (they lower the running sum), so the number is net of what the region released.
  Memory that does not go through the PyTorch allocator (NumPy/SciPy arrays, Python objects,
  library buffers) is not counted; neither is process RSS. ``baseline_bytes`` is ``None``: the CPU
  allocator keeps no running total.

Overhead on CPU: the profiler records every operator, about 4 us per operator on top of the
operator itself (a region of 20 small element-wise ops: ~25 us without, ~100 us with; see
``tests/test_memory.py``), plus 1-3 ms to start and stop the profiler. Measure one training step,
not every one.

Nesting: regions nest (inner regions must exit first, as ``with`` blocks do). On CPU the profiler
cannot run twice at once, so entering or leaving a nested region stops the running profiler,
folds its events into every open region and starts a new one; each region's result is exact.
On CUDA a nested region's peak reset is compensated for in the enclosing regions. A torch profiler
started by other code cannot be shared: entering a CPU region while one is active raises
:class:`~gnncompile.errors.RuntimeFailure` (measure outside that profiler instead). The state is
per process; use regions from one thread at a time.

Quiet output: Kineto (the profiler's backend) prints ``USDT ... profiler_start`` lines on stderr
unless ``KINETO_LOG_LEVEL`` is set. If it is unset, it is set to ``6`` (silent) while the profiler
starts; Kineto reads it once per process, so this also silences later profilers in the process.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Iterable, Optional

import torch
from torch.autograd import DeviceType

from ..errors import RuntimeFailure

__all__ = ["PeakMemory"]

_KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL"


class PeakMemory:
    """Context manager measuring the peak bytes of live tensors on ``device`` inside a region.

    After the region exits, ``peak_bytes`` holds the high-water mark of live tensor bytes above
    their level at entry (never negative) and ``baseline_bytes`` the bytes live at entry where the
    device can tell (CUDA), else ``None``. See the module docstring for exactly what is counted.
    """

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"PeakMemory supports cpu and cuda devices, got {device}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.peak_bytes = 0
        self.baseline_bytes: Optional[int] = None
        self._live = 0       # CPU: net bytes allocated since entry, over the segments folded so far
        self._carried = 0    # CUDA: absolute peak reached before a nested region reset the statistics

    def __enter__(self) -> "PeakMemory":
        self.peak_bytes = 0
        self._live = self._carried = 0
        if self.device.type == "cuda":
            _cuda_enter(self)
        else:
            _cpu_enter(self)
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if self.device.type == "cuda":
            _cuda_exit(self)
        else:
            _cpu_exit(self)


# --- CUDA: allocator statistics --------------------------------------------------------------------

_cuda_open: list[PeakMemory] = []


def _cuda_enter(meter: PeakMemory) -> None:
    dev = meter.device
    torch.cuda.synchronize(dev)
    peak_so_far = torch.cuda.max_memory_allocated(dev)
    for m in _cuda_open:      # the reset below would hide their peak so far
        if m.device == dev:
            m._carried = max(m._carried, peak_so_far)
    meter.baseline_bytes = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    _cuda_open.append(meter)


def _cuda_exit(meter: PeakMemory) -> None:
    _pop(_cuda_open, meter)
    torch.cuda.synchronize(meter.device)
    peak = max(meter._carried, torch.cuda.max_memory_allocated(meter.device))
    meter.peak_bytes = max(0, peak - (meter.baseline_bytes or 0))


# --- CPU: profiler memory events, in segments --------------------------------------------------------

_cpu_open: list[PeakMemory] = []
_cpu_profiler: Optional[torch.autograd.profiler.profile] = None


def _cpu_enter(meter: PeakMemory) -> None:
    if _cpu_profiler is None and torch.autograd._profiler_enabled():
        raise RuntimeFailure("PeakMemory cannot measure CPU memory while another torch profiler is active; "
                             "measure outside that profiler (or profile with profile_memory=True and read "
                             "its memory events)")
    _end_segment()
    _cpu_open.append(meter)
    _start_segment()


def _cpu_exit(meter: PeakMemory) -> None:
    _end_segment()
    _pop(_cpu_open, meter)
    if _cpu_open:
        _start_segment()


def _start_segment() -> None:
    """Start a profiler recording memory events (Kineto kept quiet unless the user set its level)."""
    global _cpu_profiler
    prof = torch.autograd.profiler.profile(use_kineto=True, use_cpu=True, profile_memory=True)
    quiet = _KINETO_LOG_LEVEL not in os.environ
    if quiet:
        os.environ[_KINETO_LOG_LEVEL] = "6"
    try:
        prof.__enter__()
    finally:
        if quiet:
            del os.environ[_KINETO_LOG_LEVEL]
    _cpu_profiler = prof


def _end_segment() -> None:
    """Stop the running profiler, if any, and fold its memory events into every open region."""
    global _cpu_profiler
    if _cpu_profiler is None:
        return
    prof, _cpu_profiler = _cpu_profiler, None
    prof.__exit__(None, None, None)
    net, peak = _running_peak(
        (e.start_ns(), e.nbytes()) for e in prof.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    for m in _cpu_open:
        m.peak_bytes = max(m.peak_bytes, m._live + peak)
        m._live += net


def _running_peak(deltas: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """``(net, peak)`` of byte deltas ``(time_ns, bytes)``: their sum and largest prefix sum (>= 0),
    in time order (ties keep the recording order)."""
    total = peak = 0
    for _, nbytes in sorted(deltas, key=lambda d: d[0]):
        total += nbytes
        peak = max(peak, total)
    return total, peak


def _pop(stack: list[PeakMemory], meter: PeakMemory) -> None:
    if not stack or stack[-1] is not meter:
        raise RuntimeError("PeakMemory regions must exit in the reverse order of entry")
    stack.pop()
