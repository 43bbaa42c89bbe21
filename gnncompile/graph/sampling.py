"""Multi-layer neighbour sampling: per-layer bipartite blocks for mini-batch training.

:func:`sample_blocks` draws, for a batch of seed vertices and one fanout per GNN layer, the
computation graph of a sampled mini-batch as a list of blocks, input layer first. Block ``i`` is a
:class:`~gnncompile.graph.shard.LocalGraph` in CSR by destination whose destinations are the first
``num_nodes`` rows of its sources (``own_offset=0``, the DGL/PyG block convention), so every kernel
that runs on a rank's local graph runs on a block unchanged. Block ``i``'s destinations are block
``i + 1``'s sources; the last block's destinations are the seeds.

Sampling is uniform without replacement over each destination's in-edge *positions* (so parallel
edges are distinct candidates), independently per destination and layer; a destination whose
in-degree is at most the fanout keeps all its in-edges. It is vectorized over destinations (no
Python loop over vertices), runs on the graph's device and is reproducible from a
``torch.Generator`` or an integer seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch

from ..errors import ArgumentError, GraphError
from .core import Graph, NormScales
from .shard import LocalGraph, segment_ranges

__all__ = ["SampledBatch", "parse_fanouts", "sample_blocks", "sample_in_edges"]


@dataclass
class SampledBatch:
    """A sampled mini-batch: its blocks and the global ids behind their local rows.

    ``blocks[i]`` is GNN layer ``i``'s graph (input layer first). ``src_ids[i]`` holds the global
    vertex ids of block ``i``'s sources (its destinations are the first ``blocks[i].num_nodes`` of
    them), ``edge_ids[i]`` the global edge id of every block edge, in block edge order.
    """

    blocks: list[LocalGraph]
    src_ids: list[torch.Tensor]
    edge_ids: list[torch.Tensor]

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def input_ids(self) -> torch.Tensor:
        """Global ids of the first block's sources: the vertices whose features the batch loads."""
        return self.src_ids[0]

    @property
    def seed_ids(self) -> torch.Tensor:
        """Global ids of the last block's destinations: the seeds, in the order given."""
        return self.dst_ids(self.num_layers - 1)

    def dst_ids(self, layer: int) -> torch.Tensor:
        """Global ids of block ``layer``'s destinations (block ``layer + 1``'s sources)."""
        return self.src_ids[layer][: self.blocks[layer].num_nodes]

    def sizes(self) -> list[tuple[int, int, int]]:
        """``(destinations, sources, edges)`` of every block, input layer first."""
        return [(b.num_nodes, b.num_src, b.num_edges) for b in self.blocks]

    def to(self, device: torch.device | str) -> "SampledBatch":
        """A copy with every block and id tensor on ``device``."""
        return SampledBatch([b.to(device) for b in self.blocks], [t.to(device) for t in self.src_ids],
                            [t.to(device) for t in self.edge_ids])

    def __repr__(self) -> str:
        layers = ", ".join(f"{d}<-{s} ({e} edges)" for d, s, e in self.sizes())
        return f"SampledBatch(seeds={self.blocks[-1].num_nodes if self.blocks else 0}, blocks=[{layers}])"


