"""Sparse kernels behind one interface: SpMM and SDDMM over a CSR structure.

Two products cover every P op and the backward of every P op:

- ``spmm(csr, values, x)``: ``out[r] = sum_{e in row r} values[e] * x[col[e]]`` (per head when
  ``values`` is ``[E, H]`` and ``x`` is ``[N, H, C]``).
- ``sddmm(csr, a, b)``: ``w[e] = <a[row(e)], b[col[e]]>`` (per head), the gradient of SpMM
  with respect to its edge values.

Backends
--------
``native``  C++/OpenMP kernel compiled on first use (``csrc/spmm.cpp``): edge-balanced row blocks
            scheduled dynamically, whole-row register accumulation (all heads of a row at once),
            int32 indices, cross-row prefetching, huge pages for large outputs. CPU,
            float32/float64; deterministic whatever the thread count.
``torch``   ``torch.sparse.mm`` on a CSR tensor (MKL on CPU, cuSPARSE on CUDA).
``scipy``   ``scipy.sparse.csr_matrix @ ndarray`` (single-threaded; CPU).
``cupy``    ``cupyx.scipy.sparse`` (cuSPARSE) on CUDA tensors, zero copy through DLPack.

The default backend is chosen by the tensor's device (``native`` on CPU when the extension builds,
otherwise ``torch`` with a warning; ``cupy`` on CUDA when CuPy is installed, otherwise ``torch``)
and can be overridden per call, with :func:`set_default_backend`, or with the environment variable
``GNNCOMPILE_BACKEND``. Nothing here materializes a dense adjacency: the backward product uses the
transposed CSR that :class:`~gnncompile.graph.Graph` caches.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ...errors import KernelError

__all__ = [
    "CSR",
    "BACKENDS",
    "available_backends",
    "default_backend",
    "set_default_backend",
    "spmm",
    "sddmm",
]


@dataclass(eq=False)
class CSR:
    """A CSR structure (rows = destinations) plus per-backend derived data cached on it.

    ``indptr``: int64 ``[rows + 1]``; ``indices``: int64 ``[E]`` column (source) ids.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    num_rows: int
    num_cols: int
    cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())

    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        try:
            return self.cache[key]
        except KeyError:
            v = self.cache[key] = build()
            return v


