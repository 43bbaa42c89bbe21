"""Masked SpMM (MixGCN's S-SpMM, Eq. 4: ``Z = (A H) ⊙ M``) on top of :func:`kernels.spmm`.

Two products skip work that a mask makes useless:

- :func:`masked_spmm` (forward): ``out[r] = sum_{e in row r} values[e] * x[col[e]]`` only for
  the kept rows ``r``; every other row of the result is zero. The kept rows' CSR slices are
  gathered into a row-subset CSR (dropped rows empty; no cache: the row set changes every call)
  and the product runs on it with the ordinary kernel, so its cost is proportional to the edges of
  the kept rows.
- :func:`masked_spmm_t` (backward): ``out = A^T g`` where only the kept rows of ``g`` are
  nonzero. The transposed CSR (rows = sources) keeps only the entries whose column (the
  destination) is kept; the product then reads only those rows of ``g``.

Both fall back to the full product when the subset would not pay. Building a subset is index work
(gathering the kept rows' entries forward; testing every entry's column backward) that costs
about as much as a product ``k`` features wide, so a product ``d`` features wide uses its subset
only when the kept fraction is below ``1 - k / d``: ``k =`` :data:`FORWARD_INDEX_COST` (48) and
:data:`BACKWARD_INDEX_COST` (64). At ``d = 64`` the forward subset pays below 25% of rows kept
and the backward one never; at ``d = 256``, below 81% and 75%. The constants are rough, from
``benchmarks/masked_spmm.py`` on a 2-core machine. The kept rows' results are bit-identical to
the full product's on the ``native`` backend (same edges in the same order per row).

The mask granularity is the row: an element-wise mask (dropout on ``[N, d]``) rarely empties a
whole row, so it saves nothing here; row masks (dropped vertices, rows whose gradient ReLU zeroed
entirely, rows outside the loss) do.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import CSR, spmm

__all__ = ["FORWARD_INDEX_COST", "BACKWARD_INDEX_COST", "row_subset", "column_subset", "masked_spmm",
           "masked_spmm_t"]

# Gathering the kept rows' entries costs about a product this many features wide.
FORWARD_INDEX_COST = 48
# Filtering every entry of the transposed CSR by its column costs about a product this many features wide.
BACKWARD_INDEX_COST = 64


def _use_subset(kept: int, n: int, width: int, index_cost: float) -> bool:
    return 0 < n and kept < n and kept < (1.0 - index_cost / max(width, 1)) * n


def row_subset(csr: CSR, values: Optional[torch.Tensor], keep_rows: torch.Tensor) -> tuple[CSR, Optional[torch.Tensor]]:
    """``csr`` with the rows where ``keep_rows`` (bool ``[rows]``) is false emptied, and its edge values.

    Same shape as ``csr``; only the kept rows' entries are gathered (``O(kept entries + rows)``),
    so a product with it writes zero rows for the dropped ones.
    """
    indptr = csr.indptr
    starts = indptr[:-1]
    counts = (indptr[1:] - starts) * keep_rows
    new_indptr = torch.zeros_like(indptr)
    torch.cumsum(counts, 0, out=new_indptr[1:])
    total = int(new_indptr[-1])
    # position of every kept entry in the original arrays: start of its row + offset in the row
    pos = torch.repeat_interleave(starts - new_indptr[:-1], counts, output_size=total)
    pos += torch.arange(total, dtype=pos.dtype, device=pos.device)
    sub = CSR(new_indptr, csr.indices.index_select(0, pos), csr.num_rows, csr.num_cols)
    return sub, None if values is None else values.index_select(0, pos)


def column_subset(csr: CSR, values: Optional[torch.Tensor], keep_cols: torch.Tensor
                  ) -> tuple[CSR, Optional[torch.Tensor]]:
    """``csr`` with only the entries whose column ``c`` has ``keep_cols[c]`` true (rows unchanged)."""
    keep = keep_cols.index_select(0, csr.indices)
    kept_before = torch.zeros(csr.nnz + 1, dtype=csr.indptr.dtype, device=csr.indptr.device)
    torch.cumsum(keep, 0, out=kept_before[1:])
    new_indptr = kept_before.index_select(0, csr.indptr)
    pos = keep.nonzero().squeeze(1)
    sub = CSR(new_indptr, csr.indices.index_select(0, pos), csr.num_rows, csr.num_cols)
    return sub, None if values is None else values.index_select(0, pos)


def masked_spmm(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor, keep_rows: torch.Tensor,
                backend: Optional[str] = None, index_cost: Optional[float] = None, *,
                row_scale: Optional[torch.Tensor] = None, col_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``spmm(csr, values, x, row_scale=, col_scale=)`` computed only for the rows where
    ``keep_rows`` (bool ``[rows]``) is true.

    The other rows of the result are zero (not the product). The row subset is built when the
    kept fraction is below ``1 - index_cost / width`` (default :data:`FORWARD_INDEX_COST`;
    ``index_cost=0`` builds it whenever a row is dropped).
    """
    scales = dict(row_scale=row_scale, col_scale=col_scale)
    n = csr.num_rows
    kept = int(keep_rows.sum())
    cost = FORWARD_INDEX_COST if index_cost is None else index_cost
    if not _use_subset(kept, n, math.prod(x.shape[1:]), cost):
        out = spmm(csr, values, x, backend, **scales)
        if kept == n:
            return out
        shape = (n,) + (1,) * (out.dim() - 1)
        return out.masked_fill_(~keep_rows.reshape(shape), 0)
    sub, sub_values = row_subset(csr, values, keep_rows)
    return spmm(sub, sub_values, x, backend, **scales)


def masked_spmm_t(csr_t: CSR, values_t: Optional[torch.Tensor], g: torch.Tensor, keep_rows: torch.Tensor,
                  backend: Optional[str] = None, index_cost: Optional[float] = None, *,
                  row_scale: Optional[torch.Tensor] = None, col_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``spmm(csr_t, values_t, g, row_scale=, col_scale=)`` when only the rows ``keep_rows`` of
    ``g`` are nonzero.

    ``csr_t`` is the transposed structure (its columns index the rows of ``g``). Exact whenever the
    rows of ``g`` outside ``keep_rows`` are zero; entries reading them are dropped. The subset is
    built only when the kept fraction is below ``1 - index_cost / width`` (default
    :data:`BACKWARD_INDEX_COST`; ``index_cost=0`` builds it whenever a row is dropped).
    """
    cost = BACKWARD_INDEX_COST if index_cost is None else index_cost
    scales = dict(row_scale=row_scale, col_scale=col_scale)
    if not _use_subset(int(keep_rows.sum()), csr_t.num_cols, math.prod(g.shape[1:]), cost):
        return spmm(csr_t, values_t, g, backend, **scales)
    sub, sub_values = column_subset(csr_t, values_t, keep_rows)
    return spmm(sub, sub_values, g, backend, **scales)
