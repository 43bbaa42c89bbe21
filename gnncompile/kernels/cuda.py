"""gnncompile's own CUDA kernels (``csrc/spmm.cu``) as launch plans, and the per-shape choice among kernels.

A product is planned as printable data: :class:`KernelConfig` (lanes per row, columns per lane,
hub-row split) and :func:`spmm_launches` / :func:`sddmm_launches`, which return the
:class:`Launch` records (kernel, grid, block, arguments as NumPy scalars) that a *runner* executes.
:class:`CupyRunner` compiles each kernel instance once per device with NVRTC (CuPy's
``RawModule``, cached on disk by CuPy) and launches it on torch's current stream; any callable
taking a :class:`Launch` can stand in for it (the test suite runs the same launches in a CPU
emulation of the kernels).

:func:`choose` picks among candidate implementations of one product by measurement, once per
shape (the caller caches the choice): each candidate runs on the call's own inputs, one whose
result differs from the reference's (or that fails) is rejected with the reason, and the fastest
of the rest wins. Every choice is kept as a :class:`Choice` (:func:`choices`).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..errors import KernelError

__all__ = [
    "BLOCK",
    "SOURCE",
    "KernelConfig",
    "Launch",
    "DeviceCSR",
    "CupyRunner",
    "kernel_instances",
    "Choice",
    "spmm_configs",
    "sddmm_configs",
    "spmm_launches",
    "sddmm_launches",
    "run_spmm",
    "run_sddmm",
    "attention_group",
    "attention_launches",
    "attention_backward_launches",
    "run_attention",
    "run_attention_backward",
    "dropout_launches",
    "run_dropout_mask",
    "choose",
    "choices",
    "cuda_timer",
    "wall_timer",
]

#: threads per block of every launch
BLOCK = 256
#: the kernels' CUDA source
SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "spmm.cu")
_GROUPS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class KernelConfig:
    """How a kernel maps a product onto threads: ``group`` lanes (a power of two, at most 32) per
    CSR row, ``vec`` consecutive columns per lane (1, 2 or 4: one scalar, ``float2`` or ``float4``
    load), and ``split``: 0 for one group per row, else rows of more than ``split`` edges are cut
    into chunks of ``split`` edges, one group each, added atomically."""

    vec: int
    group: int
    split: int = 0

    def __post_init__(self) -> None:
        if self.vec not in (1, 2, 4) or self.group not in _GROUPS or self.split < 0:
            raise KernelError(f"invalid kernel config {self!r}: vec in (1, 2, 4), group a power of two up to 32, "
                              "split >= 0")

    def __str__(self) -> str:
        return f"raw v{self.vec}g{self.group}" + (f" split {self.split}" if self.split else "")


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the template instance's name expression, grid and block, and the
    arguments in the kernel's parameter order as NumPy scalars (pointers as ``uint64``)."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[Any, ...]

    def __str__(self) -> str:
        return f"{self.kernel} grid={self.grid} block={self.block}"


@dataclass(eq=False)
class DeviceCSR:
    """A CSR structure's arrays as the kernels read them (int64 offsets, the indices as stored),
    its shape and degree statistics, and the hub-row chunk lists per split size (built on first use)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    num_rows: int
    num_cols: int
    max_degree: int
    _chunks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, indptr: torch.Tensor, indices: torch.Tensor, num_rows: int, num_cols: int) -> "DeviceCSR":
        """From a CSR's arrays on the kernels' device (reads the largest degree back once)."""
        if indices.dtype not in (torch.int32, torch.int64):
            raise KernelError(f"CUDA kernels: column indices must be int32 or int64, got {indices.dtype}")
        indptr = indptr.to(torch.int64).contiguous()
        deg = indptr[1:] - indptr[:-1]
        max_degree = int(deg.max()) if num_rows else 0
        return cls(indptr, indices.contiguous(), num_rows, num_cols, max_degree)

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())

    def chunks(self, split: int) -> torch.Tensor:
        """``[K, 2]`` int64 ``(row, first edge)`` of every ``split``-edge chunk of the rows of more
        than ``split`` edges (cached per split)."""
        if split not in self._chunks:
            deg = self.indptr[1:] - self.indptr[:-1]
            hubs = torch.nonzero(deg > split).flatten()
            per_hub = (deg[hubs] + split - 1) // split
            total = int(per_hub.sum()) if hubs.numel() else 0
            rows = torch.repeat_interleave(hubs, per_hub, output_size=total)
            first = torch.repeat_interleave(torch.cumsum(per_hub, 0) - per_hub, per_hub, output_size=total)
            within = torch.arange(total, device=deg.device) - first
            starts = self.indptr[rows] + within * split
            self._chunks[split] = torch.stack([rows, starts], dim=1).contiguous()
        return self._chunks[split]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _vecs(width: int, head_width: int, aligned16: bool) -> list[int]:
    """Column counts per lane that divide the width and a head's width (4 only when 16-byte aligned)."""
    return [v for v in (4, 2, 1) if width % v == 0 and head_width % v == 0 and (v < 4 or aligned16)]