def sample_blocks(graph: Graph, seeds: Any, fanouts: Sequence[int], *,
                  generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                  norms: Iterable[tuple[str, bool]] = ()) -> SampledBatch:
    """Sample the blocks of a mini-batch rooted at ``seeds``.

    ``seeds``: distinct vertex ids (int tensor, array or sequence) or a bool mask over the
    vertices; they become the last block's destinations in that order. ``fanouts[i]``: the number
    of in-edges each destination of GNN layer ``i`` keeps (input layer first, as DGL's
    ``MultiLayerNeighborSampler``; ``-1``: all). Randomness comes from ``generator`` (on the
    graph's device), or from a fresh generator seeded with ``seed``, or else torch's default
    generator. ``norms``: the ``(norm, add_self_loops)`` pairs the model propagates with; each
    block gets their coefficients computed from its *own* sampled degrees (``gcn``: in-degree of
    the destination and out-degree of the source within the block, with the destinations' self
    loops when asked; ``mean``: 1 / sampled in-degree), as PyG normalizes on a sampled subgraph.
    Edge weights, if any, are carried over and weight the degrees.
    """
    fanouts = _check_fanouts(fanouts)
    if graph.num_src != graph.num_nodes:
        raise GraphError(f"sample_blocks: graph {graph.name!r} has {graph.num_src} sources but {graph.num_nodes} "
                         "destinations; sample from a whole graph, not a rank's local graph")
    device = graph.device
    dst = _check_seeds(seeds, graph.num_nodes, device)
    gen = _generator(generator, seed, device)
    norms = sorted(set(norms))

    blocks: list[LocalGraph] = []
    src_ids: list[torch.Tensor] = []
    edge_ids: list[torch.Tensor] = []
    for layer in reversed(range(len(fanouts))):
        counts, eids = sample_in_edges(graph, dst, fanouts[layer], generator=gen)
        src, local_src = _relabel(graph.indices.index_select(0, eids), dst, graph.num_nodes)
        indptr = torch.zeros(dst.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(counts, 0, out=indptr[1:])
        weight = None if graph.edge_weight is None else graph.edge_weight.index_select(0, eids)
        block = LocalGraph(indptr, local_src, dst.numel(), src.numel(), edge_weight=weight,
                           name=f"{graph.name}[block {layer}]")
        block._scales = _block_scales(block, norms)
        blocks.append(block)
        src_ids.append(src)
        edge_ids.append(eids)
        dst = src
    return SampledBatch(blocks[::-1], src_ids[::-1], edge_ids[::-1])


def sample_in_edges(graph: Graph, dst: torch.Tensor, fanout: int, *,
                    generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of sampling: up to ``fanout`` in-edges of every vertex of ``dst``, uniformly
    without replacement (``-1``: all of them).

    Returns ``(counts, edge_ids)``: ``counts[j] = min(in_degree(dst[j]), fanout)`` and the kept
    edges' ids in ``graph``, grouped by destination in the order of ``dst``, ascending within a
    destination. ``dst`` must be int64 ids on the graph's device (not checked here).
    """
    # index_select, index_fill_ and index_copy_ rather than [] indexing: several times faster on CPU
    indptr = graph.indptr
    start = indptr.index_select(0, dst)
    deg = indptr.index_select(0, dst + 1) - start
    if fanout == -1:
        return deg, segment_ranges(start, deg)
    counts = deg.clamp_max(fanout)
    # rows keeping everything are filled here; rows with more in-edges than the fanout are overwritten
    eids = segment_ranges(start, counts)
    big = torch.nonzero(deg > fanout).flatten()
    if big.numel():
        offsets = torch.cumsum(counts, 0) - counts
        picked = _sample_without_replacement(deg.index_select(0, big), fanout, generator).sort(dim=1).values
        slots = offsets.index_select(0, big).unsqueeze(1) + torch.arange(fanout, device=dst.device)
        eids.index_copy_(0, slots.reshape(-1), (start.index_select(0, big).unsqueeze(1) + picked).reshape(-1))
    return counts, eids


def _sample_without_replacement(n: torch.Tensor, k: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``[len(n), k]``: row ``r`` is a uniform random ``k``-subset of ``range(n[r])`` (``n >= k``).

    Robert Floyd's algorithm, vectorized over rows: for ``j = n - k, ..., n - 1`` draw ``t``
    uniform in ``[0, j]`` and take ``t`` unless already taken, else ``j``. Work is ``O(k^2)`` per
    row, independent of ``n`` (hubs cost no more than small rows).
    """
    rows = n.numel()
    j = (n - k).unsqueeze(1) + torch.arange(k, device=n.device)
    # float64 uniforms: exact enough for degrees far beyond 2^31 without a modulo bias
    u = torch.rand(rows, k, dtype=torch.float64, device=n.device, generator=generator)
    out = torch.minimum((u * (j + 1).to(torch.float64)).to(torch.int64), j)  # the draws t, column i in [0, j_i]
    for i in range(1, k):
        taken = (out[:, :i] == out[:, i:i + 1]).any(dim=1)
        out[:, i] = torch.where(taken, j[:, i], out[:, i])
    return out


def _relabel(src_global: torch.Tensor, dst: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's sources (``dst`` first, then the other sources by ascending global id) and each
    edge's source in those local ids. ``O(num_nodes + edges)``, no sort."""
    device = dst.device
    is_new = torch.zeros(num_nodes, dtype=torch.bool, device=device)
    is_new.index_fill_(0, src_global, True)
    is_new.index_fill_(0, dst, False)
    new = torch.nonzero(is_new).flatten()
    local = torch.empty(num_nodes, dtype=torch.int64, device=device)
    local.index_copy_(0, dst, torch.arange(dst.numel(), device=device))
    local.index_copy_(0, new, torch.arange(dst.numel(), dst.numel() + new.numel(), device=device))
    return torch.cat([dst, new]), local.index_select(0, src_global)


def _block_scales(block: LocalGraph, norms: Sequence[tuple[str, bool]]) -> dict[tuple[str, bool], NormScales]:
    """A block's normalization scales from its own degrees, by the whole-graph formulas of
    :class:`Graph` (:meth:`Graph.norm_scales`): in-degrees of its destinations, out-degrees of its
    sources, and with self loops a loop for each destination (the first sources)."""
    # the base-class formula: LocalGraph's own method only looks up precomputed scales
    return {(nm, bool(loops)): Graph._norm_scales(block, nm, bool(loops)) for nm, loops in norms
            if nm in ("gcn", "mean")}


def parse_fanouts(value: Any, what: str = "fanouts") -> tuple[int, ...]:
    """``value`` as fanouts: sampled in-edges per destination, one per GNN layer, input layer first,
    each >= 1 or -1 (all in-edges). Takes a sequence of ints (whole numbers: 3.0, not 3.9) or a
    comma-separated string (``"15,10,5"``). Raises :class:`ArgumentError` naming ``what``."""
    given = value
    if isinstance(value, str):
        entries = value.replace(" ", "").split(",")
        if "" in entries and value.strip():
            raise ArgumentError(f"{what} {value!r}: an empty entry; give numbers separated by commas, e.g. '15,10,5'")
        value = [e for e in entries if e]
    if isinstance(value, (bytes, bytearray, set, frozenset, Mapping)) or not isinstance(value, Iterable):
        raise ArgumentError(f"{what} must be a sequence of ints (one per GNN layer), got {given!r}")
    values = list(value)
    if not values:
        raise ArgumentError(f"{what}: empty; give one fanout per GNN layer, input layer first (-1 keeps all in-edges)")
    out = []
    for i, f in enumerate(values):
        try:
            n = int(f)
            whole = isinstance(f, str) or (not isinstance(f, (bool, np.bool_)) and float(f) == n)
        except (TypeError, ValueError, OverflowError):  # (inf)
            whole = False
        if not whole:   # (3.9 is not silently 3)
            raise ArgumentError(f"{what}[{i}]: expected an int, got {f!r}; {what} must be a sequence of ints (one "
                                f"per GNN layer), got {given!r}")
        if n == 0 or n < -1 or n >= 2**63:
            raise ArgumentError(f"{what}[{i}] = {n}: each fanout is a number of in-edges in [1, 2^63), or -1 for all "
                                f"of them")
        out.append(n)
    return tuple(out)


def _check_fanouts(fanouts: Sequence[int]) -> list[int]:
    try:
        return list(parse_fanouts(fanouts))
    except ArgumentError as e:
        raise GraphError(str(e)) from None


def _check_seeds(seeds: Any, num_nodes: int, device: torch.device) -> torch.Tensor:
    t = seeds if isinstance(seeds, torch.Tensor) else torch.as_tensor(np.asarray(seeds))
    if t.dtype == torch.bool:
        if t.shape != (num_nodes,):
            raise GraphError(f"seeds: a bool mask must have shape [{num_nodes}] (one per vertex), got {list(t.shape)}")
        return torch.nonzero(t.to(device)).flatten()
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    if t.is_floating_point() or t.is_complex():
        raise GraphError(f"seeds: expected integer vertex ids or a bool mask, got dtype {t.dtype}")
    if t.dim() != 1:
        raise GraphError(f"seeds: expected a 1-d tensor of vertex ids, got shape {list(t.shape)}")
    t = t.to(device=device, dtype=torch.int64)
    bad = (t < 0) | (t >= num_nodes)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise GraphError(f"seeds[{i}] = {int(t[i])} is not a vertex id in [0, {num_nodes})")
    uniq, counts = torch.unique(t, return_counts=True)
    if uniq.numel() != t.numel():
        dup = int(uniq[counts > 1][0])
        raise GraphError(f"seeds: vertex {dup} appears {int(counts[uniq == dup][0])} times; seeds must be distinct "
                         "(a block's destinations are distinct vertices)")
    return t


def _generator(generator: Optional[torch.Generator], seed: Optional[int], device: torch.device
               ) -> Optional[torch.Generator]:
    if generator is not None and seed is not None:
        raise GraphError("sample_blocks: give a generator or a seed, not both")
    if seed is not None:
        return torch.Generator(device=device).manual_seed(int(seed))
    if generator is not None and generator.device.type != device.type:
        raise GraphError(f"sample_blocks: the generator is on {generator.device} but the graph is on {device}; "
                         f"make it with torch.Generator(device={str(device)!r})")
    return generator
