"""Functional helpers shared by the models."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F

from .. import kernels

__all__ = ["feature_dropout", "linear", "Linear", "prepare_sparse_features"]


def feature_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """``F.dropout`` that also accepts sparse CSR input features.

    For a sparse ``x`` the stored values are dropped and rescaled: the zeros of ``x`` stay zero
    under dropout anyway, so this has exactly the distribution of dropout on the dense matrix
    without materializing it. Dense inputs go to ``F.dropout`` unchanged. An fx leaf (one T node).
    """
    if isinstance(x, torch.fx.Proxy):  # fx leaf: record one node whatever the import style
        return x.tracer.create_proxy("call_function", feature_dropout, (x,), {"p": p, "training": training})
    if x.layout != torch.sparse_csr:
        return F.dropout(x, p=p, training=training)
    if not training or p == 0.0:
        return x
    values = F.dropout(x.values(), p=p, training=True)
    return torch.sparse_csr_tensor(x.crow_indices(), x.col_indices(), values, size=x.shape, device=x.device,
                                   check_invariants=False)


# --------------------------------------------------------------------------- sparse-input linear
#: Transposition plans of sparse CSR structures: device, (crow, col) data pointers, shape and nnz ->
#: (crow, col, perm, crow_t, col_t). The entry holds the index tensors, so their memory (and the
#: pointers in the key) cannot be reused while cached. A few entries: one per feature matrix.
_TRANSPOSES: "OrderedDict[tuple, tuple[torch.Tensor, ...]]" = OrderedDict()
_MAX_TRANSPOSES = 4


def _csr_transpose(x: torch.Tensor) -> torch.Tensor:
    """``x.t()`` as a CSR tensor, with the permutation cached per sparsity structure.

    Feature dropout on sparse features keeps the structure (it rescales the stored values), so
    every step of training reuses the plan: transposing costs one gather of the values.
    """
    crow, col = x.crow_indices(), x.col_indices()
    key = (str(col.device), crow.data_ptr(), col.data_ptr(), tuple(x.shape), int(col.numel()))
    plan = _TRANSPOSES.get(key)
    if plan is None:
        n, f = x.shape
        dev = col.device
        rows = torch.repeat_interleave(torch.arange(n, dtype=col.dtype, device=dev), crow[1:] - crow[:-1],
                                       output_size=col.numel())
        perm = torch.argsort(col.long() * n + rows, stable=True)   # int64 keys (int32 indices overflow)
        crow_t = torch.zeros(f + 1, dtype=crow.dtype, device=dev)
        crow_t[1:] = torch.cumsum(torch.bincount(col, minlength=f), 0)
        plan = (crow, col, perm, crow_t, rows[perm])
        _TRANSPOSES[key] = plan
        if len(_TRANSPOSES) > _MAX_TRANSPOSES:
            _TRANSPOSES.popitem(last=False)
    else:
        _TRANSPOSES.move_to_end(key)
    _, _, perm, crow_t, col_t = plan
    return torch.sparse_csr_tensor(crow_t, col_t, x.values()[perm], size=(x.shape[1], x.shape[0]),
                                   device=x.device, check_invariants=False)


#: Native-kernel structures of sparse CSR matrices: (crow, col) data pointers, shape and nnz -> a
#: :class:`kernels.CSR` that holds the index tensors (so the pointers in the key stay theirs while
#: cached) and what the kernels derive from them (their index form, the transposed product's
#: thread parts): made once per feature matrix instead of every product. A few entries.
_NATIVE_CSRS: "OrderedDict[tuple, kernels.CSR]" = OrderedDict()
#: the structures :func:`prepare_sparse_features` built, by the same key, until their matrix is gone
#: (a rank's chunks are more matrices than the cache above keeps)
_PREPARED: dict[tuple, kernels.CSR] = {}


def _structure_key(x: torch.Tensor) -> tuple:
    crow, col = x.crow_indices(), x.col_indices()
    return crow.data_ptr(), col.data_ptr(), tuple(x.shape), int(col.numel())


def _native_csr(x: torch.Tensor) -> Optional[kernels.CSR]:
    """``x``'s structure for the native kernels (cached per structure), when ``x`` is on the CPU and
    they are the CPU's backend (else ``None``)."""
    if x.device.type != "cpu" or kernels.default_backend("cpu") != "native":
        return None
    key = _structure_key(x)
    csr = _PREPARED.get(key)
    if csr is not None:
        return csr
    csr = _NATIVE_CSRS.get(key)
    if csr is None:
        csr = _NATIVE_CSRS[key] = kernels.CSR(x.crow_indices().to(torch.int64), x.col_indices(), x.shape[0], x.shape[1])
        if len(_NATIVE_CSRS) > _MAX_TRANSPOSES:
            _NATIVE_CSRS.popitem(last=False)
    else:
        _NATIVE_CSRS.move_to_end(key)
    return csr