def _splits(max_degree: int, avg_degree: float) -> list[int]:
    """0 (no split) and, on graphs with hub rows, a chunk size of 32 average rows' edges (at least 256)."""
    split = max(256, 32 * math.ceil(avg_degree))
    return [0, split] if max_degree > 2 * split else [0]


def spmm_configs(width: int, head_width: int, aligned16: bool, max_degree: int, avg_degree: float) -> list[KernelConfig]:
    """Candidate configs of an SpMM with rows of ``width`` columns (heads of ``head_width``): per
    valid ``vec``, the group that covers the row in one tile (at most 32 lanes) and half of it,
    each with and without a hub split."""
    out: list[KernelConfig] = []
    for vec in _vecs(width, head_width, aligned16)[:2]:
        full = min(32, _pow2_at_least(-(-width // vec)))
        for group in dict.fromkeys((full, max(1, full // 2))):
            for split in _splits(max_degree, avg_degree):
                out.append(KernelConfig(vec, group, split))
    return out


def sddmm_configs(width: int, head_width: int, aligned16: bool, max_degree: int, avg_degree: float) -> list[KernelConfig]:
    """Candidate configs of an SDDMM: those of :func:`spmm_configs` whose heads reduce over a power
    of two of lanes (empty when none does)."""
    return [c for c in spmm_configs(width, head_width, aligned16, max_degree, avg_degree)
            if _sddmm_reduce(c, width, head_width) is not None]


def _sddmm_reduce(cfg: KernelConfig, width: int, head_width: int) -> Optional[int]:
    """Lanes over which an SDDMM with ``cfg`` reduces a head (None when it cannot): the whole group
    for one head; for several, a head's lanes, a power of two that divides or is divided by the group."""
    if head_width % cfg.vec:
        return None
    if head_width == width:
        return cfg.group
    lanes, tile = head_width // cfg.vec, cfg.group * cfg.vec
    if lanes & (lanes - 1) or not (head_width % tile == 0 or tile % head_width == 0):
        return None
    return min(lanes, cfg.group)


def _ptr(t: Optional[torch.Tensor]) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _index_type(indices: torch.Tensor) -> str:
    return "int" if indices.dtype == torch.int32 else "long long"


def _check_float32(*tensors: Optional[torch.Tensor]) -> None:
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()):
            raise KernelError(f"CUDA kernels: operands must be contiguous float32, got {t.dtype} "
                              f"(contiguous: {t.is_contiguous()})")


def _check_vec(cfg: KernelConfig, width: int, head_width: int, *tensors: Optional[torch.Tensor]) -> None:
    if width % cfg.vec or head_width % cfg.vec:
        raise KernelError(f"{cfg}: {cfg.vec} columns per lane do not divide the width {width} and head width "
                          f"{head_width}")
    if cfg.vec > 1 and any(t is not None and t.data_ptr() % (4 * cfg.vec) for t in tensors):
        raise KernelError(f"{cfg}: float{cfg.vec} loads need {4 * cfg.vec}-byte aligned operands")


def spmm_launches(csr: DeviceCSR, values: Optional[torch.Tensor], heads: int, x: torch.Tensor, out: torch.Tensor,
                  row_scale: Optional[torch.Tensor], col_scale: Optional[torch.Tensor], transpose: bool,
                  cfg: KernelConfig) -> list[Launch]:
    """The launches of ``out (+)= (diag(row_scale) A_values diag(col_scale)) x`` (``transpose``:
    its transpose, pushed from the rows with atomic adds, into ``out`` zeroed beforehand).

    ``x`` and ``out`` are ``[*, width]`` float32, contiguous; ``values`` ``[E * heads]`` or None.
    Pull without split writes every output row; otherwise ``out`` must be zero on entry.
    """
    _check_float32(values, x, out, row_scale, col_scale)
    width = x.shape[1]
    head_width = width // heads
    if heads < 1 or width % heads:
        raise KernelError(f"CUDA spmm: width {width} is not divisible by {heads} heads")
    _check_vec(cfg, width, head_width, x, out)
    push = "true" if transpose else "false"
    it = _index_type(csr.indices)
    per_block = BLOCK // cfg.group
    tiles = -(-width // (cfg.group * cfg.vec))
    common = (_ptr(values), np.int32(heads), _ptr(x), _ptr(out), _ptr(row_scale), _ptr(col_scale))
    launches = []
    if csr.num_rows:
        launches.append(Launch(
            f"spmm_rows<{it}, {cfg.vec}, {cfg.group}, {push}>", (-(-csr.num_rows // per_block), tiles, 1),
            (BLOCK, 1, 1),
            (_ptr(csr.indptr), _ptr(csr.indices)) + common
            + (np.int64(csr.num_rows), np.int32(width), np.int32(head_width), np.int64(cfg.split))))
    if cfg.split and csr.max_degree > cfg.split:
        chunks = csr.chunks(cfg.split)
        launches.append(Launch(
            f"spmm_chunks<{it}, {cfg.vec}, {cfg.group}, {push}>", (-(-chunks.shape[0] // per_block), tiles, 1),
            (BLOCK, 1, 1),
            (_ptr(csr.indptr), _ptr(csr.indices)) + common
            + (_ptr(chunks), np.int64(chunks.shape[0]), np.int32(width), np.int32(head_width), np.int64(cfg.split))))
    return launches


def sddmm_launches(csr: DeviceCSR, a: torch.Tensor, b: torch.Tensor, heads: int, out: torch.Tensor,
                   cfg: KernelConfig) -> list[Launch]:
    """The launches of ``out[e, h] = <a[row(e), h], b[col(e), h]>`` (``a``, ``b``: ``[*, width]``
    float32 contiguous; ``out``: ``[E, heads]``)."""
    _check_float32(a, b, out)
    width = a.shape[1]
    if heads < 1 or width % heads or b.shape[1] != width:
        raise KernelError(f"CUDA sddmm: widths {a.shape[1]} and {b.shape[1]} with {heads} heads")
    head_width = width // heads
    _check_vec(cfg, width, head_width, a, b)
    reduce = _sddmm_reduce(cfg, width, head_width)
    if reduce is None:
        raise KernelError(f"{cfg}: a head of {head_width} columns does not reduce over a power of two of lanes")
    it = _index_type(csr.indices)
    per_block = BLOCK // cfg.group
    tail = (np.int32(heads), np.int32(width), np.int32(head_width), np.int32(reduce), np.int64(cfg.split))
    launches = []
    if csr.num_rows:
        launches.append(Launch(
            f"sddmm_rows<{it}, {cfg.vec}, {cfg.group}>", (-(-csr.num_rows // per_block), 1, 1), (BLOCK, 1, 1),
            (_ptr(csr.indptr), _ptr(csr.indices), _ptr(a), _ptr(b), _ptr(out), np.int64(csr.num_rows)) + tail))
    if cfg.split and csr.max_degree > cfg.split:
        chunks = csr.chunks(cfg.split)
        launches.append(Launch(
            f"sddmm_chunks<{it}, {cfg.vec}, {cfg.group}>", (-(-chunks.shape[0] // per_block), 1, 1), (BLOCK, 1, 1),
            (_ptr(csr.indptr), _ptr(csr.indices), _ptr(a), _ptr(b), _ptr(out), _ptr(chunks),
             np.int64(chunks.shape[0])) + tail))
    return launches


Runner = Callable[[Launch], None]


#: the dropout mask kernel's instances per output dtype (a bool mask is written as bytes 0 and 1)
_MASK_TYPES = {torch.float32: "float", torch.float64: "double", torch.bool: "unsigned char"}
_MASK_SCALARS = {torch.float32: np.float32, torch.float64: np.float64, torch.bool: np.uint8}
#: the dropout kernel's most blocks (its threads loop over the rest)
_MASK_MAX_BLOCKS = 8192


def dropout_launches(rows: Optional[torch.Tensor], width: int, key: tuple[int, int], threshold: int,
                     scale: float, out: torch.Tensor) -> list[Launch]:
    """The launch writing ``out`` (``[n, width]`` contiguous, float32, float64 or bool) with the
    dropout mask of :mod:`gnncompile.kernels.dropout` under Philox key ``key`` (two 32-bit words):
    rows ``rows`` (int64 ``[n]`` on ``out``'s device) of the whole tensor's mask, or its first ``n``
    rows when ``rows`` is None. ``scale`` is the kept elements' value (ignored for bool)."""
    if out.dtype not in _MASK_TYPES or not out.is_contiguous() or out.dim() != 2 or out.shape[1] != width:
        raise KernelError(f"CUDA dropout_mask: out must be a contiguous [n, {width}] tensor of "
                          f"{list(_MASK_TYPES)}, got {out.dtype} {list(out.shape)}")
    if rows is not None and (rows.dtype != torch.int64 or rows.dim() != 1 or rows.numel() != out.shape[0]):
        raise KernelError(f"CUDA dropout_mask: rows must be int64 [{out.shape[0]}], got {rows.dtype} {list(rows.shape)}")
    total = out.numel()
    if total == 0:
        return []
    units = total if rows is not None else -(-total // 4)
    value = _MASK_SCALARS[out.dtype](1 if out.dtype == torch.bool else scale)
    return [Launch(f"dropout_mask<{_MASK_TYPES[out.dtype]}>", (min(-(-units // BLOCK), _MASK_MAX_BLOCKS), 1, 1),
                   (BLOCK, 1, 1),
                   (_ptr(rows), np.int64(out.shape[0]), np.int64(width), np.uint32(key[0]), np.uint32(key[1]),
                    np.uint32(threshold), value, _ptr(out)))]


def run_dropout_mask(rows: Optional[torch.Tensor], num: int, width: int, key: tuple[int, int], threshold: int,
                     scale: float, dtype: torch.dtype, device: torch.device, run: Runner) -> torch.Tensor:
    """A new ``[num, width]`` mask of :func:`dropout_launches` (``num`` rows: ``rows``'s, or the first)."""
    out = torch.empty((num, width), dtype=dtype, device=device)
    with _device_of(out):
        for launch in dropout_launches(rows, width, key, threshold, scale, out):
            run(launch)
    return out


def _device_of(t: torch.Tensor) -> Any:
    """A context making ``t``'s GPU the current device (kernels launch on the current one); nothing
    for a tensor off the GPU (a runner that emulates the launches)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def run_spmm(csr: DeviceCSR, values: Optional[torch.Tensor], x: torch.Tensor, row_scale: Optional[torch.Tensor],
             col_scale: Optional[torch.Tensor], transpose: bool, cfg: KernelConfig, run: Runner) -> torch.Tensor:
    """The product of :func:`spmm_launches` into a new ``[rows, width]`` tensor, with ``values``
    ``[E]`` or ``[E, H]`` (H heads of ``width / H`` columns) or None."""
    heads = 1 if values is None or values.dim() == 1 else values.shape[1]
    rows = csr.num_cols if transpose else csr.num_rows
    zero = transpose or cfg.split and csr.max_degree > cfg.split
    out = (torch.zeros if zero else torch.empty)((rows, x.shape[1]), dtype=x.dtype, device=x.device)
    vals = None if values is None else values.contiguous()
    with _device_of(x):
        for launch in spmm_launches(csr, vals, heads, x, out, row_scale, col_scale, transpose, cfg):
            run(launch)
    return out


def run_sddmm(csr: DeviceCSR, a: torch.Tensor, b: torch.Tensor, heads: int, cfg: KernelConfig, run: Runner) -> torch.Tensor:
    """The SDDMM of :func:`sddmm_launches` into a new ``[E, heads]`` tensor."""
    out = torch.empty((csr.nnz, heads), dtype=a.dtype, device=a.device)
    with _device_of(a):
        for launch in sddmm_launches(csr, a, b, heads, out, cfg):
            run(launch)
    return out


def kernel_instances() -> tuple[str, ...]:
    """The name expression of every kernel instance a launch plan can name (the module's contents)."""
    names: list[str] = []
    for it in ("int", "long long"):
        for vec in (1, 2, 4):
            for group in _GROUPS:
                for push in ("false", "true"):
                    names += [f"spmm_rows<{it}, {vec}, {group}, {push}>", f"spmm_chunks<{it}, {vec}, {group}, {push}>"]
                names += [f"sddmm_rows<{it}, {vec}, {group}>", f"sddmm_chunks<{it}, {vec}, {group}>"]
        for group in _GROUPS:
            names += [f"attention_forward<{it}, {group}>", f"attention_backward<{it}, {group}>"]
    names += [f"dropout_mask<{t}>" for t in _MASK_TYPES.values()]
    return tuple(names)


class CupyRunner:
    """Runs :class:`Launch` records on CUDA through CuPy, on torch's current stream. Every kernel
    instance (:func:`kernel_instances`) is compiled in one NVRTC module (``-std=c++17``) on a
    device's first launch; CuPy keeps the binary in its on-disk cache, so later processes load it."""

    def __init__(self) -> None:
        with open(SOURCE) as f:
            self.source = f.read()
        self._modules: dict[int, Any] = {}
        self._functions: dict[tuple[int, str], Any] = {}
        self._lock = threading.Lock()

    def function(self, device: int, kernel: str) -> Any:
        """The compiled kernel ``kernel`` (a name expression of :func:`kernel_instances`) on CUDA device ``device``."""
        key = (device, kernel)
        with self._lock:
            if key not in self._functions:
                import cupy

                with cupy.cuda.Device(device):
                    if device not in self._modules:
                        self._modules[device] = cupy.RawModule(code=self.source, options=("-std=c++17",),
                                                               name_expressions=kernel_instances())
                    self._functions[key] = self._modules[device].get_function(kernel)
            return self._functions[key]

    def __call__(self, launch: Launch) -> None:
        """Launch on the current CUDA device (the ``run_*`` functions enter their operands')."""
        import cupy

        dev = torch.device("cuda", torch.cuda.current_device())
        fn = self.function(dev.index, launch.kernel)
        stream = torch.cuda.current_stream(dev)
        with cupy.cuda.Device(dev.index), cupy.cuda.ExternalStream(stream.cuda_stream, dev.index):
            fn(launch.grid, launch.block, launch.args)


@dataclass
class Choice:
    """One choice among implementations of a product: what was chosen for which shape, every
    candidate's best time (ms), and the rejected ones with the reason."""

    op: str
    shape: str
    times_ms: dict[str, float]
    rejected: dict[str, str]
    chosen: str

    def __str__(self) -> str:
        times = ", ".join(f"{k} {v:.3f}" for k, v in sorted(self.times_ms.items(), key=lambda kv: kv[1]))
        rej = "".join(f"; rejected {k}: {v}" for k, v in self.rejected.items())
        return f"{self.op} {self.shape}: {self.chosen} ({times} ms{rej})"


_choices: list[Choice] = []
_choices_lock = threading.Lock()


def choices() -> list[Choice]:
    """Every choice :func:`choose` made in this process, in order."""
    with _choices_lock:
        return list(_choices)


def _best_ms(fn: Callable[[], Any], repeats: int, timed: Callable[[Callable[[], Any]], float]) -> float:
    """Best of ``repeats`` times (ms, by ``timed``) of ``fn`` after one warm-up call."""
    fn()
    return min(timed(fn) for _ in range(repeats))


def cuda_timer(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Best time of ``fn`` in ms over ``repeats`` calls after one warm-up, by CUDA events on the current stream."""
    def timed(f: Callable[[], Any]) -> float:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)
    return _best_ms(fn, repeats, timed)


def wall_timer(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Best wall time of ``fn`` in ms over ``repeats`` calls after one warm-up (host-side work)."""
    def timed(f: Callable[[], Any]) -> float:
        t = time.perf_counter()
        f()
        return (time.perf_counter() - t) * 1e3
    return _best_ms(fn, repeats, timed)


def _mismatch(out: Any, ref: torch.Tensor) -> Optional[str]:
    """Why ``out`` is not ``ref`` up to float32 reordering (None when it is)."""
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape or out.dtype != ref.dtype:
        return f"result {getattr(out, 'shape', type(out).__name__)} is not {tuple(ref.shape)} {ref.dtype}"
    if not ref.numel():
        return None
    scale = float(ref.abs().max())
    err = float((out - ref).abs().max())
    if not math.isfinite(err) or err > 1e-4 * scale:
        return f"largest deviation from the reference {err:.3g} (largest entry {scale:.3g})"
    return None


def choose(op: str, shape: str, candidates: dict[str, Callable[[], torch.Tensor]], reference: str,
           timer: Callable[[Callable[[], Any]], float] = cuda_timer) -> str:
    """The fastest candidate whose result matches ``candidates[reference]``'s.

    Each candidate computes the product on the call's inputs. The reference runs first and must
    succeed (its error propagates); another candidate that raises or deviates beyond float32
    reordering (relative 1e-4 of the largest entry) is rejected. The choice is recorded
    (:func:`choices`); the caller caches it per shape. On a GPU only errors raised at launch
    (compilation, launch configuration) reject a candidate: a fault inside a kernel (an
    out-of-bounds or misaligned access) is asynchronous and sticky, and every later CUDA call of
    the process fails, so the launches check what they can first (:func:`spmm_launches`).
    """
    if reference not in candidates:
        raise KernelError(f"choose: reference {reference!r} is not a candidate")
    ref = candidates[reference]()
    times = {reference: timer(candidates[reference])}
    rejected: dict[str, str] = {}
    for name, fn in candidates.items():
        if name == reference:
            continue
        try:
            why = _mismatch(fn(), ref)
            if why is None:
                times[name] = timer(fn)
            else:
                rejected[name] = why
        except Exception as exc:  # a kernel that does not compile or launch here: not a candidate
            if _faulted(exc):  # ...but a fault inside a kernel breaks the process's CUDA context: say so here
                raise
            rejected[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    chosen = min(times, key=times.__getitem__)
    with _choices_lock:
        _choices.append(Choice(op, shape, times, rejected, chosen))
    return chosen


def _faulted(exc: BaseException) -> bool:
    """Whether ``exc`` (or a synchronization after it) reports a fault of the CUDA context (an
    illegal or misaligned access in a kernel), which no later CUDA call survives."""
    text = str(exc)
    if "CUDA error" in text or "CUDA_ERROR_" in text or type(exc).__name__ == "AcceleratorError":
        return True   # (torch's "CUDA error: ..."; CuPy's "CUDA_ERROR_ILLEGAL_ADDRESS: ...")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            for device in range(torch.cuda.device_count()):  # (the candidate's operands may be on any)
                torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - the context is gone: the candidate's fault
            return True
    return False


def attention_group(heads: int, avg_degree: float) -> Optional[int]:
    """Lanes per row of the attention kernels: enough for a row's (edge, head) pairs at the average
    degree, at least ``heads`` and at most 32 (None when ``heads`` is not a power of two up to 32)."""
    if heads < 1 or heads > 32 or heads & (heads - 1):
        return None
    return min(32, max(heads, _pow2_at_least(math.ceil(max(avg_degree, 1.0) * heads))))


def _attention_common(csr: DeviceCSR, src: torch.Tensor, dst: torch.Tensor, heads: int, group: int) -> None:
    _check_float32(src, dst)
    if attention_group(heads, 1.0) is None or group < heads or group not in _GROUPS:
        raise KernelError(f"CUDA attention: {heads} heads need a power of two up to 32 and a group of at least as "
                          f"many lanes, got a group of {group}")


def attention_launches(csr: DeviceCSR, src: torch.Tensor, dst: torch.Tensor, alpha: torch.Tensor, heads: int,
                       slope: float, loops: bool, own_offset: int, group: int) -> list[Launch]:
    """The launch of GAT's fused attention: ``alpha`` ``[E (+ rows), heads]`` from the scores
    ``src`` ``[cols, heads]`` and ``dst`` ``[rows, heads]`` (see ``attention_forward`` in the source)."""
    _attention_common(csr, src, dst, heads, group)
    _check_float32(alpha)
    if not csr.num_rows:
        return []
    return [Launch(f"attention_forward<{_index_type(csr.indices)}, {group}>",
                   (-(-csr.num_rows // (BLOCK // group)), 1, 1), (BLOCK, 1, 1),
                   (_ptr(csr.indptr), _ptr(csr.indices), _ptr(src), _ptr(dst), _ptr(alpha), np.int64(csr.num_rows),
                    np.int64(csr.nnz), np.int32(heads), np.int32(heads.bit_length() - 1), np.float32(slope),
                    np.int32(loops), np.int64(own_offset)))]


def attention_backward_launches(csr: DeviceCSR, src: torch.Tensor, dst: torch.Tensor, alpha: torch.Tensor,
                                grad: torch.Tensor, gs: torch.Tensor, g_dst: torch.Tensor, heads: int, slope: float,
                                loops: bool, own_offset: int, group: int) -> list[Launch]:
    """The launch of the fused attention's backward: the scores' gradient ``gs`` (shaped as
    ``alpha``) and its row sums ``g_dst`` ``[rows, heads]`` from ``alpha`` and its gradient ``grad``."""
    _attention_common(csr, src, dst, heads, group)
    _check_float32(alpha, grad, gs, g_dst)
    if not csr.num_rows:
        return []
    return [Launch(f"attention_backward<{_index_type(csr.indices)}, {group}>",
                   (-(-csr.num_rows // (BLOCK // group)), 1, 1), (BLOCK, 1, 1),
                   (_ptr(csr.indptr), _ptr(csr.indices), _ptr(src), _ptr(dst), _ptr(alpha), _ptr(grad), _ptr(gs),
                    _ptr(g_dst), np.int64(csr.num_rows), np.int64(csr.nnz), np.int32(heads),
                    np.int32(heads.bit_length() - 1), np.float32(slope), np.int32(loops), np.int64(own_offset)))]


def run_attention(csr: DeviceCSR, src: torch.Tensor, dst: torch.Tensor, slope: float, loops: bool, own_offset: int,
                  run: Runner) -> torch.Tensor:
    """GAT's attention coefficients ``[E (+ rows), *head_shape]`` by the fused kernel (scores
    ``[cols, *head_shape]`` / ``[rows, *head_shape]``, float32)."""
    heads = math.prod(src.shape[1:])
    group = attention_group(heads, csr.nnz / max(1, csr.num_rows))
    if group is None:
        raise KernelError(f"CUDA attention: {heads} heads is not a power of two up to 32")
    alpha = torch.empty((csr.nnz + (csr.num_rows if loops else 0),) + tuple(src.shape[1:]), dtype=src.dtype,
                        device=src.device)
    # the launches hold raw pointers: the operands' contiguous copies stay referenced until they ran
    src, dst = src.contiguous(), dst.contiguous()
    with _device_of(src):
        for launch in attention_launches(csr, src, dst, alpha, heads, slope, loops, own_offset, group):
            run(launch)
    return alpha


def run_attention_backward(csr: DeviceCSR, src: torch.Tensor, dst: torch.Tensor, alpha: torch.Tensor,
                           grad: torch.Tensor, slope: float, loops: bool, own_offset: int, run: Runner
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gs, g_dst)`` of :func:`attention_backward_launches` in new tensors."""
    heads = math.prod(src.shape[1:])
    group = attention_group(heads, csr.nnz / max(1, csr.num_rows))
    if group is None:
        raise KernelError(f"CUDA attention: {heads} heads is not a power of two up to 32")
    # (contiguous: empty_like would copy a permuted alpha's strides)
    gs = torch.empty(alpha.shape, dtype=alpha.dtype, device=alpha.device)
    g_dst = torch.empty((csr.num_rows,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    # the launches hold raw pointers: the operands' contiguous copies stay referenced until they ran
    src, dst, alpha, grad = src.contiguous(), dst.contiguous(), alpha.contiguous(), grad.contiguous()
    with _device_of(src):
        for launch in attention_backward_launches(csr, src, dst, alpha, grad, gs, g_dst, heads, slope, loops,
                                                  own_offset, group):
            run(launch)
    return gs, g_dst
