"""Vertex reordering: renumber a graph's vertices to shrink its bandwidth (MixGCN §3.2.2).

The *bandwidth* ``b`` of a graph is ``max |src - dst|`` over its edges: with the vertices cut into
consecutive chunks, a destination chunk reads source rows at most ``b`` ids away, so a small ``b``
means each chunk reads few other chunks and a fine-grain pipeline between the sparse (aggregation)
and dense (update) device groups can start early. MixGCN Proposition 3.5: the pipeline has no idle
time when ``(n - b) / 2n >= 1/s`` with ``s`` pipeline batches; ``(n - b) / 2n`` is the *minimum
granularity*. Reverse Cuthill–McKee (``scipy.sparse.csgraph.reverse_cuthill_mckee``) is the
classical bandwidth-reducing ordering.

Orders are *new-to-old*: ``order[i]`` is the old id of new vertex ``i`` (numpy/scipy convention,
so ``A[order][:, order]`` is the reordered adjacency).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ..errors import ArgumentError, GraphError
from .core import Graph

METHODS = ("none", "rcm")


def bandwidth(graph: Graph) -> int:
    """``max |src - dst|`` over the edges of ``graph`` (0 for an edgeless graph)."""
    if graph.num_edges == 0:
        return 0
    return int((graph.src - graph.dst).abs().max())


def rcm_order(graph: Graph) -> torch.Tensor:
    """Reverse Cuthill–McKee order of ``graph`` (new-to-old int64 permutation).

    Computed on the symmetrized sparsity pattern, so directed graphs are ordered by their
    underlying undirected structure (edge direction does not matter for ``|src - dst|``)."""
    import scipy.sparse as sp
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    a = graph.to_scipy(weighted=False)
    pattern = (a + a.T).tocsr()
    pattern.data[:] = 1
    pattern = sp.csr_matrix(pattern, dtype=np.int8)
    order = reverse_cuthill_mckee(pattern, symmetric_mode=True)
    return torch.from_numpy(np.asarray(order, dtype=np.int64))


def _check_order(order: torch.Tensor, n: int) -> torch.Tensor:
    order = torch.as_tensor(order)
    if order.dtype not in (torch.int32, torch.int64) or order.dim() != 1:
        raise GraphError(f"permute: order must be a 1-D integer tensor, got {order.dtype} of shape "
                         f"{tuple(order.shape)}")
    order = order.to(torch.int64).cpu()
    if order.numel() != n:
        raise GraphError(f"permute: order has {order.numel()} entries for a graph of {n} vertices")
    if n and (int(order.min()) < 0 or int(order.max()) >= n):
        bad = int(torch.nonzero((order < 0) | (order >= n))[0, 0])
        raise GraphError(f"permute: order[{bad}] = {int(order[bad])} is not a vertex id in [0, {n})")
    seen = torch.zeros(n, dtype=torch.bool)
    seen[order] = True
    if not bool(seen.all()):
        missing = int(torch.nonzero(~seen)[0, 0])
        raise GraphError(f"permute: order is not a permutation (vertex {missing} is missing, so another repeats)")
    return order


def permute(graph: Graph, order: torch.Tensor) -> Graph:
    """``graph`` with its vertices renumbered: new vertex ``i`` is old vertex ``order[i]``.

    Edges, edge weights, features (dense or sparse CSR), labels and masks move with their
    vertices; each destination keeps its in-edges in their original order, so aggregations sum
    in the same order as on ``graph``. Raises :class:`GraphError` if ``order`` is not a
    permutation of ``range(num_nodes)``."""
    n = graph.num_nodes
    order = _check_order(order, n)
    new_of_old = torch.empty(n, dtype=torch.int64)
    new_of_old[order] = torch.arange(n)
    indptr = graph.indptr.cpu()
    deg = (indptr[1:] - indptr[:-1])[order]
    new_indptr = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(deg, 0, out=new_indptr[1:])
    E = graph.num_edges
    # edge ids of the new CSR: destination i's segment is old destination order[i]'s segment
    shift = torch.repeat_interleave(indptr[:-1][order] - new_indptr[:-1], deg, output_size=E)
    edge_ids = torch.arange(E, dtype=torch.int64) + shift
    indices = new_of_old[graph.indices.cpu()[edge_ids]]
    weight = None if graph.edge_weight is None else graph.edge_weight.cpu()[edge_ids]

    def rows(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.cpu()[order]

    x = graph.x
    if x is not None:
        if x.layout == torch.sparse_csr:
            import scipy.sparse as sp

            xc = x.cpu()
            m = sp.csr_matrix((xc.values().numpy(), xc.col_indices().numpy(), xc.crow_indices().numpy()),
                              shape=tuple(xc.shape))[order.numpy()]
            x = torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype(np.int64)),
                                        torch.from_numpy(m.indices.astype(np.int64)),
                                        torch.from_numpy(m.data), size=tuple(xc.shape),
                                        check_invariants=False)  # built by scipy
        else:
            x = x.cpu()[order]
    return Graph(new_indptr, indices, n, edge_weight=weight, x=x, y=rows(graph.y),
                 train_mask=rows(graph.train_mask), val_mask=rows(graph.val_mask),
                 test_mask=rows(graph.test_mask), num_classes=graph._num_classes,
                 name=graph.name, validate=False)


def reorder(graph: Graph, method: str = "rcm") -> tuple[Graph, torch.Tensor]:
    """``(reordered graph, new-to-old order)`` for ``method`` in :data:`METHODS`."""
    if method not in METHODS:
        raise GraphError(f"reorder: unknown method {method!r}; valid: {', '.join(METHODS)}")
    if method == "none":
        return graph, torch.arange(graph.num_nodes)
    order = rcm_order(graph)
    return permute(graph, order), order


def min_granularity(n: int, b: int) -> float:
    """MixGCN's minimum pipeline granularity ``(n - b) / 2n`` (Proposition 3.5)."""
    if n <= 0:
        raise ArgumentError(f"min_granularity: n must be positive, got {n}")
    if not 0 <= b <= n:
        raise ArgumentError(f"min_granularity: bandwidth {b} must lie in [0, {n}]")
    return (n - b) / (2 * n)


def pipeline_batches(n: int, b: int) -> Optional[int]:
    """Fewest pipeline batches ``s`` with ``(n - b) / 2n >= 1/s`` (idle-free pipeline), or
    ``None`` when no ``s`` works (granularity 0, ``b == n``)."""
    g = min_granularity(n, b)
    if g <= 0:
        return None
    return math.ceil(2 * n / (n - b) - 1e-12)