def prepare_sparse_features(x: Any) -> None:
    """Build the native kernels' form of a sparse CSR feature matrix ``x`` now (its int32 column
    indices, the transposed product's parts for this process's threads), as the runtime does before
    the first step: resident beside the features, like a graph's derived structures. Nothing for
    other inputs or off the CPU's native backend."""
    if isinstance(x, torch.Tensor) and x.layout == torch.sparse_csr and x.dim() == 2:
        csr = _native_csr(x)
        if csr is not None:
            kernels.prepare_native(csr, torch.get_num_threads())
            key = _structure_key(x)
            if key not in _PREPARED:  # kept while x lives, however many matrices a rank prepares
                _PREPARED[key] = csr
                weakref.finalize(x, _PREPARED.pop, key, None)


def _sparse_matmul(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """``x @ dense`` for a sparse CSR ``x``: the native product on the CPU (3x ``torch.sparse.mm``
    on coauthor_physics's features at width 64), else ``torch.sparse.mm``."""
    csr = _native_csr(x)
    if csr is not None:
        return kernels.spmm(csr, x.values(), dense.contiguous(), "native")
    return torch.sparse.mm(x, dense)


def _sparse_t_matmul(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``x^T @ grad`` for a sparse CSR ``x``: on the CPU with the native kernels, the transposed
    product scattered from ``x``'s own structure (nothing kept between steps; 3-5x faster than the
    cached transposition on coauthor_physics's features), else through :func:`_csr_transpose`."""
    csr = _native_csr(x)
    if csr is not None:
        return kernels.spmm(csr, x.values(), grad.contiguous(), "native", transpose=True)
    return torch.sparse.mm(_csr_transpose(x), grad)


class _SparseLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` for a sparse CSR ``x`` that needs no gradient.

    torch's own backward of ``F.linear`` on a CSR input converts ``x`` to its transpose on every
    step (about 8x the forward on coauthor_physics); this one computes ``x^T grad`` without a
    transposed copy (:func:`_sparse_t_matmul`).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.x = x
        ctx.has_bias = bias is not None
        out = _sparse_matmul(x, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, Optional[torch.Tensor], Optional[torch.Tensor]]:
        grad_w = _sparse_t_matmul(ctx.x, grad).t() if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return None, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` that also takes sparse CSR input features efficiently (:class:`_SparseLinear`:
    no transposed copy of ``x`` per step, as torch's backward of ``F.linear`` on a CSR input makes);
    dense inputs go to ``F.linear`` unchanged. An fx leaf (one T node, costed as a GEMM)."""
    if isinstance(x, torch.fx.Proxy):
        return x.tracer.create_proxy("call_function", linear, (x, weight, bias), {})
    if x.layout == torch.sparse_csr and x.dim() == 2 and not x.requires_grad:
        return _SparseLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


linear.__gnncompile_linear__ = True  # type: ignore[attr-defined]  (the tracer costs it as F.linear)


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` that also takes sparse CSR input features efficiently (see
    :class:`_SparseLinear`); dense inputs go to ``F.linear`` unchanged. Traced as a leaf, like
    ``torch.nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.fx.Proxy):  # traced by a plain fx tracer (gnncompile's keeps it a leaf)
            return F.linear(x, self.weight, self.bias)
        if x.layout == torch.sparse_csr and x.dim() == 2 and not x.requires_grad:
            return _SparseLinear.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
