"""Vertex partitioners and the statistics of a partition (halo sizes, edge cut, replication factor).

A *partition* assigns every vertex to one of ``P`` parts (one part per rank in data-parallel
full-graph training). Each part owns its vertices and computes their aggregation; the in-edges of
an owned vertex whose source is owned elsewhere make that source a *halo* vertex of the part, a row
that must be fetched from its owner (and replicated) in every layer.

Methods (:data:`PARTITIONERS`)
------------------------------
``"contiguous"``
    Parts are consecutive id ranges, balanced by vertex count (default), by in-edges
    (``balance="edges"``: the cuts follow ``indptr``) or by ``vertex_weights``. Good on graphs whose
    ids follow their communities (ordered crawls, reordered graphs), poor on shuffled ids.
``"random"``
    A seeded random balanced assignment (a permutation dealt round robin): part sizes differ by at
    most 1. The baseline with no locality at all.
``"metis"``
    METIS k-way (``METIS_PartGraphKway`` through pymetis) minimizing the edge cut of the symmetrized
    graph without self loops or parallel edges, with at most 3% imbalance of the vertex weights
    (METIS's default ``ufactor``). Optional ``edge_weights`` (one per CSR edge) make it minimize
    the weighted cut instead (the weight of an undirected pair is the sum over both directions and
    parallel edges), and ``vertex_weights`` of shape ``[V, C]`` balance ``C`` constraints at once
    (METIS multi-constraint partitioning). GSPLIT's presampling-weighted partition
    (:func:`gnncompile.graph.presample.presampled_partition`) is this with sampled counts as weights.

Statistics (:func:`partition_stats`, :class:`PartitionStats`) are computed with vectorized torch
operations (a handful of gathers, bincounts and one ``unique`` over the cut edges): a graph with a
few million edges takes a fraction of a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from ..errors import GraphError, PlanningError
from .core import Graph, GraphStats

__all__ = ["BALANCE_MODES", "PARTITIONERS", "Partition", "PartitionStats", "partition", "partition_stats",
           "ReplicationEstimate", "expected_replication"]

#: Valid values of ``method`` in :func:`partition`.
PARTITIONERS = ("contiguous", "random", "metis")

#: Valid values of ``balance`` in :func:`partition`.
BALANCE_MODES = ("vertices", "edges")


# ------------------------------------------------------------------------------------- validation
def _check_num_parts(num_parts: Any) -> int:
    """``num_parts`` as an int >= 1, or :class:`PlanningError`."""
    if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)):
        raise PlanningError(f"num_parts: expected an int, got {type(num_parts).__name__} {num_parts!r}")
    if num_parts < 1:
        raise PlanningError(f"num_parts: must be >= 1, got {int(num_parts)}")
    return int(num_parts)


def _check_parts(parts: Any, num_nodes: int, num_parts: int) -> Tensor:
    """``parts`` as an int64 CPU tensor ``[num_nodes]`` with ids in ``[0, num_parts)``, or :class:`GraphError`."""
    t = parts if isinstance(parts, Tensor) else torch.as_tensor(np.asarray(parts))
    if t.numel() == 0:
        t = t.to(torch.int64)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise GraphError(f"parts: expected an integer dtype, got {t.dtype}")
    t = t.detach().to(device="cpu", dtype=torch.int64)
    if t.dim() != 1 or t.numel() != num_nodes:
        raise GraphError(f"parts: expected shape [{num_nodes}] (one part id per vertex), got {list(t.shape)}")
    bad = (t < 0) | (t >= num_parts)
    if bool(bad.any()):
        v = int(torch.nonzero(bad)[0, 0])
        raise GraphError(f"parts: vertex {v} has part id {int(t[v])} outside [0, {num_parts})")
    return t.contiguous()


def _resolve_weights(graph: Graph, vertex_weights: Optional[Tensor], balance: str) -> Optional[Tensor]:
    """The int64 per-vertex weights to balance, or ``None`` for unit weights (balance vertex counts).

    ``vertex_weights`` is ``[V]``, or ``[V, C]`` for ``C`` balance constraints (METIS only; the
    caller checks the method).
    """
    if balance not in BALANCE_MODES:
        raise PlanningError(f"balance: unknown {balance!r}; valid: {', '.join(map(repr, BALANCE_MODES))}")
    if vertex_weights is None:
        return graph.in_degree().detach().cpu() if balance == "edges" else None
    if balance == "edges":
        raise PlanningError("pass either vertex_weights or balance='edges', not both")
    w = _int_weights(vertex_weights, "vertex_weights", "an integer dtype")
    if w.dim() not in (1, 2) or w.shape[0] != graph.num_nodes or (w.dim() == 2 and w.shape[1] < 1):
        raise GraphError(f"vertex_weights: expected shape [{graph.num_nodes}] (one per vertex) or "
                         f"[{graph.num_nodes}, C] (C balance constraints), got {list(w.shape)}")
    return _nonnegative(w, "vertex_weights", "vertex")


def _int_weights(weights: Any, what: str, want: str) -> Tensor:
    """``weights`` as an int64 CPU tensor; :class:`GraphError` for a float, complex or bool dtype."""
    w = weights if isinstance(weights, Tensor) else torch.as_tensor(np.asarray(weights))
    if w.is_floating_point() or w.is_complex() or w.dtype == torch.bool:
        raise GraphError(f"{what}: expected {want}, got {w.dtype}")
    return w.detach().to(device="cpu", dtype=torch.int64)


def _nonnegative(w: Tensor, what: str, unit: str) -> Tensor:
    """``w`` (contiguous) when no entry is negative; :class:`GraphError` naming the first row otherwise."""
    neg = w < 0
    if bool(neg.any()):
        i = int(torch.nonzero(neg)[0, 0])
        raise GraphError(f"{what}: {unit} {i} has negative weight {int(w.reshape(w.shape[0], -1)[i].min())}")
    return w.contiguous()


def _check_edge_weights(graph: Graph, edge_weights: Any) -> Tensor:
    """``edge_weights`` as a non-negative int64 CPU tensor ``[E]`` (CSR edge order), or :class:`GraphError`."""
    w = _int_weights(edge_weights, "edge_weights", "an integer dtype (scale float weights to integers)")
    if w.dim() != 1 or w.numel() != graph.num_edges:
        raise GraphError(f"edge_weights: expected shape [{graph.num_edges}] (one per edge, in CSR order), "
                         f"got {list(w.shape)}")
    return _nonnegative(w, "edge_weights", "edge")


# ------------------------------------------------------------------------------------- statistics
@dataclass(frozen=True, eq=False)
class PartitionStats:
    """Per-part statistics of a vertex partition; every field is an int64 CPU tensor.

    Attributes
    ----------
    num_local:
        ``[P]`` vertices owned by each part.
    num_halo:
        ``[P]`` distinct remote vertices each part must fetch: sources of in-edges of its owned
        vertices that are owned by another part (the row sums of ``halo_matrix``).
    num_edges:
        ``[P]`` in-edges of each part's owned vertices (parallel edges and self loops counted).
    edge_cut:
        ``[P]`` of those in-edges whose source is remote.
    halo_matrix:
        ``[P, P]``: entry ``[p, q]`` is the number of distinct vertices owned by ``q`` needed by ``p``
        (zero diagonal).
    """

    num_local: Tensor
    num_halo: Tensor
    num_edges: Tensor
    edge_cut: Tensor
    halo_matrix: Tensor

    def __post_init__(self) -> None:
        p = self.num_local.numel()
        for name in ("num_local", "num_halo", "num_edges", "edge_cut"):
            t = getattr(self, name)
            if t.dim() != 1 or t.numel() != p or t.dtype != torch.int64:
                raise GraphError(f"PartitionStats.{name}: expected int64 shape [{p}], got {t.dtype} {list(t.shape)}")
        if self.halo_matrix.shape != (p, p) or self.halo_matrix.dtype != torch.int64:
            raise GraphError(
                f"PartitionStats.halo_matrix: expected int64 shape [{p}, {p}], "
                f"got {self.halo_matrix.dtype} {list(self.halo_matrix.shape)}"
            )
        if not torch.equal(self.halo_matrix.sum(dim=1), self.num_halo):
            raise GraphError("PartitionStats: num_halo must equal the row sums of halo_matrix")

    @property
    def num_parts(self) -> int:
        """``P``, the length of the per-part tensors."""
        return self.num_local.numel()

    @property
    def num_nodes(self) -> int:
        """Vertices of the partitioned graph (``sum(num_local)``)."""
        return int(self.num_local.sum())

    @property
    def total_edges(self) -> int:
        """Edges of the partitioned graph (``sum(num_edges)``)."""
        return int(self.num_edges.sum())

    @property
    def total_edge_cut(self) -> int:
        """In-edges whose source and destination are owned by different parts."""
        return int(self.edge_cut.sum())

    @property
    def replication_factor(self) -> float:
        """alpha = ``sum_p (num_local[p] + num_halo[p]) / |V|``: copies per vertex, masters included.

        This is NeutronTask's neighbor replication factor (1 with one part; ``1 + sum(num_halo) / |V|``).
        An empty graph has alpha = 1.
        """
        n = self.num_nodes
        return (n + int(self.num_halo.sum())) / n if n else 1.0


def partition_stats(graph: Graph, parts: Any, num_parts: int) -> PartitionStats:
    """Statistics of the assignment ``parts`` (vertex -> part id in ``[0, num_parts)``) of ``graph``.

    ``parts`` may be any integer tensor or array of length ``graph.num_nodes``; empty parts are
    allowed (their rows are all zero).

    Raises
    ------
    PlanningError
        When ``num_parts < 1``.
    GraphError
        When ``parts`` has the wrong dtype or length or an id outside ``[0, num_parts)``.
    """
    p = _check_num_parts(num_parts)
    n = graph.num_nodes
    parts = _check_parts(parts, n, p)
    src = graph.indices.detach().cpu()
    dst = graph.dst.detach().cpu()
    num_local = torch.bincount(parts, minlength=p)
    num_edges = torch.zeros(p, dtype=torch.int64).index_add_(0, parts, graph.in_degree().detach().cpu())
    dst_part = parts[dst]
    remote = dst_part != parts[src]
    needer, remote_src = dst_part[remote].long(), src[remote].long()   # int64 keys (a compact graph's are int32)
    edge_cut = torch.bincount(needer, minlength=p)
    pairs = torch.unique(needer * n + remote_src)  # distinct (needing part, remote source) pairs
    fetched = pairs % n
    halo = torch.bincount((pairs // n) * p + parts[fetched], minlength=p * p).view(p, p)
    return PartitionStats(num_local, halo.sum(dim=1), num_edges, edge_cut, halo)


# ------------------------------------------------------------------------------------- Partition
_STAT_KEYS = ("num_local", "num_halo", "num_edges", "edge_cut")


@dataclass(frozen=True, eq=False)
class Partition:
    """A vertex partition and its statistics.

    Attributes
    ----------
    parts:
        int64 ``[V]``: the part of every vertex, or ``None`` for a partition restored by
        :meth:`from_dict` without its vertex map (the statistics remain available).
    num_parts:
        ``P``; parts may be empty (see :func:`partition`).
    method:
        The partitioner that made it (one of :data:`PARTITIONERS`, or any name for an assignment
        built elsewhere: ``Partition(parts, P, "mine", partition_stats(graph, parts, P))``).
    stats:
        The :class:`PartitionStats` of ``parts`` on the graph it was computed from; the per-part
        properties below read them.
    """

    parts: Optional[Tensor]
    num_parts: int
    method: str
    stats: PartitionStats

    def __post_init__(self) -> None:
        if self.stats.num_parts != self.num_parts:
            raise GraphError(
                f"Partition: num_parts={self.num_parts} but the statistics have {self.stats.num_parts} parts"
            )
        if self.parts is not None:
            parts = _check_parts(self.parts, self.stats.num_nodes, self.num_parts)
            if not torch.equal(torch.bincount(parts, minlength=self.num_parts), self.stats.num_local):
                raise GraphError("Partition: parts disagree with stats.num_local")
            object.__setattr__(self, "parts", parts)

    # -------------------------------------------------------------- per-part statistics
    @property
    def num_local(self) -> Tensor:
        """int64 ``[P]``: vertices owned by each part."""
        return self.stats.num_local

    @property
    def num_halo(self) -> Tensor:
        """int64 ``[P]``: distinct remote in-neighbors each part fetches (its halo rows)."""
        return self.stats.num_halo

    @property
    def num_edges(self) -> Tensor:
        """int64 ``[P]``: in-edges of each part's owned vertices."""
        return self.stats.num_edges

    @property
    def edge_cut(self) -> Tensor:
        """int64 ``[P]``: in-edges of each part's owned vertices whose source is remote."""
        return self.stats.edge_cut

    @property
    def num_nodes(self) -> int:
        """Vertices of the partitioned graph."""
        return self.stats.num_nodes

    @property
    def total_edges(self) -> int:
        """Edges of the partitioned graph."""
        return self.stats.total_edges

    @property
    def total_edge_cut(self) -> int:
        """Edges whose endpoints are owned by different parts."""
        return self.stats.total_edge_cut

    @property
    def edge_cut_fraction(self) -> float:
        """``total_edge_cut / total_edges`` (0 for a graph without edges)."""
        return self.total_edge_cut / self.total_edges if self.total_edges else 0.0

    @property
    def replication_factor(self) -> float:
        """alpha = ``sum_p (num_local[p] + num_halo[p]) / |V|`` (see :attr:`PartitionStats.replication_factor`)."""
        return self.stats.replication_factor

    def halo_matrix(self) -> Tensor:
        """int64 ``[P, P]``: ``[p, q]`` = distinct vertices owned by ``q`` that ``p`` needs (a copy)."""
        return self.stats.halo_matrix.clone()

    # -------------------------------------------------------------- members
    @cached_property
    def _member_order(self) -> tuple[Tensor, Tensor]:
        """Vertex ids sorted by part (stable, so ascending within a part) and the part offsets."""
        if self.parts is None:
            raise PlanningError(
                "Partition.members: this partition was restored without its vertex map (to_dict(include_parts=False))"
            )
        order = torch.argsort(self.parts, stable=True)
        offsets = torch.zeros(self.num_parts + 1, dtype=torch.int64)
        torch.cumsum(self.num_local, 0, out=offsets[1:])
        return order, offsets

    def members(self, part: int) -> Tensor:
        """int64: the sorted ids of the vertices owned by ``part`` (empty for an empty part)."""
        if isinstance(part, bool) or not isinstance(part, (int, np.integer)) or not 0 <= part < self.num_parts:
            raise PlanningError(f"Partition.members: part {part!r} outside [0, {self.num_parts})")
        order, offsets = self._member_order
        return order[int(offsets[part]):int(offsets[part + 1])]

    # -------------------------------------------------------------- printing
    def table(self) -> str:
        """A per-part table (part, local, halo, edges, cut) followed by the totals and alpha."""
        header = ("part", "local", "halo", "edges", "cut")
        rows = [
            (str(p), *(f"{int(getattr(self.stats, k)[p]):,}" for k in _STAT_KEYS))
            for p in range(self.num_parts)
        ]
        rows.append(("total", *(f"{int(getattr(self.stats, k).sum()):,}" for k in _STAT_KEYS)))
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append(
            f"method={self.method} parts={self.num_parts}: replication factor alpha = "
            f"{self.replication_factor:.4f}, edge cut = {self.total_edge_cut:,} of {self.total_edges:,} "
            f"in-edges ({100 * self.edge_cut_fraction:.2f}%)"
        )
        return "\n".join(lines)

    __str__ = table

    def __repr__(self) -> str:
        return (
            f"Partition(method={self.method!r}, num_parts={self.num_parts}, num_nodes={self.num_nodes:,}, "
            f"alpha={self.replication_factor:.4f}, edge_cut={self.total_edge_cut:,})"
        )

    # -------------------------------------------------------------- serialization
    def to_dict(self, include_parts: bool = True) -> dict[str, Any]:
        """A JSON-serializable dict (plain ints, floats, strings and lists).

        ``replication_factor`` and ``total_edge_cut`` are included for readers of the JSON;
        :meth:`from_dict` recomputes them from the per-part lists. ``include_parts=False`` drops the
        ``O(V)`` vertex map.
        """
        d: dict[str, Any] = {"method": self.method, "num_parts": self.num_parts}
        d.update({k: getattr(self.stats, k).tolist() for k in _STAT_KEYS})
        d["halo_matrix"] = self.stats.halo_matrix.tolist()
        d["replication_factor"] = self.replication_factor
        d["total_edge_cut"] = self.total_edge_cut
        if include_parts and self.parts is not None:
            d["parts"] = self.parts.tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Partition":
        """Rebuild a :class:`Partition` written by :meth:`to_dict` (``parts`` is optional).

        Raises :class:`GraphError` when a key is missing or the lists are inconsistent.
        """
        missing = [k for k in ("method", "num_parts", *_STAT_KEYS, "halo_matrix") if k not in d]
        if missing:
            raise GraphError(f"Partition.from_dict: missing keys {missing}")
        num_parts = _check_num_parts(d["num_parts"])
        try:
            stats = PartitionStats(
                *(torch.tensor(d[k], dtype=torch.int64).reshape(-1) for k in _STAT_KEYS),
                halo_matrix=torch.tensor(d["halo_matrix"], dtype=torch.int64).reshape(num_parts, num_parts),
            )
        except (TypeError, ValueError, RuntimeError) as exc:
            raise GraphError(f"Partition.from_dict: malformed statistics: {exc}") from exc
        parts = None if d.get("parts") is None else torch.tensor(d["parts"], dtype=torch.int64)
        return cls(parts, num_parts, str(d["method"]), stats)


