"""Dropout masks from a counter-based generator: any rows of a mask, drawn independently.

A mask is a function of a 64-bit ``seed`` and each element's flat index ``k`` in the whole
``[num_rows, *row_shape]`` tensor: element ``k`` is kept (multiplier ``1 / (1 - p)``, else 0) iff
word ``k mod 4`` of Philox4x32-10 (Salmon et al., SC'11, the generator of JAX and cuRAND) at
counter ``(k div 4, 0)`` under key ``(seed mod 2^32, seed div 2^32)`` is at least
``floor(p * 2^32)``. So a rank holding some rows of a tensor computes exactly those rows of the
whole tensor's mask, in work proportional to its rows, and the result does not depend on the
thread count, the device or which rows are asked for together.

:func:`dropout_mask` runs the native CPU kernel (``csrc/spmm.cpp``, parallel over rows) when the
extension builds, the CUDA kernel (``csrc/spmm.cu``, through CuPy) for masks on a GPU when CuPy is
installed, else the same arithmetic in torch operations (any device; about 150 elementwise
operations over int64 words: much slower than either kernel).
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence

import torch

from ..errors import KernelError
from . import _import_cupy, _load_native, _memo_for, _raw_runner, cuda, native_edge_ops

__all__ = ["dropout_mask", "philox4x32", "keep_threshold", "keep_times"]

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl increments of the key
_NATIVE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool)


def keep_threshold(p: float) -> int:
    """The smallest 32-bit word that keeps an element: ``floor(p * 2^32)`` (keep probability
    ``1 - threshold / 2^32``, within ``2^-32`` of ``1 - p``)."""
    return int(p * 4294967296.0)


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` 32-bit halves of ``a * m`` for ``a`` holding 32-bit words in int64, computed in
    16-bit pieces so that no intermediate leaves int64's range."""
    m_hi, m_lo = m >> 16, m & 0xFFFF
    t_lo = a * m_lo  # < 2^48
    t_hi = a * m_hi  # < 2^48
    low = (t_lo & _MASK32) + ((t_hi & 0xFFFF) << 16)  # < 2^33
    lo = low & _MASK32
    hi = (t_hi >> 16) + (t_lo >> 32) + (low >> 32)
    return hi & _MASK32, lo


def _philox_torch(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: int, k1: int
                  ) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on tensors of 32-bit words held in int64 (any device)."""
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox4x32(counter: Sequence[int], key: Sequence[int], native: bool = False) -> list[int]:
    """One Philox4x32-10 block: four 32-bit words of ``counter`` under two of ``key`` (the native
    kernel's when ``native``, else the torch implementation's)."""
    if len(counter) != 4 or len(key) != 2:
        raise KernelError(f"philox4x32: need 4 counter words and 2 key words, got {len(counter)} and {len(key)}")
    if native:
        return [int(w) for w in _load_native().philox4x32([int(c) & _MASK32 for c in counter],
                                                          [int(k) & _MASK32 for k in key])]
    words = [torch.tensor([int(c) & _MASK32], dtype=torch.int64) for c in counter]
    return [int(w) for w in _philox_torch(*words, int(key[0]) & _MASK32, int(key[1]) & _MASK32)]


def _mask_torch(seed: int, p: float, num_rows: int, width: int, rows: Optional[torch.Tensor],
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`dropout_mask` in torch operations: the words of the blocks the elements fall in."""
    r = torch.arange(num_rows, dtype=torch.int64, device=device) if rows is None else rows.to(device, torch.int64)
    base = r * width
    cols = torch.arange(width, dtype=torch.int64, device=device)
    # the blocks covering each row (ceil(width / 4) + 1 of them, the last maybe unused), not one
    # block per element
    spans = (width + 3) // 4 + 1
    block = (base >> 2).unsqueeze(1) + torch.arange(spans, dtype=torch.int64, device=device)
    zeros = torch.zeros_like(block)
    words = torch.stack(_philox_torch(block & _MASK32, block >> 32, zeros, zeros,
                                      seed & _MASK32, (seed >> 32) & _MASK32), dim=2).reshape(r.numel(), 4 * spans)
    word = words.gather(1, (base & 3).unsqueeze(1) + cols).reshape(-1)
    keep = word >= keep_threshold(p)
    if dtype == torch.bool:
        return keep.reshape(r.numel(), width)
    scale = _multiplier(p, dtype)
    return keep.to(dtype).mul_(scale).reshape(r.numel(), width)  # where(keep, scale, 0), faster


def _multiplier(p: float, dtype: torch.dtype) -> torch.Tensor:
    """A kept element's value ``1 / (1 - p)`` rounded to ``dtype``, as a host scalar (a 0-dim CPU
    tensor: no copy to the device)."""
    return torch.tensor(1.0 / (1.0 - p), dtype=torch.float64).to(dtype)


def _cuda_kernel(device: torch.device) -> bool:
    """Whether the CUDA mask kernel runs on ``device`` (CuPy installed and the kernels' module
    compiled there, once per process and device); if not, a warning says why, once, and masks on
    the GPU come from torch operations."""
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _cuda_ready:
        try:
            _import_cupy()
            _raw_runner().function(index, f"dropout_mask<{cuda._MASK_TYPES[torch.bool]}>")
            _cuda_ready[index] = True
        except KernelError:  # CuPy not installed: torch operations, as documented
            _cuda_ready[index] = False
        except Exception as exc:  # installed but broken (another CUDA major, no NVRTC): say so
            warnings.warn(f"gnncompile: the CUDA dropout-mask kernel does not build on {device} "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); masks on the GPU "
                          "are drawn with torch operations (bit for bit the same, several times slower)", stacklevel=3)
            _cuda_ready[index] = False
    return _cuda_ready[index]