# --------------------------------------------------------------------------- helpers
def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as ``[rows, prod(trailing dims)]`` (well defined for zero rows too)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _split_heads(values: Optional[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """Return ``(x2d, heads, out_shape_tail)`` with ``x2d`` contiguous ``[N, H*C]``."""
    if values is not None and values.dim() == 2 and values.shape[1] > 1:
        heads = values.shape[1]
        if x.dim() != 3 or x.shape[1] != heads:
            raise KernelError(
                f"spmm: edge values have {heads} heads, so x must be [N, {heads}, C]; got {list(x.shape)}"
            )
    else:
        heads = 1
    tail = tuple(x.shape[1:])
    return _as_rows(x).contiguous(), heads, tail


def _check(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor) -> None:
    if x.shape[0] != csr.num_cols:
        raise KernelError(f"spmm: x has {x.shape[0]} rows but the sparse matrix has {csr.num_cols} columns")
    if values is not None:
        if values.shape[0] != csr.nnz:
            raise KernelError(f"spmm: {values.shape[0]} edge values for {csr.nnz} edges")
        if values.dtype != x.dtype:
            raise KernelError(f"spmm: values dtype {values.dtype} differs from x dtype {x.dtype}")


# --------------------------------------------------------------------------- native backend
_native_module: Any = None
_native_error: Optional[str] = None


def _load_native() -> Any:
    """Compile (once per machine; cached by torch) and import the C++ kernels."""
    global _native_module, _native_error
    if _native_module is not None:
        return _native_module
    if _native_error is not None:
        raise KernelError(f"native backend unavailable: {_native_error}")
    try:
        from torch.utils.cpp_extension import load

        src = os.path.join(os.path.dirname(__file__), "csrc", "spmm.cpp")
        # -fopenmp: without it ATen's parallel_for (inlined from its headers) and the kernels' simd
        # pragmas compile to serial code. The extension then links against the libgomp that torch
        # has already loaded (same soname), so torch.set_num_threads governs both.
        flags = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
        _native_module = load("gnncompile_native_v2", [src], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                              verbose=False)
    except Exception as exc:  # compiler missing, ninja missing, ...
        _native_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise KernelError(f"native backend unavailable: {_native_error}") from exc
    return _native_module


def _native_index(csr: CSR) -> torch.Tensor:
    def build() -> torch.Tensor:
        if csr.num_cols < 2**31 - 1:
            return csr.indices.to(torch.int32).contiguous()
        return csr.indices.contiguous()
    return csr.cached("native:indices", build)


def _spmm_native(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    mod = _load_native()
    x2, heads, tail = _split_heads(values, x)
    vals = None if values is None else values.contiguous()
    out = mod.spmm(csr.indptr, _native_index(csr), vals, x2, heads, 0)
    return out.reshape((csr.num_rows,) + tail)


def _sddmm_native(csr: CSR, a: torch.Tensor, b: torch.Tensor, heads: int) -> torch.Tensor:
    mod = _load_native()
    a2 = _as_rows(a).contiguous()
    b2 = _as_rows(b).contiguous()
    return mod.sddmm(csr.indptr, _native_index(csr), a2, b2, heads)


# --------------------------------------------------------------------------- torch backend
def _torch_csr(csr: CSR, values: Optional[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if values is None:
        values = csr.cached(f"torch:ones:{dtype}:{device}", lambda: torch.ones(csr.nnz, dtype=dtype, device=device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(
            csr.indptr.to(device), csr.indices.to(device), values, size=(csr.num_rows, csr.num_cols),
            check_invariants=False,
        )


def _spmm_torch(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    x2, heads, tail = _split_heads(values, x)
    if heads == 1:
        v = None if values is None else values.reshape(-1)
        out = torch.sparse.mm(_torch_csr(csr, v, x.dtype, x.device), x2)
    else:
        c = x2.shape[1] // heads
        outs = [
            torch.sparse.mm(_torch_csr(csr, values[:, h].contiguous(), x.dtype, x.device),
                            x2[:, h * c:(h + 1) * c].contiguous())
            for h in range(heads)
        ]
        out = torch.stack(outs, dim=1)
    return out.reshape((csr.num_rows,) + tail)


def _sddmm_gather(csr: CSR, a: torch.Tensor, b: torch.Tensor, heads: int) -> torch.Tensor:
    """Reference SDDMM by gathering both endpoints, in edge blocks to bound memory."""
    width = math.prod(a.shape[1:]) // heads
    a3 = a.reshape(a.shape[0], heads, width)
    b3 = b.reshape(b.shape[0], heads, width)
    rows = csr.cached("rows", lambda: torch.repeat_interleave(
        torch.arange(csr.num_rows, device=csr.indptr.device), csr.indptr[1:] - csr.indptr[:-1]))
    out = torch.empty(csr.nnz, heads, dtype=a.dtype, device=a.device)
    block = max(1, (1 << 24) // max(1, a3.shape[1] * a3.shape[2]))
    for s in range(0, csr.nnz, block):
        e = slice(s, min(csr.nnz, s + block))
        out[e] = (a3[rows[e]] * b3[csr.indices[e]]).sum(-1)
    return out


# --------------------------------------------------------------------------- scipy backend
def _spmm_scipy(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    import numpy as np
    import scipy.sparse as sp

    if x.device.type != "cpu":
        raise KernelError("scipy backend: tensors must be on the CPU")
    x2, heads, tail = _split_heads(values, x)
    ip = csr.cached("scipy:indptr", lambda: csr.indptr.numpy())
    ix = csr.cached("scipy:indices", lambda: csr.indices.numpy())
    xn = x2.detach().numpy()

    def mat(v: Optional[torch.Tensor]):
        data = np.ones(csr.nnz, dtype=xn.dtype) if v is None else v.detach().contiguous().numpy()
        return sp.csr_matrix((data, ix, ip), shape=(csr.num_rows, csr.num_cols))

    if heads == 1:
        out = mat(None if values is None else values.reshape(-1)) @ xn
    else:
        c = xn.shape[1] // heads
        out = np.concatenate([mat(values[:, h]) @ xn[:, h * c:(h + 1) * c] for h in range(heads)], axis=1)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=xn.dtype)).reshape((csr.num_rows,) + tail)


# --------------------------------------------------------------------------- cupy backend
def _spmm_cupy(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    try:
        import cupy as cp
        import cupyx.scipy.sparse as csp
    except ImportError as exc:
        raise KernelError("cupy backend: CuPy is not installed (pip install 'gnncompile[gpu]')") from exc
    if x.device.type != "cuda":
        raise KernelError("cupy backend: tensors must be on a CUDA device")
    x2, heads, tail = _split_heads(values, x)
    dev = x.device

    def structure():
        ip = csr.indptr.to(dev, torch.int32)
        ix = csr.indices.to(dev, torch.int32)
        return ip, ix, cp.from_dlpack(ip), cp.from_dlpack(ix)

    _, _, ip, ix = csr.cached(f"cupy:{dev}", structure)
    xc = cp.from_dlpack(x2)

    def product(v: Optional[torch.Tensor], xs) -> Any:
        data = cp.ones(csr.nnz, dtype=xs.dtype) if v is None else cp.from_dlpack(v.contiguous())
        return csp.csr_matrix((data, ix, ip), shape=(csr.num_rows, csr.num_cols)) @ xs

    if heads == 1:
        out = product(None if values is None else values.reshape(-1), xc)
    else:
        c = x2.shape[1] // heads
        out = cp.concatenate(
            [product(values[:, h], cp.ascontiguousarray(xc[:, h * c:(h + 1) * c])) for h in range(heads)], axis=1
        )
    return torch.from_dlpack(cp.ascontiguousarray(out)).reshape((csr.num_rows,) + tail)


# --------------------------------------------------------------------------- dispatch
BACKENDS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "native": (_spmm_native, _sddmm_native),
    "torch": (_spmm_torch, _sddmm_gather),
    "scipy": (_spmm_scipy, _sddmm_gather),
    "cupy": (_spmm_cupy, _sddmm_gather),
}
_default_override: Optional[str] = os.environ.get("GNNCOMPILE_BACKEND") or None
_warned_fallback = False


def _validate_name(name: str) -> str:
    if name not in BACKENDS:
        raise KernelError(f"unknown kernel backend {name!r}; valid: {', '.join(BACKENDS)}")
    return name


def set_default_backend(name: Optional[str]) -> None:
    """Force a backend for every call that does not name one (``None`` restores the automatic choice)."""
    global _default_override
    _default_override = None if name is None else _validate_name(name)


def available_backends(device: str | torch.device = "cpu") -> list[str]:
    """The backends that can run on ``device`` in this environment."""
    dev = torch.device(device)
    if dev.type == "cuda":
        names = ["torch"]
        try:
            import cupy  # noqa: F401

            names.insert(0, "cupy")
        except ImportError:
            pass
        return names
    names = ["torch", "scipy"]
    try:
        _load_native()
        names.insert(0, "native")
    except KernelError:
        pass
    return names


def default_backend(device: str | torch.device = "cpu") -> str:
    """The backend used for tensors on ``device`` when a call names none."""
    global _warned_fallback
    if _default_override is not None:
        return _validate_name(_default_override)
    dev = torch.device(device)
    if dev.type == "cuda":
        return available_backends(dev)[0]
    try:
        _load_native()
        return "native"
    except KernelError as exc:
        if not _warned_fallback:
            warnings.warn(f"{exc}; using the 'torch' backend (slower SpMM)", RuntimeWarning, stacklevel=3)
            _warned_fallback = True
        return "torch"


def spmm(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    """``out[r] = sum_{e in row r} values[e] * x[col[e]]``; ``values=None`` means all ones.

    ``x`` is ``[num_cols, ...]``; with ``values`` of shape ``[E, H]`` (H > 1) ``x`` must be
    ``[num_cols, H, C]`` and head ``h`` is weighted by ``values[:, h]``. Returns
    ``[num_rows, ...]``. Not differentiable by itself: :mod:`gnncompile.ops` wraps it.
    """
    _check(csr, values, x)
    name = _validate_name(backend) if backend else default_backend(x.device)
    return BACKENDS[name][0](csr, values, x)


def sddmm(csr: CSR, a: torch.Tensor, b: torch.Tensor, heads: int = 1, backend: Optional[str] = None) -> torch.Tensor:
    """``w[e, h] = <a[row(e), h], b[col(e), h]>``: returns ``[E, heads]``.

    ``a`` is ``[num_rows, ...]`` and ``b`` ``[num_cols, ...]`` with equal trailing size, divisible
    by ``heads``.
    """
    if a.shape[0] != csr.num_rows or b.shape[0] != csr.num_cols:
        raise KernelError(
            f"sddmm: a has {a.shape[0]} rows (need {csr.num_rows}), b has {b.shape[0]} (need {csr.num_cols})"
        )
    width_a, width_b = math.prod(a.shape[1:]), math.prod(b.shape[1:])
    if heads < 1 or width_a != width_b or width_a % heads:
        raise KernelError(
            f"sddmm: a and b need equal feature sizes divisible by heads={heads}; "
            f"got {list(a.shape)} and {list(b.shape)}"
        )
    if a.dtype != b.dtype:
        raise KernelError(f"sddmm: a dtype {a.dtype} differs from b dtype {b.dtype}")
    name = _validate_name(backend) if backend else default_backend(a.device)
    return BACKENDS[name][1](csr, a, b, heads)
