"""`Graph`: the in-edge CSR container every part of gnncompile reads.

Layout
------
Edges are stored grouped by **destination** (in-edge CSR, i.e. the CSR of the matrix ``A`` with
``A[dst, src] = w``): the in-edges of vertex ``v`` are positions ``indptr[v]:indptr[v+1]`` and their
sources are ``indices[indptr[v]:indptr[v+1]]``. Within a row sources are sorted ascending; duplicate
edges are allowed (they count twice in sums, as in PyG). The edge id of an edge is its position in
this order, so edge-wise tensors (``[E, ...]``) are aligned with ``indices``.

A `Graph` is treated as immutable: every transformation returns a new graph. Derived structures
(destination of each edge, degrees, the transposed CSR used by backward passes, normalization
scales) are computed once on first use and cached on the instance.

Compact storage
---------------
``indptr`` is int64. ``indices`` is int64 by default and int32 in a compact graph
(:meth:`Graph.compact`, and every :class:`~gnncompile.graph.shard.LocalGraph`) whenever the source
ids fit, which is what training holds: 4 bytes per edge. Normalizations are per-vertex scales
(:class:`NormScales`: ``c_e = row[v] * w_e * col[u]``) that the kernels apply inside the product, so
no per-edge float array exists unless the graph is weighted. The transposed structure that a
backward product reads is the structure itself for a symmetric graph, and its edge permutation is
built only where edge values need it (weighted graphs, attention). :func:`topology_bytes` is this
layout's size, which the cost models charge; :meth:`Graph.structure_bytes` measures it.
"""

from __future__ import annotations

import hashlib
import math
import operator
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..errors import ArgumentError, GraphError, RuntimeFailure

__all__ = ["Graph", "GraphStats", "NormScales", "topology_bytes", "tensor_hash"]

_INT32_MAX = 2**31 - 1

ArrayLike = Any  # numpy array, torch tensor or nested sequence