# ------------------------------------------------------------------------------------- partitioners
def _contiguous(num_nodes: int, num_parts: int, weights: Optional[Tensor]) -> Tensor:
    """Consecutive id ranges with (as nearly as possible) equal total weight.

    Vertex ``v`` goes to part ``floor(P * W_<v / W)`` where ``W_<v`` is the weight of the vertices
    before it and ``W`` the total: with unit weights part ``k`` is ``[ceil(k V/P), ceil((k+1) V/P))``.
    """
    if weights is None or int(weights.sum()) == 0:
        prefix, total = torch.arange(num_nodes, dtype=torch.int64), num_nodes
    else:
        prefix = torch.cumsum(weights, 0) - weights  # exclusive prefix sums (indptr[:-1] for in-degrees)
        total = int(weights.sum())
    return torch.div(prefix * num_parts, max(total, 1), rounding_mode="floor").clamp_(max=num_parts - 1)


def _random(num_nodes: int, num_parts: int, seed: int) -> Tensor:
    """A seeded permutation dealt round robin: part sizes differ by at most 1."""
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(num_nodes))
    parts = torch.empty(num_nodes, dtype=torch.int64)
    parts[perm] = torch.arange(num_nodes, dtype=torch.int64) % num_parts
    return parts


def _metis_adjacency(graph: Graph, edge_weights: Optional[Tensor] = None
                     ) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """``(xadj, adjncy, eweights)`` of the symmetrized graph without self loops or parallel edges.

    Without ``edge_weights`` every pair has unit weight (``eweights`` is ``None``). With them the
    weight of an undirected pair ``{u, v}`` is the sum of the weights of all its edges in both
    directions (so both adjacency entries carry the same weight), and pairs of total weight 0 are
    left out: METIS requires positive edge weights, and a zero-weight edge does not change the
    weighted cut it minimizes.
    """
    n = graph.num_nodes
    # int64 keys dst * n + src (a compact graph's indices are int32)
    src, dst = graph.indices.detach().cpu().long(), graph.dst.detach().cpu().long()
    keep = src != dst
    src, dst = src[keep], dst[keep]
    both = torch.cat([dst * n + src, src * n + dst])
    if edge_weights is None:
        keys, eweights = torch.unique(both), None  # sorted by (row, column)
    else:
        w = edge_weights[keep]
        keys, inverse = torch.unique(both, return_inverse=True)
        pair_w = torch.zeros(keys.numel(), dtype=torch.int64).index_add_(0, inverse, torch.cat([w, w]))
        positive = pair_w > 0
        keys, eweights = keys[positive], pair_w[positive].numpy()
    rows = keys // n
    xadj = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(rows, minlength=n), 0, out=xadj[1:])
    return xadj.numpy(), (keys % n).numpy(), eweights