#: per CUDA device index, whether the mask kernel runs there (:func:`_cuda_kernel`)
_cuda_ready: dict[int, bool] = {}


def _mask_cuda(seed: int, p: float, n: int, width: int, rows: Optional[torch.Tensor], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """:func:`dropout_mask` by the CUDA kernel (one launch); other float dtypes are the kernel's
    bool mask cast and scaled as :func:`_mask_torch` does, bit for bit."""
    idx = None if rows is None else rows.to(device, torch.int64).contiguous()
    kind = dtype if dtype in (torch.float32, torch.float64, torch.bool) else torch.bool
    scale = _multiplier(p, dtype)
    out = cuda.run_dropout_mask(idx, n, width, (seed & _MASK32, (seed >> 32) & _MASK32), keep_threshold(p),
                                float(scale) if kind != torch.bool else 1.0, kind, device, _raw_runner())
    return out if kind == dtype else out.to(dtype).mul_(scale)


#: the row tensors whose bounds :func:`dropout_mask` checked, per row count (:func:`_memo_for`)
_checked: dict = {}


def _check_rows(rows: torch.Tensor, num_rows: int) -> None:
    """Raise unless every entry of ``rows`` is in ``[0, num_rows)``; a tensor already checked for
    ``num_rows`` and unchanged since (its version) is not read again: reading its bounds is a host
    synchronization on a GPU, and a plan draws masks for the same rows every step."""
    def check() -> bool:
        low, high = torch.stack(torch.aminmax(rows)).tolist()  # one read
        if low < 0 or high >= num_rows:
            raise KernelError(f"dropout_mask: rows must be in [0, {num_rows})")
        return True

    if rows.numel():
        _memo_for(_checked, f"rows<{num_rows}", (rows,), check)


def dropout_mask(seed: int, p: float, num_rows: int, row_shape: Sequence[int] = (), *,
                 rows: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", native: Optional[bool] = None) -> torch.Tensor:
    """The dropout multipliers (0 or ``1 / (1 - p)``, of ``dtype``; for ``torch.bool``, whether an
    element is kept) of rows ``rows`` (1-d integer
    tensor; ``None``: every row) of a ``[num_rows, *row_shape]`` tensor: ``[len(rows), *row_shape]``.

    ``seed`` is any integer in ``[0, 2^64)`` (see the module docstring for the exact rule).
    ``native``: force (``True``) or forbid (``False``) the native CPU kernel; by default it is used
    for CPU outputs when it builds, and CUDA outputs come from the CUDA kernel when CuPy is
    installed (``native=False``: from torch operations there too). Raises :class:`KernelError` for ``p`` outside ``[0, 1)``, rows
    outside ``[0, num_rows)`` or a negative size.
    """
    if not 0.0 <= p < 1.0:
        raise KernelError(f"dropout_mask: p must be in [0, 1), got {p}")
    if num_rows < 0 or any(int(d) < 0 for d in row_shape):
        raise KernelError(f"dropout_mask: sizes must be non-negative, got {num_rows} rows of {tuple(row_shape)}")
    if not 0 <= seed < 2**64:
        raise KernelError(f"dropout_mask: seed must be in [0, 2^64), got {seed}")
    device = torch.device(device)
    width = math.prod(int(d) for d in row_shape)
    shape = tuple(int(d) for d in row_shape)
    if rows is not None:
        if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype == torch.bool:
            raise KernelError(f"dropout_mask: rows must be a 1-d integer tensor, got {rows.dtype} {list(rows.shape)}")
        _check_rows(rows, num_rows)
    n = num_rows if rows is None else rows.numel()
    use_native = native if native is not None else (device.type == "cpu" and dtype in _NATIVE_DTYPES)
    if use_native:
        if device.type != "cpu" or dtype not in _NATIVE_DTYPES:
            raise KernelError(f"dropout_mask: the native kernel draws CPU masks of {_NATIVE_DTYPES}, "
                              f"not {dtype} on {device}")
        try:
            mod = _load_native()
        except KernelError:
            if native:
                raise
        else:
            # the kernel takes the seed's 64 bits as a signed integer
            signed = seed - 2**64 if seed >= 2**63 else seed
            idx = None if rows is None else rows.to("cpu", torch.int64).contiguous()
            return mod.dropout_mask(signed, float(p), int(num_rows), width, idx, dtype).reshape((n,) + shape)
    if n == 0 or width == 0:
        return torch.empty((n,) + shape, dtype=dtype, device=device)
    if device.type == "cuda" and native is None and _cuda_kernel(device):
        return _mask_cuda(seed, float(p), n, width, rows, dtype, device).reshape((n,) + shape)
    return _mask_torch(seed, float(p), int(num_rows), width, rows, dtype, device).reshape((n,) + shape)


def keep_times(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * where(keep, scale, 0)`` with the multiplier in ``x``'s dtype: the products ``x * noise``
    makes, bit for bit, in one pass over ``x`` and the bool ``keep`` (same shape). Native on the
    CPU where :func:`gnncompile.kernels.native_edge_ops` holds for ``x``; elsewhere ``keep`` is cast,
    scaled and multiplied in place (``torch.where`` with scalar branches is ~4x slower on the CPU)."""
    if keep.shape != x.shape or keep.dtype != torch.bool:
        raise KernelError(f"keep_times: keep must be a bool tensor of x's shape {list(x.shape)}, got "
                          f"{keep.dtype} {list(keep.shape)}")
    if native_edge_ops(x):
        return _load_native().keep_times(x.contiguous(), keep.contiguous(), float(scale))
    value = torch.tensor(scale, dtype=torch.float64).to(x.dtype)  # a host scalar: no copy to the device
    return keep.to(x.dtype).mul_(value).mul_(x)