def _as_tensor(value: ArrayLike, field: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Convert ``value`` to a torch tensor without copying where possible."""
    if isinstance(value, torch.Tensor):
        t = value
    elif isinstance(value, np.ndarray):
        if value.dtype == np.object_:
            raise GraphError(f"{field}: object arrays are not supported (got dtype=object)")
        try:
            t = torch.from_numpy(np.ascontiguousarray(value))
        except TypeError:  # strings, datetimes, longdouble, ...: dtypes torch has no counterpart of
            raise GraphError(f"{field}: numpy dtype {value.dtype} is not supported; pass numbers (an integer, "
                             f"floating or bool dtype)") from None
    else:
        try:
            arr = np.asarray(value)
            t = torch.as_tensor(arr)
        except (TypeError, ValueError) as exc:
            raise GraphError(f"{field}: cannot convert {type(value).__name__} to a tensor: {exc}") from exc
        # numpy makes a list holding an int past int64 floats: name that int (looked for only when
        # some value is that large: a scan of the list's Python objects costs 4x the conversion)
        if arr.dtype.kind == "f" and arr.size and bool((np.abs(arr) >= 2.0**63).any()):
            big = next((v for v in np.asarray(value, dtype=object).flat
                        if isinstance(v, int) and not -(2**63) <= v < 2**63), None)
            if big is not None:
                raise GraphError(f"{field}: {big} does not fit in int64")
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t


def _check_index_dtype(t: torch.Tensor, field: str, keep_int32: bool = False) -> torch.Tensor:
    """``t`` as int64 (``keep_int32``: int32 stays int32); raises for non-integer dtypes."""
    if t.numel() == 0:  # numpy makes empty lists float64
        return t.to(torch.int32 if keep_int32 and t.dtype == torch.int32 else torch.int64)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise GraphError(f"{field}: expected an integer dtype, got {t.dtype}")
    if t.dtype == torch.uint64:  # values from 2**63 up would wrap to negative ids in int64
        wide = t.view(torch.int64) < 0
        if bool(wide.any()):
            pos = tuple(int(i) for i in torch.nonzero(wide, as_tuple=False)[0])
            value = int(t.view(torch.int64)[pos]) + 2**64
            raise GraphError(f"{field}: value {value} at {pos[0] if len(pos) == 1 else pos} does not fit in int64")
    return t if keep_int32 and t.dtype == torch.int32 else t.to(torch.int64)


def _as_count(value: Any, field: str) -> int:
    """``value`` as a Python int: ints, numpy integers and one-element integer tensors; anything
    else (floats, even integral ones, strings, bools) raises :class:`GraphError` naming ``field``."""
    if isinstance(value, (bool, np.bool_)):
        raise GraphError(f"{field}: expected an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise GraphError(f"{field}: expected an int, got {type(value).__name__} {value!r}") from None


#: The most vertices :meth:`Graph.from_edge_index` and :meth:`Graph.to_undirected` index: they sort
#: edges by the int64 key ``dst * num_nodes + src``, which must not overflow.
MAX_NODES = math.isqrt(2**63 - 1)


def _memory_bytes(device: torch.device) -> Optional[int]:
    """Total memory of ``device`` (physical RAM for the CPU), or ``None`` when it cannot be read."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError, RuntimeError, AssertionError):
        pass
    return None


def _check_node_count(n: int, device: torch.device, what: str) -> None:
    """Refuse a vertex count the in-edge CSR cannot hold, before allocating anything for it.

    Two limits, both independent of the number of edges: the sort key ``dst * n + src`` must fit in
    int64 (:data:`MAX_NODES`), and the per-vertex arrays building the CSR takes (int64 offsets and
    in-degree counts, 16 bytes per vertex) must fit in the device's total memory. ``what`` starts
    the message (the field and where ``n`` came from, with its separator).
    """
    hint = "renumber the vertex ids to 0..N-1 (e.g. np.unique(edge_index, return_inverse=True))"
    if n > MAX_NODES:
        raise GraphError(f"{what}{n:,} vertices are more than gnncompile can index (at most {MAX_NODES:,}: "
                         f"edges are sorted by the int64 key dst * num_nodes + src); {hint}")
    need, have = 16 * (n + 1), _memory_bytes(device)
    if have is not None and need > have:
        raise GraphError(f"{what}{n:,} vertices need {_size(need)} for the CSR offsets alone (16 bytes per "
                         f"vertex) but the {device.type} memory is {_size(have)}; {hint}")


def _size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1 (``"1.5 MiB"``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} B"


def _compact_index(t: torch.Tensor, bound: int) -> torch.Tensor:
    """``t`` as int32 when every value is below ``bound`` and ``bound`` fits in int32, else as is."""
    return t.to(torch.int32) if bound <= _INT32_MAX else t


#: tensors larger than this are hashed by a strided sample of their elements (:func:`tensor_hash`)
HASHED_WHOLE_BYTES = 64 * 2**20


def tensor_hash(*tensors: Optional[torch.Tensor], sample: bool = False) -> str:
    """A short SHA-256 of the tensors (a graph's ``indptr`` and ``indices``, its features, labels
    and masks, for fingerprints): shape, dtype and bytes; with ``sample``, a tensor over
    :data:`HASHED_WHOLE_BYTES` by an evenly strided sample of about that many bytes of its elements
    (a change confined to elements off the sample goes unseen). A sparse CSR tensor by its
    structure and values. Integer tensors are hashed as int64, so a compact (int32) and a wide
    copy of one structure agree."""
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        if t.layout == torch.sparse_csr:
            h.update(tensor_hash(t.crow_indices(), t.col_indices(), t.values(), sample=sample).encode())
            continue
        t = t.detach()
        h.update(str((torch.int64 if t.dtype == torch.int32 else t.dtype, tuple(t.shape))).encode())
        flat = t.reshape(-1)
        if sample and flat.numel() * 8 > HASHED_WHOLE_BYTES:
            flat = flat[::-(-flat.numel() * 8 // HASHED_WHOLE_BYTES)]
        flat = flat.cpu().contiguous()
        if flat.dtype == torch.int32:
            flat = flat.to(torch.int64)
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class NormScales:
    """A normalized propagation's coefficients as per-vertex factors (float64 as computed; the
    runtime keeps them in the model's dtype, :meth:`Graph.cast_scales`).

    Edge ``e = u -> v`` has coefficient ``row[v] * w_e * col[u]`` (``w_e`` the graph's stored edge
    weight, 1 when unweighted; a ``None`` factor is 1) and the self loop of ``v`` (propagations over
    ``A + I`` only) has ``loop[v]``. ``row`` and ``loop`` have one entry per destination, ``col`` one
    per source. Every normalization gnncompile offers factors this way, so the kernels take the
    factors (:func:`gnncompile.kernels.spmm`'s ``row_scale`` / ``col_scale``) instead of an ``[E]``
    array.
    """

    row: Optional[torch.Tensor] = None
    col: Optional[torch.Tensor] = None
    loop: Optional[torch.Tensor] = None

    def select(self, rows: torch.Tensor, sources: torch.Tensor) -> "NormScales":
        """The factors of a subgraph whose destinations are ``rows`` and sources ``sources`` (ids
        in this graph's destination / source numbering)."""
        def take(t: Optional[torch.Tensor], ids: torch.Tensor) -> Optional[torch.Tensor]:
            return None if t is None else t.index_select(0, ids.to(t.device))
        return NormScales(take(self.row, rows), take(self.col, sources), take(self.loop, rows))

    def to(self, device_or_dtype: torch.device | str | torch.dtype) -> "NormScales":
        """The factors on another device or in another dtype (``Tensor.to``; unchanged ones shared)."""
        def mv(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device_or_dtype)
        return NormScales(mv(self.row), mv(self.col), mv(self.loop))

    def has_dtype_other_than(self, dtype: torch.dtype) -> bool:
        return any(t is not None and t.dtype != dtype for t in (self.row, self.col, self.loop))

    def edge_values(self, graph: "Graph") -> Optional[torch.Tensor]:
        """float64 ``[E]``: the per-edge coefficients ``row[dst] * w * col[src]`` on ``graph``
        (``None`` when there are no factors and no weights)."""
        w = None if graph.edge_weight is None else graph.edge_weight.to(torch.float64)
        if self.row is None and self.col is None:
            return w
        c = torch.ones(graph.num_edges, dtype=torch.float64, device=graph.device)
        if self.row is not None:
            c = c * self.row.index_select(0, graph.dst)
        if self.col is not None:
            c = c * self.col.index_select(0, graph.indices)
        return c if w is None else c * w


def topology_bytes(nodes: int, edges: int, sources: Optional[int] = None, *, symmetric: bool = False,
                   weighted: bool = False, edge_values: bool = False, edge_loops: bool = False,
                   push: bool = False, edge_dst: Optional[bool] = None) -> int:
    """Bytes of a training graph's topology in gnncompile's compact layout (see the module docstring).

    ``nodes`` destinations, ``sources`` sources (default ``nodes``), ``edges`` edges. Held: the
    in-edge CSR (int64 offsets, 4 bytes per index when the sources fit in int32, else 8), its
    transpose for backward products (offsets and indices; none when ``symmetric``: the structure
    serves both), float32 edge weights when ``weighted``, the edge permutation between the two
    orders when edge values exist (``weighted``, or ``edge_values``: the model computes them, as
    attention does) and, with ``edge_dst`` (default: ``edge_values``), each edge's destination (what
    ``gather_dst`` and the torch formulations of the edge reductions index by). ``edge_loops``: an
    aggregation over ``A + I`` (``aggregate(..., add_self_loops=True)``) also holds the loop-augmented structure (offsets,
    indices, destinations, and the two permutations between the edge layout and its CSR order, one
    index per edge and loop each). Normalization scales are per vertex and not included. ``push``:
    backward products scatter from the in-edge CSR (``ops.set_backward_product``), so neither the
    transpose nor the edge permutation is held.
    """
    src = nodes if sources is None else sources
    if edges == 0:
        return 0
    ib = 4 if max(src, nodes) <= _INT32_MAX else 8
    total = 8 * (nodes + 1) + ib * edges
    if not symmetric and not push:
        total += 8 * (src + 1) + ib * edges
    if weighted:
        total += 4 * edges
    if (weighted or edge_values) and not push:
        total += (4 if edges <= _INT32_MAX else 8) * edges
    if edge_values if edge_dst is None else edge_dst:
        total += ib * edges
    if edge_loops:
        aug = edges + nodes
        total += 8 * (nodes + 1) + 2 * ib * aug + 2 * (4 if aug <= _INT32_MAX else 8) * aug
    return total


def _first_true(mask: torch.Tensor) -> int:
    return int(torch.nonzero(mask.reshape(-1), as_tuple=False)[0, 0])


def _check_sparse_csr(x: torch.Tensor, field: str) -> None:
    """Check a torch sparse CSR tensor's structure (what ``check_invariants=False`` lets through):
    ``crow_indices`` of length rows + 1, starting at 0, non-decreasing, ending at the number of
    stored entries; 1-d ``col_indices`` and ``values`` of that length; columns in ``[0, cols)``.
    Raises :class:`GraphError` naming ``field`` and the first bad row or entry. Columns need not be
    sorted within a row, and repeated ones are summed by the products."""
    rows, cols = int(x.shape[0]), int(x.shape[1])
    crow, col, vals = x.crow_indices(), x.col_indices(), x.values()
    if crow.dim() != 1 or crow.numel() != rows + 1:
        raise GraphError(f"{field}: sparse CSR crow_indices: expected shape [{rows + 1}] (rows + 1), "
                         f"got {list(crow.shape)}")
    if col.dim() != 1 or vals.dim() != 1 or col.numel() != vals.numel():
        raise GraphError(f"{field}: sparse CSR col_indices and values: expected two 1-d tensors of one length, got "
                         f"shapes {list(col.shape)} and {list(vals.shape)}")
    if int(crow[0]) != 0:
        raise GraphError(f"{field}: sparse CSR crow_indices[0] must be 0, got {int(crow[0])}")
    dec = crow[1:] < crow[:-1]
    if bool(dec.any()):
        i = _first_true(dec)
        raise GraphError(f"{field}: sparse CSR crow_indices decreasing at row {i} (crow_indices[{i}]={int(crow[i])} > "
                         f"crow_indices[{i + 1}]={int(crow[i + 1])})")
    if int(crow[-1]) != col.numel():
        raise GraphError(f"{field}: sparse CSR crow_indices[-1]={int(crow[-1])} must equal the number of stored "
                         f"entries len(col_indices)={col.numel()}")
    bad = (col < 0) | (col >= cols)
    if bool(bad.any()):
        k = _first_true(bad)
        row = int(torch.searchsorted(crow, torch.tensor(k, dtype=crow.dtype, device=crow.device), right=True)) - 1
        raise GraphError(f"{field}: sparse CSR entry {k} (row {row}) has column {int(col[k])} outside [0, {cols})")


class Graph:
    """A graph for full-graph GNN training: in-edge CSR structure plus node data.

    Parameters
    ----------
    indptr:
        int64 ``[num_nodes + 1]``, non-decreasing, ``indptr[0] == 0``, ``indptr[-1] == num_edges``.
    indices:
        int64 ``[num_edges]``: the source vertex of each in-edge, grouped by destination.
    num_nodes:
        An int (a float or a string is refused); defaults to ``len(indptr) - 1``.
    edge_weight:
        Optional float ``[num_edges]`` aligned with ``indices``.
    x:
        Optional node features, float ``[num_nodes, num_features]``; dense, or a torch sparse CSR
        tensor for bag-of-words style features (the first layer then multiplies sparse by dense).
        Integer features become float32 in every layout, floating ones keep their dtype (scipy
        matrices are stored float32); complex ones are refused (see :meth:`_convert_features`).
    y:
        Optional int64 labels ``[num_nodes]``; ``-1`` marks an unlabeled vertex.
    train_mask, val_mask, test_mask:
        Optional bool ``[num_nodes]`` (0/1 integers are converted; a floating mask is refused).
    num_classes:
        Defaults to ``y.max() + 1`` when ``y`` is given.
    name:
        Free-form name shown in reprs and reports.
    validate:
        Check every invariant above and raise :class:`GraphError` naming the field and the first
        bad index. Turn off only for graphs built by gnncompile itself from a validated graph.
    compact_indices:
        Keep int32 ``indices`` as given (see :meth:`compact`); otherwise indices are stored int64.
    """

    def __init__(
        self,
        indptr: ArrayLike,
        indices: ArrayLike,
        num_nodes: Optional[int] = None,
        *,
        edge_weight: Optional[ArrayLike] = None,
        x: Optional[ArrayLike] = None,
        y: Optional[ArrayLike] = None,
        train_mask: Optional[ArrayLike] = None,
        val_mask: Optional[ArrayLike] = None,
        test_mask: Optional[ArrayLike] = None,
        num_classes: Optional[int] = None,
        name: str = "graph",
        validate: bool = True,
        compact_indices: bool = False,
    ) -> None:
        self.indptr = _check_index_dtype(_as_tensor(indptr, "indptr"), "indptr")
        self.indices = _check_index_dtype(_as_tensor(indices, "indices"), "indices", keep_int32=compact_indices)
        if num_nodes is None:
            num_nodes = self.indptr.numel() - 1
        self.num_nodes = _as_count(num_nodes, "num_nodes")
        if num_classes is not None:
            num_classes = _as_count(num_classes, "num_classes")
        self.edge_weight = None if edge_weight is None else _as_tensor(edge_weight, "edge_weight")
        if self.edge_weight is not None and self.edge_weight.is_complex():
            raise GraphError(f"edge_weight: expected real values, got {self.edge_weight.dtype}")
        if self.edge_weight is not None and not self.edge_weight.is_floating_point():
            self.edge_weight = self.edge_weight.to(torch.float32)
        self.x = None if x is None else self._convert_features(x)
        self.y = None if y is None else _check_index_dtype(_as_tensor(y, "y"), "y")
        self.train_mask = None if train_mask is None else _as_tensor(train_mask, "train_mask")
        self.val_mask = None if val_mask is None else _as_tensor(val_mask, "val_mask")
        self.test_mask = None if test_mask is None else _as_tensor(test_mask, "test_mask")
        self.name = name
        self._num_classes = num_classes
        self._cache: dict[str, Any] = {}
        if validate:
            self.validate()

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _convert_features(x: ArrayLike) -> torch.Tensor:
        """``x`` as a dense tensor or a torch sparse CSR tensor, with one dtype policy for every layout.

        Integer and bool features become float32 (dense, torch CSR or COO alike); floating
        features keep their dtype (``gc.train`` casts dense ones to the model's). scipy matrices
        are stored with float32 values, as before. Complex features are refused (the imaginary
        part would be lost). Torch COO features are checked for out-of-range indices, then
        coalesced into CSR; other sparse layouts are refused.
        """
        try:
            import scipy.sparse as sp
        except ImportError:  # pragma: no cover - scipy is a hard dependency
            sp = None
        if sp is not None and sp.issparse(x):
            kind = np.dtype(x.dtype).kind
            if kind not in "biuf":
                raise GraphError(f"x: expected real features, got dtype {x.dtype}")
            csr = sp.csr_matrix(x, copy=True)
            csr.sort_indices()
            return torch.sparse_csr_tensor(
                torch.from_numpy(csr.indptr.astype(np.int64)),
                torch.from_numpy(csr.indices.astype(np.int64)),
                torch.from_numpy(csr.data.astype(np.float32, copy=False)),
                size=csr.shape,
                device="cpu",  # host arrays from scipy
                check_invariants=False,  # scipy built it; sorted above
            )
        t = _as_tensor(x, "x")
        if t.is_complex():
            raise GraphError(f"x: expected real features, got dtype {t.dtype} (the imaginary part would be lost)")
        if t.layout == torch.sparse_coo:
            if t.dim() != 2 or t.sparse_dim() != 2:
                raise GraphError(f"x: expected shape [num_nodes, num_features], got sparse COO of shape {list(t.shape)} "
                                 f"(sparse_dim={t.sparse_dim()}; 2 needed)")
            idx = t._indices()
            if idx.numel():
                bound = torch.tensor(t.shape[:2], device=idx.device).unsqueeze(1)
                bad = ((idx < 0) | (idx >= bound)).any(dim=0)
                if bool(bad.any()):
                    k = _first_true(bad)
                    raise GraphError(f"x: sparse COO entry {k} at ({int(idx[0, k])}, {int(idx[1, k])}) is outside "
                                     f"the shape {list(t.shape)}")
            t = t.coalesce().to_sparse_csr()
        if t.layout == torch.sparse_csr:
            if not t.values().is_floating_point():
                t = torch.sparse_csr_tensor(t.crow_indices(), t.col_indices(), t.values().to(torch.float32),
                                            size=t.shape, device=t.device, check_invariants=False)
        elif t.layout != torch.strided:
            raise GraphError(f"x: sparse layout {t.layout} is not supported; pass a CSR (x.to_sparse_csr()) or COO "
                             f"tensor, a scipy sparse matrix or a dense tensor")
        elif not t.is_floating_point():
            t = t.to(torch.float32)
        return t

    @classmethod
    def from_edge_index(
        cls,
        edge_index: ArrayLike,
        num_nodes: Optional[int] = None,
        *,
        edge_weight: Optional[ArrayLike] = None,
        **node_data: Any,
    ) -> "Graph":
        """Build from a ``[2, E]`` edge list of ``(source, destination)`` pairs (PyG convention).

        Edges keep their multiplicity; they are reordered by (destination, source) and
        ``edge_weight`` is permuted with them. ``num_nodes`` defaults to ``max id + 1`` (or the
        number of rows of ``x`` when given).
        """
        ei = _check_index_dtype(_as_tensor(edge_index, "edge_index"), "edge_index")
        if ei.dim() != 2 or ei.shape[0] != 2:
            raise GraphError(f"edge_index: expected shape [2, E], got {list(ei.shape)}")
        x = node_data.get("x")
        bound_from = ""
        if num_nodes is None:
            if x is not None:
                num_nodes = int(x.shape[0]) if hasattr(x, "shape") else len(x)
                bound_from = " (num_nodes was not given: it is the number of rows of x)"
            else:
                num_nodes = int(ei.max()) + 1 if ei.numel() else 0
                if num_nodes > 0:
                    _check_node_count(num_nodes, ei.device, f"edge_index: vertex id {num_nodes - 1:,} implies "
                                                            f"num_nodes = max id + 1, and ")
        num_nodes = _as_count(num_nodes, "num_nodes")
        if num_nodes < 0:
            raise GraphError(f"num_nodes: must be >= 0, got {num_nodes}")
        _check_node_count(num_nodes, ei.device, "num_nodes: ")
        if ei.numel():
            bad = (ei < 0) | (ei >= num_nodes)
            if bool(bad.any()):
                flat = _first_true(bad.any(dim=0))
                raise GraphError(
                    f"edge_index: edge {flat} = ({int(ei[0, flat])}, {int(ei[1, flat])}) has a vertex id "
                    f"outside [0, {num_nodes}){bound_from}"
                )
        src, dst = ei[0], ei[1]
        ew = None
        if edge_weight is not None:
            ew = _as_tensor(edge_weight, "edge_weight")
            if ew.dim() != 1 or ew.shape[0] != src.shape[0]:
                raise GraphError(
                    f"edge_weight: expected shape [{src.shape[0]}] (one per edge), got {list(ew.shape)}"
                )
            if ew.is_floating_point():  # checked here, where the index is the caller's (not the sorted one)
                nf = ~torch.isfinite(ew)
                if bool(nf.any()):
                    e = _first_true(nf)
                    raise GraphError(f"edge_weight: non-finite value {float(ew[e])} at edge {e} "
                                     f"({int(src[e])} -> {int(dst[e])})")
        # Sort by (dst, src); the stable sort keeps parallel edges in input order.
        key = dst * max(num_nodes, 1) + src
        order = torch.argsort(key, stable=True)
        src, dst = src[order], dst[order]
        if ew is not None:
            ew = ew[order]
        counts = (torch.bincount(dst, minlength=num_nodes) if dst.numel()
                  else torch.zeros(num_nodes, dtype=torch.int64, device=ei.device))
        indptr = torch.zeros(num_nodes + 1, dtype=torch.int64, device=ei.device)
        torch.cumsum(counts, 0, out=indptr[1:])
        return cls(indptr, src.contiguous(), num_nodes, edge_weight=ew, **node_data)

    @classmethod
    def from_scipy(cls, matrix: Any, **node_data: Any) -> "Graph":
        """Build from a scipy sparse adjacency where ``matrix[u, v] != 0`` is an edge ``u -> v``.

        Stored values become edge weights unless all are 1. See :func:`gnncompile.graph.io.from_scipy`.
        This is the transpose of :meth:`to_scipy`'s propagation matrix ``A[dst, src]``: the round
        trip is ``Graph.from_scipy(g.to_scipy().T)`` (parallel edges come back merged, weights summed).
        """
        from .io import from_scipy

        return from_scipy(matrix, **node_data)

    @classmethod
    def from_networkx(cls, nx_graph: Any, **kwargs: Any) -> "Graph":
        """Build from a networkx graph; see :func:`gnncompile.graph.io.from_networkx`."""
        from .io import from_networkx

        return from_networkx(nx_graph, **kwargs)

    @classmethod
    def from_pyg(cls, data: Any, **kwargs: Any) -> "Graph":
        """Build from a PyG ``Data`` object; see :func:`gnncompile.graph.io.from_pyg`."""
        from .io import from_pyg

        return from_pyg(data, **kwargs)

    @classmethod
    def from_npz(cls, path: Any, **kwargs: Any) -> "Graph":
        """Read the npz format of ``shared/datasets``; see :func:`gnncompile.graph.io.from_npz`."""
        from .io import from_npz

        return from_npz(path, **kwargs)

    @classmethod
    def from_planetoid(cls, folder: Any, name: str, **kwargs: Any) -> "Graph":
        """Read the Planetoid raw layout (``ind.<name>.x`` ...); see :func:`gnncompile.graph.io.from_planetoid`."""
        from .io import from_planetoid

        return from_planetoid(folder, name, **kwargs)

    def replace(self, **changes: Any) -> "Graph":
        """A copy with some fields replaced (structure fields reset the derived caches)."""
        fields = dict(
            indptr=self.indptr,
            indices=self.indices,
            num_nodes=self.num_nodes,
            edge_weight=self.edge_weight,
            x=self.x,
            y=self.y,
            train_mask=self.train_mask,
            val_mask=self.val_mask,
            test_mask=self.test_mask,
            num_classes=self._num_classes,
            name=self.name,
        )
        validate = changes.pop("validate", True)
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"Graph.replace: unknown fields {sorted(unknown)}; valid: {sorted(fields)}")
        fields.update(changes)
        g = Graph(validate=validate, compact_indices=self.indices.dtype == torch.int32, **fields)
        structural = {"indptr", "indices", "num_nodes", "edge_weight"}
        if not structural & set(changes):
            g._cache = self._cache  # derived structure is unchanged: share it
        return g

    # ------------------------------------------------------------------ validation
    def validate(self) -> "Graph":
        """Check every invariant; raise :class:`GraphError` naming the field and first bad index."""
        n = self.num_nodes
        if n < 0:
            raise GraphError(f"num_nodes: must be >= 0, got {n}")
        ip, ix = self.indptr, self.indices
        if ip.dim() != 1 or ip.numel() != n + 1:
            raise GraphError(f"indptr: expected shape [{n + 1}] (num_nodes + 1), got {list(ip.shape)}")
        if ix.dim() != 1:
            raise GraphError(f"indices: expected a 1-d tensor, got shape {list(ix.shape)}")
        if int(ip[0]) != 0:
            raise GraphError(f"indptr: indptr[0] must be 0, got {int(ip[0])}")
        if n > 0:
            dec = ip[1:] < ip[:-1]
            if bool(dec.any()):
                i = _first_true(dec)
                raise GraphError(
                    f"indptr: negative in-degree at vertex {i} (indptr[{i}]={int(ip[i])} > "
                    f"indptr[{i + 1}]={int(ip[i + 1])})"
                )
        if int(ip[-1]) != ix.numel():
            raise GraphError(f"indptr: indptr[-1]={int(ip[-1])} must equal len(indices)={ix.numel()}")
        if ix.numel():
            bad = (ix < 0) | (ix >= n)
            if bool(bad.any()):
                e = _first_true(bad)
                raise GraphError(f"indices: edge {e} has source id {int(ix[e])} outside [0, {n})")
        if self.edge_weight is not None:
            w = self.edge_weight
            if w.dim() != 1 or w.numel() != ix.numel():
                raise GraphError(f"edge_weight: expected shape [{ix.numel()}] (one per edge), got {list(w.shape)}")
            if not w.is_floating_point():
                raise GraphError(f"edge_weight: expected a floating dtype, got {w.dtype}")
            nf = ~torch.isfinite(w)
            if bool(nf.any()):
                e = _first_true(nf)
                raise GraphError(f"edge_weight: non-finite value {float(w[e])} at edge {e}")
        if self.x is not None:
            x = self.x
            if x.dim() != 2:
                raise GraphError(f"x: expected shape [num_nodes, num_features], got {list(x.shape)}")
            if x.shape[0] != n:
                raise GraphError(f"x: has {x.shape[0]} rows but the graph has num_nodes={n}")
            if x.layout == torch.sparse_csr:
                _check_sparse_csr(x, "x")
            elif x.layout != torch.strided:
                raise GraphError(f"x: expected a dense or sparse CSR tensor, got layout {x.layout}")
            if x.is_complex():
                raise GraphError(f"x: expected real features, got dtype {x.dtype}")
            vals = x.values() if x.layout == torch.sparse_csr else x
            if not vals.is_floating_point():
                raise GraphError(f"x: expected a floating dtype, got {vals.dtype}")
            nf = ~torch.isfinite(vals)
            if bool(nf.any()):
                if x.layout == torch.sparse_csr:
                    k = _first_true(nf)
                    crow = x.crow_indices()
                    row = int(torch.searchsorted(crow, torch.tensor(k, dtype=crow.dtype, device=crow.device),
                                                 right=True)) - 1
                    col = int(x.col_indices()[k])
                else:
                    row, col = (int(v) for v in torch.nonzero(nf, as_tuple=False)[0])
                raise GraphError(f"x: non-finite value {float(vals.reshape(-1)[_first_true(nf)])} at row {row}, column {col}")
        if self.y is not None:
            if self.y.dim() != 1 or self.y.numel() != n:
                raise GraphError(f"y: expected shape [{n}] (one label per vertex), got {list(self.y.shape)}")
            bad = self.y < -1
            if bool(bad.any()):
                i = _first_true(bad)
                raise GraphError(f"y: label {int(self.y[i])} at vertex {i} is negative (only -1 = unlabeled is allowed)")
            if self._num_classes is not None and self.y.numel():
                bad = self.y >= self._num_classes
                if bool(bad.any()):
                    i = _first_true(bad)
                    raise GraphError(f"y: label {int(self.y[i])} at vertex {i} >= num_classes={self._num_classes}")
        for field in ("train_mask", "val_mask", "test_mask"):
            m = getattr(self, field)
            if m is None:
                continue
            if m.dim() != 1 or m.numel() != n:
                raise GraphError(f"{field}: expected shape [{n}] (one entry per vertex), got {list(m.shape)}")
            if m.dtype != torch.bool:
                if m.is_floating_point() or m.is_complex():
                    raise GraphError(f"{field}: expected a bool mask (or 0/1 integers), got dtype {m.dtype}: a "
                                     f"floating mask is refused whatever its values; pass mask.bool() or mask != 0")
                bad = (m != 0) & (m != 1)
                if bool(bad.any()):
                    i = _first_true(bad)
                    raise GraphError(f"{field}: expected a bool mask, got dtype {m.dtype} with non-0/1 values "
                                     f"({int(m[i])} at vertex {i})")
                setattr(self, field, m.to(torch.bool))
            if self.y is not None:
                unl = getattr(self, field) & (self.y < 0)
                if bool(unl.any()):
                    i = _first_true(unl)
                    raise GraphError(f"{field}: vertex {i} is in the mask but has no label (y=-1)")
        if self._num_classes is not None and self._num_classes < 0:
            raise GraphError(f"num_classes: must be >= 0, got {self._num_classes}")
        self._warn_overlapping_masks()
        return self

    def _warn_overlapping_masks(self) -> None:
        """Warn (a ``UserWarning``, not an error: some runs overlap the sets on purpose) when two of the
        train / val / test masks share vertices, naming the masks and how many: the accuracy of one
        then partly measures the other (a test accuracy over training vertices is inflated)."""
        masks = [(f, m) for f in ("train_mask", "val_mask", "test_mask") if (m := getattr(self, f)) is not None]
        shared = [(a, b, int((ma & mb).sum())) for i, (a, ma) in enumerate(masks) for b, mb in masks[i + 1:]]
        shared = [f"{a} and {b} share {k:,} vertices" for a, b, k in shared if k]
        if shared:
            from .io import _warn
            inflated = " (an accuracy over training vertices is inflated)" if "train_mask" in shared[0] else ""
            _warn(f"graph {self.name!r}: {'; '.join(shared)}, so the accuracy on one partly measures the "
                  f"other{inflated}")

    # ------------------------------------------------------------------ basic properties
    @property
    def num_edges(self) -> int:
        return int(self.indices.numel())

    @property
    def num_features(self) -> int:
        return 0 if self.x is None else int(self.x.shape[1])

    @property
    def num_classes(self) -> int:
        if self._num_classes is not None:
            return int(self._num_classes)
        if self.y is None or self.y.numel() == 0:
            return 0
        return int(self.y.max()) + 1

    @property
    def device(self) -> torch.device:
        return self.indptr.device

    def __repr__(self) -> str:
        feat = "none" if self.x is None else f"{self.num_features}" + (
            " (sparse)" if self.x.layout == torch.sparse_csr else ""
        )
        return (
            f"Graph(name={self.name!r}, num_nodes={self.num_nodes:,}, num_edges={self.num_edges:,}, "
            f"features={feat}, classes={self.num_classes}, weighted={self.edge_weight is not None})"
        )

    # ------------------------------------------------------------------ derived, cached structure
    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        """Return ``self._cache[key]``, building it with ``build()`` on first use."""
        try:
            return self._cache[key]
        except KeyError:
            value = self._cache[key] = build()
            return value

    def set_derived(self, key: str, value: Any) -> None:
        """Store ``value`` as the derived data ``key`` (what :meth:`cached` returns from then on)."""
        self._cache[key] = value

    def drop_derived(self, *keys: str) -> None:
        """Forget the derived data ``keys`` (absent keys are ignored): built again on next use."""
        for key in keys:
            self._cache.pop(key, None)

    @property
    def dst(self) -> torch.Tensor:
        """``[E]``: the destination vertex of every edge (the CSR row of each entry), cached; in
        ``indices``' dtype. Products never need it (the CSR rows are the destinations); edge-wise
        ops (attention, edge softmax) do."""
        return self.cached("dst", self._edge_dst)

    def _edge_dst(self) -> torch.Tensor:
        """The destinations of every edge, from the cache when there, else computed and *not* kept."""
        if "dst" in self._cache:
            return self._cache["dst"]
        return torch.repeat_interleave(torch.arange(self.num_nodes, device=self.device, dtype=self.indices.dtype),
                                       self.in_degree(), output_size=self.num_edges)

    @property
    def num_src(self) -> int:
        """Number of source vertices (rows an input of a propagation has): ``num_nodes`` here.

        A rank's local graph (:class:`gnncompile.graph.shard.LocalGraph`) has more sources than
        destinations: its own vertices first, then the halo rows fetched from other ranks.
        """
        return self.num_nodes

    @property
    def src(self) -> torch.Tensor:
        """``[E]``: the source vertex of every edge (alias of ``indices``)."""
        return self.indices

    # Degrees are computed on each call (O(N) for in-degrees, O(E) for the others) and not cached:
    # a training graph holds its structure and the normalization scales, not per-vertex byproducts.
    def in_degree(self) -> torch.Tensor:
        """int64 ``[N]``: number of in-edges per vertex (parallel edges counted)."""
        return self.indptr[1:] - self.indptr[:-1]

    def out_degree(self) -> torch.Tensor:
        """int64 ``[num_src]``: number of out-edges per vertex."""
        return torch.bincount(self.indices, minlength=self.num_src)

    def weighted_in_degree(self) -> torch.Tensor:
        """float ``[N]``: sum of in-edge weights (the in-degree when unweighted)."""
        if self.edge_weight is None:
            return self.in_degree().to(torch.float32)
        return torch.zeros(self.num_nodes, dtype=self.edge_weight.dtype, device=self.device).index_add_(
            0, self._edge_dst(), self.edge_weight)

    def _transposed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Out-edge CSR and edge permutation, computed (not cached): ``indices_t`` in ``indices``'
        dtype, ``perm`` int32 when the edge ids fit."""
        dst = self._edge_dst()
        key = self.indices.to(torch.int64) * max(self.num_nodes, 1) + dst.to(torch.int64)
        perm = torch.argsort(key, stable=True)
        del key
        indptr_t = torch.zeros(self.num_src + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(self.out_degree(), 0, out=indptr_t[1:])
        indices_t = dst.index_select(0, perm)
        return indptr_t, indices_t, _compact_index(perm, self.num_edges)

    def transpose_structure(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Out-edge CSR ``(indptr_t, indices_t)``: the structure a backward product reads, cached.

        ``indices_t[indptr_t[u]:indptr_t[u+1]]`` are the destinations of ``u``'s out-edges. For a
        symmetric graph this is ``(indptr, indices)`` themselves (no copy).
        """
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            if "transpose" in self._cache:
                return self._cache["transpose"][:2]
            if self._cache.get("is_symmetric") is True:
                return self.indptr, self.indices
            indptr_t, indices_t, _ = self._transposed()
            return self._share_if_symmetric(indptr_t, indices_t)
        return self.cached("transpose_structure", build)

    def _share_if_symmetric(self, indptr_t: torch.Tensor, indices_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indptr, indices)`` themselves when the transposed structure equals them (recording
        that the graph is symmetric), else the transposed arrays."""
        sym = self.num_src == self.num_nodes and bool(torch.equal(indptr_t, self.indptr)
                                                       and torch.equal(indices_t, self.indices))
        self._cache.setdefault("is_symmetric", sym)
        return (self.indptr, self.indices) if sym else (indptr_t, indices_t)

    def transpose(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Out-edge CSR with the edge permutation: ``(indptr_t, indices_t, perm)``, cached.

        ``perm[k]`` is the edge id (position in the in-edge order) of transposed entry ``k``, so an
        edge-wise tensor ``w`` is re-ordered for the transposed product by ``w[perm]``. Backward
        passes of P ops with edge values use this instead of materializing ``A^T``; products
        without edge values need only :meth:`transpose_structure`. The structure is shared with
        :meth:`transpose_structure` (and with the graph itself when it is symmetric).
        """
        def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            indptr_t, indices_t, perm = self._transposed()
            if "transpose_structure" in self._cache:
                indptr_t, indices_t = self._cache["transpose_structure"]
            else:
                indptr_t, indices_t = self._share_if_symmetric(indptr_t, indices_t)
            return indptr_t, indices_t, perm
        return self.cached("transpose", build)

    def is_symmetric(self) -> bool:
        """Whether every edge ``u -> v`` also appears as ``v -> u`` (with equal multiplicity)."""
        def build() -> bool:
            if self.num_src != self.num_nodes:
                return False
            if "transpose_structure" in self._cache:
                return self._cache["transpose_structure"][1] is self.indices
            # compared, not kept: a graph whose backward products scatter never holds its transpose
            indptr_t, indices_t, _ = self._transposed()
            return bool(torch.equal(indptr_t, self.indptr) and torch.equal(indices_t, self.indices))
        return self.cached("is_symmetric", build)

    def has_self_loops(self) -> bool:
        return bool((self.indices == self._edge_dst()).any()) if self.num_edges else False

    def _weighted_out_degree(self) -> torch.Tensor:
        """float64 ``[num_src]``: sum of out-edge weights (the out-degree when unweighted)."""
        if self.edge_weight is None:
            return self.out_degree().to(torch.float64)
        return torch.zeros(self.num_src, dtype=torch.float64, device=self.device).index_add_(
            0, self.indices, self.edge_weight.to(torch.float64))

    def norm_scales(self, norm: str, self_loops: bool = False) -> NormScales:
        """The per-vertex factors of a normalized propagation (:class:`NormScales`), cached.

        Without self loops:

        - ``"gcn"``: ``row = deg_in^-1/2``, ``col = deg_out^-1/2`` with weighted degrees (Kipf &
          Welling's symmetric normalization; on a symmetric graph ``deg_out == deg_in``, matching
          PyG's ``gcn_norm``);
        - ``"mean"``: ``row = 1 / deg_in`` (weighted);
        - ``"sum"`` / ``"none"``: no factors (the edge weights alone).

        With ``self_loops`` (a propagation over ``A + I``, weight 1 per loop) every degree counts
        the vertex's loop (GCN's renormalization trick), ``"gcn"``'s loop factor is ``row * col``
        of the vertex, ``"mean"``'s ``row``, ``"sum"``'s 1. A rank's local graph counts the loops
        of its destinations, which are its first sources. Zero-degree vertices get zero factors.
        """
        valid = ("gcn", "mean", "sum") if self_loops else ("gcn", "mean", "sum", "none")
        if norm not in valid:
            what = "with self loops" if self_loops else ""
            raise GraphError(f"norm: unknown normalization {norm!r} {what}; valid: {', '.join(map(repr, valid))}")
        def build() -> NormScales:
            sc = self._norm_scales(norm, self_loops)
            dtype = getattr(self, "_scales_dtype", None)
            return sc if dtype is None else sc.to(dtype)
        return self.cached(f"scales:{norm}:{int(self_loops)}", build)

    def _norm_scales(self, norm: str, self_loops: bool) -> NormScales:
        n = self.num_nodes
        if norm in ("sum", "none"):
            return NormScales(loop=torch.ones(n, dtype=torch.float64, device=self.device) if self_loops else None)
        deg_in = self.weighted_in_degree().to(torch.float64) + (1.0 if self_loops else 0.0)
        if norm == "mean":
            inv = torch.where(deg_in > 0, 1.0 / deg_in.clamp_min(1e-30), torch.zeros_like(deg_in))
            return NormScales(row=inv, loop=inv if self_loops else None)
        row = torch.where(deg_in > 0, deg_in.clamp_min(1e-30).rsqrt(), torch.zeros_like(deg_in))
        deg_out = self._weighted_out_degree()
        if self_loops:
            deg_out[:n] += 1.0
        col = torch.where(deg_out > 0, deg_out.clamp_min(1e-30).rsqrt(), torch.zeros_like(deg_out))
        return NormScales(row=row, col=col, loop=row * col[:n] if self_loops else None)

    def norm_coefficients(self, norm: str) -> Optional[torch.Tensor]:
        """float64 ``[E]`` coefficients of a normalized propagation ``out[v] = sum_e c_e * x[src_e]``
        (:meth:`norm_scales` expanded per edge, with the edge weights; ``None`` for ``"sum"`` /
        ``"none"`` on an unweighted graph). Materialized on each call and not cached: training
        applies the per-vertex scales instead.
        """
        if norm in ("sum", "none"):
            return self.edge_weight
        return self.norm_scales(norm).edge_values(self)

    def loop_norm_coefficients(self, norm: str) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``(edge_coef [E], loop_coef [N])`` of a normalized propagation over ``A + I``
        (:meth:`norm_scales` with self loops, expanded per edge; ``"sum"`` gives the edge weights,
        ones when unweighted). Materialized on each call, not cached."""
        sc = self.norm_scales(norm, self_loops=True)
        edge = sc.edge_values(self)
        if edge is None:
            edge = torch.ones(self.num_edges, dtype=torch.float64, device=self.device)
        assert sc.loop is not None
        return edge, sc.loop

    def compact(self) -> "Graph":
        """This graph with int32 ``indices`` when the sources fit (else itself): the layout training
        holds. Node data and derived caches that do not depend on the index dtype are shared."""
        if self.indices.dtype == torch.int32 or self.num_src > _INT32_MAX:
            return self
        g = Graph(self.indptr, self.indices.to(torch.int32), self.num_nodes, edge_weight=self.edge_weight,
                  x=self.x, y=self.y, train_mask=self.train_mask, val_mask=self.val_mask, test_mask=self.test_mask,
                  num_classes=self._num_classes, name=self.name, validate=False, compact_indices=True)
        for key, value in self._cache.items():
            if key.startswith("scales:") or key in ("is_symmetric", "backward_product"):
                g._cache[key] = value
        return g

    def data_hash(self) -> str:
        """A short hash of the graph's features, labels and masks (:func:`tensor_hash` with
        ``sample``): what a checkpoint's fingerprint compares beside the structure's."""
        return tensor_hash(self.x, self.y, self.train_mask, self.val_mask, self.test_mask, sample=True)

    def structure_bytes(self) -> int:
        """Bytes the topology holds now: ``indptr``, ``indices``, ``edge_weight`` and every tensor
        derived from them and cached (on the graph and on its kernel handles), each storage counted
        once. Node data (features, labels, masks) is not counted."""
        seen: set[tuple[int, int]] = set()
        total = 0

        def walk(v: Any) -> None:
            nonlocal total
            if isinstance(v, torch.Tensor):
                if v.layout != torch.strided:
                    return
                st = v.untyped_storage()
                key = (st.data_ptr(), st.nbytes())
                if key not in seen and st.nbytes():
                    seen.add(key)
                    total += st.nbytes()
            elif isinstance(v, (tuple, list)):
                for item in v:
                    walk(item)
            elif isinstance(v, dict):
                for item in v.values():
                    walk(item)
            elif isinstance(v, NormScales):
                walk([v.row, v.col, v.loop])
            elif isinstance(v, Graph):  # a derived graph (the loop-augmented structure of edge ops)
                walk([v.indptr, v.indices, v.edge_weight, v._cache, *v._structure_extras()])
            elif hasattr(v, "cache") and hasattr(v, "indptr"):  # a kernel CSR handle and its caches
                walk([v.indptr, v.indices, v.cache])

        walk([self.indptr, self.indices, self.edge_weight, self._cache, *self._structure_extras()])
        return total

    def _structure_extras(self) -> list:
        """Topology tensors a subclass holds outside the cache (counted by :meth:`structure_bytes`)."""
        return []

    def cast_scales(self, dtype: torch.dtype) -> None:
        """Keep the normalization scales in ``dtype`` (the model's), those cached now and those
        computed later: the runtime casts them once, so a float32 model holds no float64 copy.
        Values derived from them are dropped."""
        self._scales_dtype = dtype
        if any(isinstance(v, NormScales) and v.has_dtype_other_than(dtype) for v in self._cache.values()):
            # a new dict: a graph made by replace() may share this one
            self._cache = {k: v.to(dtype) if isinstance(v, NormScales) else v
                           for k, v in self._cache.items() if not k.startswith("terms:")}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        # derived structures are rebuilt where the graph is used (a rank process), not shipped
        state["_cache"] = {k: v for k, v in self._cache.items() if k == "is_symmetric"}
        return state

    # ------------------------------------------------------------------ transformations
    def edge_index(self) -> torch.Tensor:
        """int64 ``[2, E]`` ``(source, destination)`` pairs in edge-id order."""
        return torch.stack([self.indices, self.dst])

    def to_scipy(self, weighted: bool = True):
        """scipy CSR matrix ``A`` with ``A[dst, src] = w`` (the in-edge CSR itself; duplicates summed).

        ``A`` is the propagation matrix (``A @ x`` sums every vertex's in-neighbours), the transpose
        of the adjacency :meth:`from_scipy` reads (``matrix[u, v]`` is the edge ``u -> v``): the
        round trip is ``Graph.from_scipy(g.to_scipy().T)``. ``weighted=False`` gives 1 per edge.
        """
        import scipy.sparse as sp

        data = (
            self.edge_weight.detach().cpu().numpy()
            if weighted and self.edge_weight is not None
            else np.ones(self.num_edges, dtype=np.float32)
        )
        return sp.csr_matrix(
            (data, self.indices.cpu().numpy(), self.indptr.cpu().numpy()), shape=(self.num_nodes, self.num_nodes)
        )

    def _node_data(self) -> dict[str, Any]:
        return dict(
            x=self.x, y=self.y, train_mask=self.train_mask, val_mask=self.val_mask,
            test_mask=self.test_mask, num_classes=self._num_classes, name=self.name,
        )

    def _rebuild(self, src: torch.Tensor, dst: torch.Tensor, w: Optional[torch.Tensor]) -> "Graph":
        return Graph.from_edge_index(
            torch.stack([src, dst]), self.num_nodes, edge_weight=w, **self._node_data()
        )

    def to_undirected(self, reduce: str = "max") -> "Graph":
        """Add the reverse of every edge and merge duplicates into single edges.

        Parallel edges (from the input or created by symmetrizing) are merged; their weights are
        combined with ``reduce`` (``"max"``, ``"sum"`` or ``"mean"``). The result is symmetric.
        """
        if reduce not in ("max", "sum", "mean"):
            raise GraphError(f"reduce: unknown {reduce!r}; valid: 'max', 'sum', 'mean'")
        src = torch.cat([self.indices, self.dst]).long()   # int64: dst * n overflows a compact graph's int32
        dst = torch.cat([self.dst, self.indices]).long()
        w = None if self.edge_weight is None else torch.cat([self.edge_weight, self.edge_weight])
        n = max(self.num_nodes, 1)
        key = dst * n + src
        uniq, inverse = torch.unique(key, sorted=True, return_inverse=True)
        new_w = None
        if w is not None:
            red = {"max": "amax", "sum": "sum", "mean": "mean"}[reduce]
            new_w = torch.zeros(uniq.numel(), dtype=w.dtype, device=w.device).scatter_reduce_(0, inverse, w, red, include_self=False)
        return self._rebuild(uniq % n, uniq // n, new_w)

    def add_self_loops(self, fill_value: float = 1.0) -> "Graph":
        """Add one self loop ``v -> v`` to every vertex (weight ``fill_value`` when weighted).

        Existing self loops are kept (PyG's ``add_self_loops`` behaves the same); use
        :meth:`remove_self_loops` first to replace them.
        """
        ar = torch.arange(self.num_nodes, device=self.device)
        src = torch.cat([self.indices, ar])
        dst = torch.cat([self.dst, ar])
        w = None
        if self.edge_weight is not None:
            w = torch.cat([self.edge_weight, torch.full((self.num_nodes,), fill_value, dtype=self.edge_weight.dtype,
                                                        device=self.device)])
        return self._rebuild(src, dst, w)

    def remove_self_loops(self) -> "Graph":
        keep = self.indices != self.dst
        w = None if self.edge_weight is None else self.edge_weight[keep]
        return self._rebuild(self.indices[keep], self.dst[keep], w)

    def to(self, device: torch.device | str) -> "Graph":
        """This graph on ``device``: structure, node data (sparse features included) and derived caches.

        Every cached tensor moves with it (degrees, destinations, the transposed CSR and its edge
        permutation, normalization coefficients, the self-loop-augmented graph; see
        :func:`_move_cached`), each once, so no later step reads a structure left on the old
        device. A graph already on ``device`` is returned as is. A CUDA device without a visible GPU
        (or a GPU index that does not exist) raises :class:`~gnncompile.errors.RuntimeFailure`.
        """
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ArgumentError(f"Graph.to: {device!r} is not a device ('cpu', 'cuda', 'cuda:N'): {exc}") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeFailure(f"Graph.to({str(device)!r}): no CUDA GPU is visible (torch.cuda.is_available() "
                                     "is False); keep the graph on the CPU")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            elif not 0 <= device.index < torch.cuda.device_count():
                raise RuntimeFailure(f"Graph.to({str(device)!r}): there is no such GPU ({torch.cuda.device_count()} "
                                     "visible)")
        if device == self.device:
            return self

        moved: dict[int, torch.Tensor] = {}

        def mv(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else _move_cached(t, device, moved)
        g = Graph(
            mv(self.indptr), mv(self.indices), self.num_nodes, edge_weight=mv(self.edge_weight),
            x=mv(self.x), y=mv(self.y), train_mask=mv(self.train_mask), val_mask=mv(self.val_mask),
            test_mask=mv(self.test_mask), num_classes=self._num_classes, name=self.name, validate=False,
            compact_indices=True,
        )
        g._cache = _move_cached(self._cache, device, moved)
        return g

    def normalize_features(self) -> "Graph":
        """Row-normalize ``x`` so every non-zero row sums to 1 (Kipf & Welling's preprocessing)."""
        if self.x is None:
            raise GraphError("x: the graph has no node features")
        x = self.x
        if x.layout == torch.sparse_csr:
            vals = x.values()
            rows = torch.repeat_interleave(
                torch.arange(x.shape[0], device=vals.device), x.crow_indices()[1:] - x.crow_indices()[:-1],
                output_size=vals.numel())
            sums = torch.zeros(x.shape[0], dtype=vals.dtype, device=vals.device).index_add_(0, rows, vals)
            inv = torch.where(sums != 0, 1.0 / sums, torch.zeros_like(sums))
            new = torch.sparse_csr_tensor(x.crow_indices(), x.col_indices(), vals * inv[rows], size=x.shape,
                                          device=vals.device, check_invariants=False)
        else:
            sums = x.sum(dim=1, keepdim=True)
            new = x * torch.where(sums != 0, 1.0 / sums, torch.zeros_like(sums))
        return self.replace(x=new, validate=False)

    def dense_features(self) -> torch.Tensor:
        """``x`` as a dense tensor (materializes sparse features)."""
        if self.x is None:
            raise GraphError("x: the graph has no node features")
        return self.x.to_dense() if self.x.layout == torch.sparse_csr else self.x

    def stats(self) -> "GraphStats":
        return GraphStats.from_graph(self)

    # Graphs are passed to fx-traced modules as inputs; make them hash by identity.
    __hash__ = object.__hash__


def _move_cached(value: Any, device: torch.device, moved: dict[int, torch.Tensor]) -> Any:
    """A derived-cache entry on ``device``, or :data:`_UNMOVABLE` (dropped; rebuilt on demand).

    Tensors move once each (``moved`` maps the id of a tensor already moved, e.g. the graph's own
    ``indptr``, to its copy, so entries that share a tensor still share it); tuples, lists and
    dicts of movable entries and cached graphs move; plain values (bools, numbers, strings, None)
    are kept. Anything else (handles holding device-specific state, such as the kernels' CSR
    objects with their cuSPARSE descriptors) is dropped: it is a view of moved tensors, rebuilt on
    first use on the new device.
    """
    if isinstance(value, torch.Tensor):
        if id(value) not in moved:
            moved[id(value)] = value.to(device)
        return moved[id(value)]
    if isinstance(value, Graph):
        return value.to(device)
    if isinstance(value, NormScales):
        return NormScales(*(_move_cached(t, device, moved) for t in (value.row, value.col, value.loop)))
    if isinstance(value, (tuple, list)):
        items = [_move_cached(v, device, moved) for v in value]
        return _UNMOVABLE if any(m is _UNMOVABLE for m in items) else type(value)(items)
    if isinstance(value, dict):
        out = {k: _move_cached(v, device, moved) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not _UNMOVABLE}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _UNMOVABLE


_UNMOVABLE = object()


@dataclass(frozen=True)
class GraphStats:
    """Size and degree statistics: everything planning needs, without the graph itself.

    ``num_edges`` counts directed edges as stored (an undirected edge counts twice).
    ``degree_skew`` is the sample skewness of the in-degree distribution (0 for regular graphs).
    ``replication`` optionally maps a part count to a measured replication factor alpha.
    ``symmetric`` (every edge stored in both directions; ``None``: unknown, planned as directed)
    and ``weighted`` (edge weights stored) size the topology a device holds.
    """

    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    degree_mean: float = math.nan
    degree_max: int = -1
    degree_skew: float = math.nan
    replication: Optional[dict[int, float]] = None
    name: str = "stats"
    symmetric: Optional[bool] = None
    weighted: bool = False

    def __post_init__(self) -> None:
        for field in ("num_nodes", "num_edges", "num_features", "num_classes"):
            v = getattr(self, field)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise GraphError(f"GraphStats.{field}: expected an int, got {type(v).__name__}")
            if v < 0:
                raise GraphError(f"GraphStats.{field}: must be >= 0, got {v}")
        if not (math.isnan(self.degree_mean) or 0 <= self.degree_mean < math.inf):
            raise GraphError(f"GraphStats.degree_mean: must be a finite number >= 0, got {self.degree_mean}")
        if not (self.degree_max == -1 or isinstance(self.degree_max, (int, np.integer)) and self.degree_max >= 0):
            raise GraphError(f"GraphStats.degree_max: must be an int >= 0 (or -1: unknown), got {self.degree_max!r}")
        if math.isinf(self.degree_skew):
            raise GraphError(f"GraphStats.degree_skew: must be finite (or NaN: unknown), got {self.degree_skew}")
        if self.replication is not None and any(not 1 <= float(a) < math.inf for a in self.replication.values()):
            raise GraphError(f"GraphStats.replication: every replication factor is >= 1 (each vertex is held once at "
                             f"least), got {self.replication}")
        if math.isnan(self.degree_mean) and self.num_nodes > 0:
            object.__setattr__(self, "degree_mean", self.num_edges / self.num_nodes)

    @classmethod
    def from_graph(cls, g: Graph) -> "GraphStats":
        deg = g.in_degree().to(torch.float64)
        n = g.num_nodes
        if n:
            mean = float(deg.mean())
            std = float(deg.std(unbiased=False))
            skew = float(((deg - mean) ** 3).mean() / std**3) if std > 0 else 0.0
            dmax = int(deg.max())
        else:
            mean, skew, dmax = 0.0, 0.0, 0
        return cls(
            num_nodes=n, num_edges=g.num_edges, num_features=g.num_features, num_classes=g.num_classes,
            degree_mean=mean, degree_max=dmax, degree_skew=skew, name=g.name,
            symmetric=g.is_symmetric() if g.num_edges else True, weighted=g.edge_weight is not None,
        )

    @property
    def avg_degree(self) -> float:
        return self.degree_mean

    def __str__(self) -> str:
        """One line; a degree statistic not known (statistics of a dataset not stored here) prints as ``?``."""
        mean = "?" if math.isnan(self.degree_mean) else f"{self.degree_mean:.2f}"
        dmax = "?" if self.degree_max == -1 else f"{self.degree_max}"
        skew = "?" if math.isnan(self.degree_skew) else f"{self.degree_skew:.2f}"
        return (
            f"{self.name}: |V|={self.num_nodes:,} |E|={self.num_edges:,} d={self.num_features} "
            f"classes={self.num_classes} deg mean={mean} max={dmax} skew={skew}"
        )