def _fill_empty_parts(parts: Tensor, num_parts: int) -> Tensor:
    """Give every empty part the upper half (by vertex id) of the currently largest part.

    Requires ``num_parts <= len(parts)``, so the largest part has at least two vertices whenever
    a part is empty. Modifies ``parts`` in place and returns it.
    """
    counts = torch.bincount(parts, minlength=num_parts)
    for empty in torch.nonzero(counts == 0).flatten().tolist():
        largest = int(torch.argmax(counts))  # first of equal maxima: deterministic
        members = torch.nonzero(parts == largest).flatten()
        moved = members[members.numel() // 2:]
        parts[moved] = empty
        counts[largest] -= moved.numel()
        counts[empty] = moved.numel()
    return parts


def _fit_index_type(w: np.ndarray, idx: Any) -> np.ndarray:
    """``w`` (non-negative int64) as METIS's integer type ``idx``, scaled down when its total would
    overflow it (METIS sums the weights): divided by a common factor and rounded up, so a positive
    weight stays positive. A no-op with pymetis's usual 64-bit ``idx_t``."""
    limit = np.iinfo(idx).max // 4
    total = int(w.sum(dtype=np.float64)) if w.size else 0
    if total > limit:
        factor = -(-total // limit)
        w = -(-w // factor)
    return w.astype(idx, copy=False)


def _metis(graph: Graph, num_parts: int, seed: int, weights: Optional[Tensor],
           edge_weights: Optional[Tensor] = None) -> Tensor:
    """METIS k-way (weighted) edge-cut partition with every part non-empty (see :func:`partition`)."""
    import pymetis

    idx = pymetis.zero_copy_dtype()
    xadj, adjncy, eweights = _metis_adjacency(graph, edge_weights)
    vweights = None
    if weights is not None:
        # [V, C] row-major is METIS's vwgt layout for C constraints (ncon = len(vwgt) / V)
        vweights = _fit_index_type(weights.reshape(-1).numpy(), idx)
        if weights.dim() == 2 and not bool((weights.sum(dim=0) > 0).all()):
            raise GraphError("vertex_weights: every balance constraint (column) needs a positive total weight")
    result = pymetis.part_graph(
        num_parts,
        pymetis.CSRAdjacency(xadj.astype(idx, copy=False), adjncy.astype(idx, copy=False)),
        vweights=vweights,
        eweights=None if eweights is None else _fit_index_type(eweights, idx),
        options=pymetis.Options(seed=int(seed) % 2**31),  # METIS takes a C int
        recursive=False,
    )
    parts = torch.from_numpy(np.asarray(result.vertex_part, dtype=np.int64))
    return _fill_empty_parts(parts, num_parts)


def partition(
    graph: Graph,
    num_parts: int,
    method: str = "metis",
    *,
    seed: int = 0,
    vertex_weights: Optional[Tensor] = None,
    balance: str = "vertices",
    edge_weights: Optional[Tensor] = None,
    name: Optional[str] = None,
) -> Partition:
    """Partition the vertices of ``graph`` into ``num_parts`` parts and compute the statistics.

    Parameters
    ----------
    graph:
        The graph; edges are read as in-edges (a part needs the sources of its vertices' in-edges).
    num_parts:
        ``P >= 1``. ``P == 1`` puts every vertex in part 0 for every method.
    method:
        ``"contiguous"``, ``"random"`` or ``"metis"`` (see the module docstring).
    seed:
        Seed of ``"random"`` (numpy ``default_rng``) and of METIS's internal randomization
        (``METIS_OPTION_SEED``, a C int: ``seed mod 2^31``); the same seed gives the same partition.
        METIS seeds its C ``rand()`` with the value, and glibc treats seeds 0 and 1 alike, so those
        two give the same result.
        ``"contiguous"`` ignores it.
    vertex_weights:
        Optional non-negative integer ``[V]`` weights to balance instead of vertex counts: passed to
        METIS as ``vwgt``; ``"contiguous"`` cuts the id range into equal weight shares. ``"metis"``
        also takes ``[V, C]`` weights: ``C`` quantities balanced at once (multi-constraint METIS,
        each within its 3% tolerance; every column needs a positive total).
    balance:
        ``"vertices"`` (default) balances vertex counts; ``"edges"`` balances in-edges, i.e. uses
        the in-degrees as ``vertex_weights`` (``"contiguous"`` then cuts at ``indptr``). Weights
        summing to 0 (e.g. a graph without edges) make ``"contiguous"`` balance vertex counts.
    edge_weights:
        ``"metis"`` only: optional non-negative integer ``[E]`` weights, one per edge in the graph's
        CSR order (``graph.indices``), making METIS minimize the weighted cut. The undirected pair
        ``{u, v}`` weighs the sum over its edges in both directions; self loops and pairs of total
        weight 0 are left out of METIS's graph (METIS wants positive weights; they cannot change
        the cut). Weights are integers because METIS's are: scale real weights by a common factor
        first (GSPLIT's ``k_e / N`` times ``N`` gives the integer counts ``k_e`` exactly). Integer
        weights go to METIS as they are (pymetis's ``idx_t`` is 64-bit); were their total to overflow a
        narrower ``idx_t``, they would be divided by a common factor and rounded up (positive stays positive).
    name:
        The :attr:`Partition.method` recorded (default: ``method``), e.g. ``"presampled-metis"``.

    Empty parts
    -----------
    ``"contiguous"`` and ``"random"`` accept ``num_parts > V``: some parts are then empty (and
    edge balancing can leave a part empty when one vertex holds more than a share of the edges).
    ``"metis"`` requires ``num_parts <= V``; METIS itself may still return empty parts on tiny or
    edgeless graphs (it can put a whole small clique in one part), so each empty part is given the
    upper half, by vertex id, of the then-largest part: every METIS part owns at least one vertex.
    The statistics, :meth:`Partition.members` and the table handle empty parts.

    Raises
    ------
    PlanningError
        For an unknown ``method`` or ``balance`` (the message lists the valid names), ``num_parts < 1``,
        ``"metis"`` with more parts than vertices, weights with ``"random"`` (which balances vertex
        counts only), ``edge_weights`` or ``[V, C]`` vertex weights with another method than
        ``"metis"``, or both ``vertex_weights`` and ``balance="edges"``.
    GraphError
        For ``vertex_weights`` or ``edge_weights`` of the wrong shape or dtype, or with a negative
        entry, or ``[V, C]`` weights with a column summing to 0.
    """
    if method not in PARTITIONERS:
        raise PlanningError(f"partition: unknown method {method!r}; valid: {', '.join(map(repr, PARTITIONERS))}")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
        raise PlanningError(f"partition: seed must be an int in [0, 2^63), got {seed!r}")
    num_parts = _check_num_parts(num_parts)
    n = graph.num_nodes
    weights = _resolve_weights(graph, vertex_weights, balance)
    if method == "random" and weights is not None:
        raise PlanningError(
            "partition: 'random' balances vertex counts only; vertex_weights and balance='edges' apply to "
            "'contiguous' and 'metis'"
        )
    if method != "metis" and (edge_weights is not None or (weights is not None and weights.dim() == 2)):
        raise PlanningError(f"partition: edge_weights and [V, C] vertex_weights apply to 'metis' only, not {method!r}")
    eweights = None if edge_weights is None else _check_edge_weights(graph, edge_weights)
    if num_parts == 1:
        parts = torch.zeros(n, dtype=torch.int64)
    elif method == "contiguous":
        parts = _contiguous(n, num_parts, weights)
    elif method == "random":
        parts = _random(n, num_parts, seed)
    else:
        if num_parts > n:
            raise PlanningError(
                f"partition: 'metis' needs at least one vertex per part, got num_parts={num_parts} > "
                f"num_nodes={n}; use 'contiguous' or 'random' to allow empty parts"
            )
        parts = _metis(graph, num_parts, seed, weights, eweights)
    return Partition(parts, num_parts, method if name is None else str(name), partition_stats(graph, parts, num_parts))


@dataclass(frozen=True)
class ReplicationEstimate:
    """A replication factor alpha for planning from statistics, and where it comes from."""

    alpha: float
    source: str

    def __str__(self) -> str:
        return f"alpha={self.alpha:.3f} ({self.source})"


def expected_replication(stats: GraphStats, num_parts: int, method: str = "metis") -> ReplicationEstimate:
    """The replication factor alpha of partitioning a graph known by its statistics into ``num_parts``.

    ``stats.replication`` holds measured values of an edge-cut partitioner (METIS: NeutronTask
    Table 2 for ogbn-papers100M, or :attr:`Partition.replication_factor` of an earlier run).

    1. ``method="random"``: the expectation under a uniform random assignment with every vertex
       of the mean degree ``d``: a vertex is replicated on every other part that owns one of its
       ``d`` out-neighbours, ``alpha = 1 + (P - 1) (1 - (1 - 1/P)^d)``. With skewed degrees the true
       value is lower (the function is concave in ``d``), so this is an upper bound;
    2. ``"metis"``/``"contiguous"``: the measured ``stats.replication[num_parts]``; without it,
       interpolation of the measured values
       at other part counts in ``log P`` when there are two around ``num_parts``; else the random
       bound of 1., reported as such (edge-cut partitioners do better; pass a measured alpha).
    """
    if num_parts < 1:
        raise PlanningError(f"expected_replication: num_parts must be >= 1, got {num_parts}")
    if num_parts == 1:
        return ReplicationEstimate(1.0, "one part")
    d = stats.degree_mean if stats.num_nodes else 0.0
    bound = 1.0 + (num_parts - 1) * (1.0 - (1.0 - 1.0 / num_parts) ** d)
    if method == "random":
        return ReplicationEstimate(bound, f"random-partition expectation at mean degree {d:.1f} (upper bound)")
    measured = {int(k): float(v) for k, v in (stats.replication or {}).items()}
    if num_parts in measured:
        return ReplicationEstimate(measured[num_parts], f"measured for {num_parts} parts ({stats.name})")
    below = [k for k in measured if 1 < k < num_parts]
    above = [k for k in measured if k > num_parts]
    if below and above:
        lo, hi = max(below), min(above)
        w = (math.log(num_parts) - math.log(lo)) / (math.log(hi) - math.log(lo))
        alpha = measured[lo] + w * (measured[hi] - measured[lo])
        return ReplicationEstimate(alpha, f"interpolated from measured alpha at {lo} and {hi} parts")
    return ReplicationEstimate(bound, f"no measured alpha for {num_parts} parts: random-partition bound at mean "
                                      f"degree {d:.1f} ({method} does better; set GraphStats.replication)")
