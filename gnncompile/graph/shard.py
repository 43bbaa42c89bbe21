"""Per-rank shards of a vertex-partitioned graph: local CSR with local + halo ids, exchange lists.

Given a vertex -> part map, rank ``r``'s :class:`Shard` holds

- ``owned``: the global ids of the vertices it owns, ascending; local id ``i`` is ``owned[i]``;
- ``halo``: the global ids of the remote *sources* of its owned vertices' in-edges, ordered by
  owner rank then global id; local id ``len(owned) + j`` is ``halo[j]``;
- ``graph``: a :class:`LocalGraph`: every in-edge of every owned vertex (so destination-side
  reductions such as softmax over in-edges and mean aggregation are complete), with sources in
  local ids. Normalization scales are those of the *global* graph (a halo source's degree is
  its global degree), computed once from the global graph and sliced;
- ``send_index[q]`` / ``recv_count[q]``: the local ids of the rows rank ``q`` needs from this
  rank (in ``q``'s halo order) and the number of halo rows this rank receives from ``q``.

A halo exchange of a rows-layout tensor ``h [n_r, ...]`` is then one all-to-all:
``h[send_index[q]]`` goes to ``q``, and the received blocks concatenated in rank order are the halo
rows ``[n_r, n_r + h_r)``. Its backward sends the halo rows' gradients back and adds them at
``send_index``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from ..errors import GraphError
from .core import Graph, NormScales, _compact_index

__all__ = ["LocalGraph", "Shard", "build_shards", "slice_rows", "global_rows", "row_value_positions", "segment_ranges",
           "propagation_scales"]


class LocalGraph(Graph):
    """A rank's graph: destinations are its own vertices, sources its own then its halo vertices.

    ``num_nodes`` is the number of owned vertices (rows of every V-space tensor on the rank);
    ``num_src`` adds the halo rows (rows of the input of a propagation or ``gather_src``).
    Normalization scales come from the global graph (``scales``: :class:`~.core.NormScales` keyed
    by ``(norm, self_loops)``, sliced to the local destinations and sources), so propagation on the
    local graph computes exactly the global propagation's rows of the owned vertices; ``"sum"`` /
    ``"none"`` need none. Indices are int32 whenever the sources fit (the compact layout).
    ``own_offset``: where the owned vertices' own rows start among the sources (their self loops
    read rows ``own_offset .. own_offset + num_nodes``; 0 for a shard, the chunk's position for a
    graph chunk whose sources are whole chunks in order).
    """

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, num_nodes: int, num_src: int, *,
                 edge_weight: Optional[torch.Tensor] = None,
                 scales: Optional[dict[tuple[str, bool], NormScales]] = None, name: str = "local",
                 own_offset: int = 0, **node_data) -> None:
        super().__init__(indptr, _compact_index(torch.as_tensor(indices), int(num_src)), num_nodes,
                         edge_weight=edge_weight, name=name, validate=False, compact_indices=True, **node_data)
        self._num_src = int(num_src)
        self.own_offset = int(own_offset)
        if not 0 <= self.own_offset <= self._num_src - self.num_nodes:
            raise GraphError(f"local graph {name!r}: own rows at {self.own_offset} do not fit in "
                             f"{self._num_src} sources")
        self._scales = {(nm, bool(loops)): sc for (nm, loops), sc in (scales or {}).items()}

    @property
    def num_src(self) -> int:
        return self._num_src

    def norm_scales(self, norm: str, self_loops: bool = False) -> NormScales:
        try:
            return self._scales[(norm, bool(self_loops))]
        except KeyError:
            if norm in ("sum", "none"):  # degree-free: computed locally
                return super().norm_scales(norm, self_loops)
            what = " with self loops" if self_loops else ""
            have = ", ".join(f"{nm}{' (loops)' if lp else ''}" for nm, lp in sorted(self._scales)) or "none"
            raise GraphError(f"local graph {self.name!r}: no {norm!r} normalization{what} was precomputed for it "
                             f"(have {have}); the lowering computes the norms the model uses") from None

    def _structure_extras(self) -> list:
        return list(self._scales.values())

    def cast_scales(self, dtype: torch.dtype) -> None:
        """Keep the normalization scales in ``dtype`` (the model's): the runtime casts them once,
        so a float32 model holds no float64 copy. Cached values derived from them are dropped."""
        if any(sc.has_dtype_other_than(dtype) for sc in self._scales.values()):
            self._scales = {k: sc.to(dtype) for k, sc in self._scales.items()}
            self._cache = {k: v for k, v in self._cache.items() if not k.startswith("terms:")}
        super().cast_scales(dtype)

    def to(self, device: torch.device | str) -> "LocalGraph":
        """A copy on ``device`` (structure, node data and the precomputed scales)."""
        def mv(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device)
        return LocalGraph(
            mv(self.indptr), mv(self.indices), self.num_nodes, self.num_src, edge_weight=mv(self.edge_weight),
            scales={k: v.to(device) for k, v in self._scales.items()}, name=self.name,
            own_offset=self.own_offset,
            x=mv(self.x), y=mv(self.y), train_mask=mv(self.train_mask), val_mask=mv(self.val_mask),
            test_mask=mv(self.test_mask), num_classes=self._num_classes)

    def __repr__(self) -> str:
        return (f"LocalGraph(name={self.name!r}, owned={self.num_nodes:,}, halo={self.num_src - self.num_nodes:,}, "
                f"edges={self.num_edges:,})")



@dataclass
class Shard:
    """One rank's part of a partitioned graph (see the module docstring)."""

    rank: int
    owned: torch.Tensor
    halo: torch.Tensor
    halo_owner: torch.Tensor
    graph: LocalGraph
    send_index: list[torch.Tensor] = field(default_factory=list)
    recv_count: list[int] = field(default_factory=list)
    #: global edge id of every local edge (in local edge order)
    edge_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    @property
    def num_owned(self) -> int:
        return int(self.owned.numel())

    @property
    def num_halo(self) -> int:
        return int(self.halo.numel())

    @property
    def send_count(self) -> list[int]:
        return [int(t.numel()) for t in self.send_index]


def slice_rows(t: Optional[torch.Tensor], rows: torch.Tensor) -> Optional[torch.Tensor]:
    """Rows ``rows`` of a dense or sparse-CSR tensor, on its device (``None`` stays ``None``)."""
    if t is None:
        return None
    if t.layout == torch.sparse_csr:
        crow, col, val = t.crow_indices(), t.col_indices(), t.values()
        counts = crow[1:] - crow[:-1]
        sel_counts = counts[rows]
        pos = segment_ranges(crow[:-1][rows], sel_counts)
        new_crow = torch.zeros(rows.numel() + 1, dtype=crow.dtype, device=crow.device)
        torch.cumsum(sel_counts, 0, out=new_crow[1:])
        return torch.sparse_csr_tensor(new_crow, col[pos], val[pos], size=(rows.numel(), t.shape[1]),
                                       check_invariants=False)
    return t.index_select(0, rows)


def row_value_positions(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Positions in ``t.values()`` of the stored values of rows ``rows`` of a sparse CSR ``t``."""
    crow = t.crow_indices()
    return segment_ranges(crow[:-1][rows], (crow[1:] - crow[:-1])[rows])


def segment_ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + c)`` for every ``(s, c)``, vectorized, on their device."""
    total = int(counts.sum()) if counts.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=starts.device)
    offsets = torch.cumsum(counts, 0) - counts
    return (torch.repeat_interleave(starts - offsets, counts, output_size=total)
            + torch.arange(total, device=starts.device))


def build_shards(graph: Graph, parts: torch.Tensor, num_parts: int,
                 norms: Iterable[tuple[str, bool]] = (), with_node_data: bool = True) -> list[Shard]:
    """Cut ``graph`` into ``num_parts`` shards by the vertex -> part map ``parts``.

    ``norms`` lists the ``(norm, add_self_loops)`` pairs the model propagates with, whose global
    coefficients are sliced into each local graph. With ``with_node_data`` the local graphs carry
    the owned rows of ``x``, ``y`` and the masks.
    """
    parts = torch.as_tensor(parts, dtype=torch.int64).cpu()
    n = graph.num_nodes
    if parts.shape != (n,):
        raise GraphError(f"parts: expected shape [{n}] (one part per vertex), got {list(parts.shape)}")
    if n and (int(parts.min()) < 0 or int(parts.max()) >= num_parts):
        raise GraphError(f"parts: ids must be in [0, {num_parts}), got range [{int(parts.min())}, {int(parts.max())}]")
    scales = propagation_scales(graph, norms)
    indptr, indices = graph.indptr.cpu(), graph.indices.cpu().to(torch.int64)
    deg = indptr[1:] - indptr[:-1]
    owned_all = [torch.nonzero(parts == r).flatten() for r in range(num_parts)]

    shards: list[Shard] = []
    for r, owned in enumerate(owned_all):
        eids = segment_ranges(indptr[:-1][owned], deg[owned])
        src = indices[eids]
        src_part = parts[src]
        remote = src_part != r
        # halo: distinct remote sources sorted by (owner, global id)
        key = src_part[remote] * max(n, 1) + src[remote]
        halo_key = torch.unique(key)
        halo = halo_key % max(n, 1)
        halo_owner = halo_key // max(n, 1)
        local_src = torch.empty_like(src)
        local_src[~remote] = torch.searchsorted(owned, src[~remote])
        local_src[remote] = owned.numel() + torch.searchsorted(halo_key, key)
        local_indptr = torch.zeros(owned.numel() + 1, dtype=torch.int64)
        torch.cumsum(deg[owned], 0, out=local_indptr[1:])
        node_data = {}
        if with_node_data:
            node_data = dict(x=slice_rows(graph.x, owned), y=slice_rows(graph.y, owned),
                             train_mask=slice_rows(graph.train_mask, owned), val_mask=slice_rows(graph.val_mask, owned),
                             test_mask=slice_rows(graph.test_mask, owned), num_classes=graph.num_classes if graph.y is not None else None)
        lg = LocalGraph(
            local_indptr, local_src, owned.numel(), owned.numel() + halo.numel(),
            edge_weight=None if graph.edge_weight is None else graph.edge_weight.cpu()[eids],
            scales={k: sc.select(owned, torch.cat([owned, halo])) for k, sc in scales.items()},
            name=f"{graph.name}[rank {r}]", **node_data)
        shards.append(Shard(rank=r, owned=owned, halo=halo, halo_owner=halo_owner, graph=lg, edge_ids=eids))

    # exchange lists: rank r sends to q the rows of q's halo that r owns, in q's order
    for q, sq in enumerate(shards):
        counts = torch.bincount(sq.halo_owner, minlength=num_parts)
        sq.recv_count = [int(c) for c in counts]
    for r, sr in enumerate(shards):
        sr.send_index = []
        for q, sq in enumerate(shards):
            need = sq.halo[sq.halo_owner == r]
            sr.send_index.append(torch.searchsorted(sr.owned, need))
    return shards


def global_rows(shards: list[Shard], local: list[torch.Tensor], num_nodes: int) -> torch.Tensor:
    """Reassemble per-rank rows-layout tensors (owned rows, rank order) into the global order."""
    first = local[0]
    out = first.new_zeros((num_nodes,) + tuple(first.shape[1:]))
    for s, t in zip(shards, local):
        out[s.owned] = t
    return out



def dropout_positions(space: str, graph: Graph, rows: torch.Tensor,
                      edge_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Where the dropout-mask entries of ``rows`` (and of the edges ``edge_ids``) sit in a mask over
    the whole graph (replicated dropout: every rank computes these entries of the whole graph's mask).

    ``space``: ``"V"`` one entry per vertex; ``"E"`` one per edge; ``"E+V"`` the edges, then one per
    vertex (the self loops a propagation adds); ``"nnz"`` one per stored value of the sparse
    features ``graph.x``.
    """
    if space == "V":
        return rows
    if space == "nnz":
        return row_value_positions(graph.x, rows)
    if edge_ids is None:
        raise GraphError(f"dropout over {space!r} needs the edge ids of the rows' in-edges")
    if space == "E":
        return edge_ids
    if space == "E+V":
        return torch.cat([edge_ids, graph.num_edges + rows])
    raise GraphError(f"unknown dropout space {space!r} (expected V, E, E+V or nnz)")


def chunk_subgraph(graph: Graph, bounds: Sequence[int], j: int, reads: Sequence[int],
                   scales: Optional[dict[tuple[str, bool], NormScales]] = None,
                   order: Optional[torch.Tensor] = None) -> tuple[LocalGraph, torch.Tensor]:
    """Chunk ``j`` of a vertex order cut at ``bounds``: its destinations, with their in-edges whose
    sources lie in the chunks ``reads`` (ascending, ``j`` included), and those edges' ids in
    ``graph``.

    ``order`` (position -> vertex id; ``None``: the identity) is the vertex order the chunks cut;
    ``graph`` keeps its own vertex ids. Sources are numbered as the concatenation of the chunks
    ``reads`` in that order (the chunk's own rows start at ``own_offset``). ``scales``: the whole
    graph's :func:`propagation_scales`, sliced to the chunk's destinations and sources.
    """
    b = torch.as_tensor(list(bounds), dtype=torch.int64)
    lo, hi = int(b[j]), int(b[j + 1])
    ids, eids, dst, pos, of = _chunk_edges(graph, b, j, reads, order)
    local_start = torch.zeros(len(b) - 1, dtype=torch.int64)
    width = 0
    for k in reads:
        local_start[k] = width
        width += int(b[k + 1] - b[k])
    local_indptr = torch.zeros(hi - lo + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(dst, minlength=hi - lo), 0, out=local_indptr[1:])
    sources = torch.cat([torch.arange(int(b[k]), int(b[k + 1])) for k in reads]) if reads else \
        torch.zeros(0, dtype=torch.int64)
    if order is not None:
        sources = order.cpu()[sources]
    local = LocalGraph(
        local_indptr, local_start[of] + (pos - b[of]), hi - lo, width,
        edge_weight=None if graph.edge_weight is None else graph.edge_weight.cpu()[eids],
        scales={k: sc.select(ids, sources) for k, sc in (scales or {}).items()},
        name=f"{graph.name}[chunk {j}]", own_offset=int(local_start[j]))
    return local, eids


def chunk_edges(graph: Graph, bounds: Sequence[int], j: int, reads: Sequence[int],
                order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ids of the edges :func:`chunk_subgraph` keeps (in its edge order), without building it."""
    return _chunk_edges(graph, torch.as_tensor(list(bounds), dtype=torch.int64), j, reads, order)[1]


def _chunk_edges(graph: Graph, b: torch.Tensor, j: int, reads: Sequence[int], order: Optional[torch.Tensor]
                 ) -> tuple[torch.Tensor, ...]:
    """Chunk ``j``'s vertex ids, and for its kept in-edges: their ids, local destinations, source
    positions in ``order`` and the chunks those lie in."""
    lo, hi = int(b[j]), int(b[j + 1])
    indptr, indices = graph.indptr.cpu(), graph.indices.cpu()
    if order is None:
        ids = torch.arange(lo, hi)
        eids = torch.arange(int(indptr[lo]), int(indptr[hi]))
        counts = indptr[lo + 1:hi + 1] - indptr[lo:hi]
        pos = indices[eids]
    else:
        order = order.cpu()
        ids = order[lo:hi]
        counts = indptr[ids + 1] - indptr[ids]
        eids = segment_ranges(indptr[ids], counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        pos = inverse[indices[eids]]
    of = torch.searchsorted(b, pos, right=True) - 1
    dst = torch.repeat_interleave(torch.arange(hi - lo), counts)
    allowed = torch.zeros(len(b) - 1, dtype=torch.bool)
    allowed[list(reads)] = True
    keep = allowed[of]
    if not bool(keep.all()):
        eids, pos, of, dst = eids[keep], pos[keep], of[keep], dst[keep]
    return ids, eids, dst, pos, of


def propagation_scales(graph: Graph, norms: Iterable[tuple[str, bool]]) -> dict[tuple[str, bool], NormScales]:
    """The whole graph's normalization scales the model's propagations use (``norms``:
    ``(norm, add_self_loops)`` pairs; the degree-free ``"sum"`` and ``"none"`` need none), keyed as
    :class:`LocalGraph` takes them."""
    return {(nm, bool(loops)): graph.norm_scales(nm, bool(loops)).to("cpu") for nm, loops in sorted(set(norms))
            if nm in ("gcn", "mean")}
