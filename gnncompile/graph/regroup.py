"""NeutronTask's random regrouping of graph chunks before every epoch (Algorithm 1, §4.2, Fig. 6).

The vertices are cut into ``M`` *base chunks* (contiguous ranges of vertex ids). Before every epoch
the base chunks are shuffled by a permutation that the seed and the epoch decide (so every rank
draws the same one without talking), and their concatenation, the epoch's *vertex order*, is cut
into the plan's ``S`` *subgraphs*: the pipeline's units, of fixed sizes so that every message of
the plan keeps its shape. Each subgraph is about ``k = M / S`` base chunks (NeutronTask's
``Chunk_Shuffle``; a cut may fall up to a few vertices inside a base chunk when ``S`` does not
divide the vertex count like ``M`` does).

The pipeline runs subgraphs ``0, 1, ..., S - 1`` in that order. A subgraph's propagation reads its
own rows and those of the earlier subgraphs (computed already; NeutronTask reuses them from its
cache) and *skips* its in-edges from later subgraphs, which are not computed yet: the pipeline never
waits (Algorithm 1, lines 9-16). Which edges are skipped changes every epoch. An edge inside a base
chunk is always kept; an edge between two base chunks is kept when both land in one subgraph or its
source's subgraph comes first: with probability ``(k - 1) / (M - 1) + (1 - (k - 1) / (M - 1)) / 2``
per epoch (:meth:`ChunkRegrouping.keep_probability`), so over the epochs every edge is trained.

GNNPipe's *chunk shuffling* (§3.4) is the same permutation with ``reads="all"``: the subgraphs are
the chunks of a layer pipeline (``base_order`` may list the vertices chunk by chunk, e.g. METIS
parts), and a subgraph's propagation reads *every* in-edge, the later subgraphs' rows from the
historical embeddings the runtime keeps per vertex, with the whole graph's coefficients; the
shuffled order only decides which neighbours are fresh and which historical in an epoch. The slots
keep the plan's fixed sizes, so with chunks of unequal sizes (METIS parts) a slot's cut falls a few
vertices inside the next chunk of the epoch's order.

An epoch (``reads="earlier"``) thus trains the model on the graph of its kept edges (:meth:`ChunkRegrouping.kept_edges`),
normalized as the model normalizes any graph: degrees count the kept edges. NeutronTask says it
follows ClusterGCN, which normalizes each subgraph's adjacency; keeping the whole graph's
coefficients instead shrinks every training aggregation against evaluation's (which reads every
edge): measured on 4 ranks, 4 subgraphs, 200 epochs, one seed, GCN reached 2.0-3.4 points below
single-device training on Cora (1, 2 or 4 chunks per subgraph) and 1.2 on coauthor_physics, against
-0.5..+0.5 on Cora with renormalization (``benchmarks/RESULTS.md``, "Task strategy", has the
renormalized plans over two seeds).

:class:`ChunkRegrouping` is the rank-independent part (the graph, the cuts, the seed);
:class:`RegroupedInputs` one rank's per-epoch model inputs (its subgraphs' graph slices, feature
rows and dropout positions, and the rows it scores). The ``task`` strategy's
``dependencies="regrouped"`` builds them (:mod:`gnncompile.passes.task`); the executor asks for the
epoch's inputs before every training step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import GraphError
from .core import Graph
from .core import NormScales
from .shard import LocalGraph, chunk_edges, chunk_subgraph, dropout_positions, propagation_scales, slice_rows

__all__ = ["ChunkRegrouping", "RegroupedInputs", "EpochInputs"]

#: what a model input of a subgraph is: its graph slice, its feature rows, or the positions of its
#: entries in a replicated dropout mask over a space (``V``, ``E``, ``E+V``, ``nnz``)
INPUT_KINDS = ("graph", "features", "V", "E", "E+V", "nnz")


@dataclass
class ChunkRegrouping:
    """The base chunks, the subgraph cuts and the seed of a regrouped chunk pipeline (module docstring).

    ``base_bounds``: base chunk ``c`` is positions ``[base_bounds[c], base_bounds[c + 1])`` of
    ``base_order`` (vertex ids; ``None``: the identity); ``bounds``: subgraph ``j`` is positions
    ``[bounds[j], bounds[j + 1])`` of the epoch's vertex order; ``norms``: the ``(norm,
    add_self_loops)`` pairs of the model's propagations, whose coefficients each epoch computes over
    its kept edges (:meth:`scales`); ``reads``: ``"earlier"`` (a subgraph reads subgraphs
    ``0..j`` and skips the later ones: NeutronTask) or ``"all"`` (every in-edge, the later subgraphs
    from historical embeddings: GNNPipe's chunk shuffling).
    """

    graph: Graph
    base_bounds: tuple[int, ...]
    bounds: tuple[int, ...]
    seed: int = 0
    norms: tuple[tuple[str, bool], ...] = ()
    base_order: Optional[torch.Tensor] = field(default=None, compare=False)
    reads: str = "earlier"

    def __post_init__(self) -> None:
        n = self.graph.num_nodes
        for name, b in (("base_bounds", self.base_bounds), ("bounds", self.bounds)):
            if len(b) < 2 or b[0] != 0 or b[-1] != n or any(x > y for x, y in zip(b, b[1:])):
                raise GraphError(f"regrouping: {name} must rise from 0 to the {n} vertices, got {b}")
        if self.num_base_chunks < self.num_subgraphs:
            raise GraphError(f"regrouping: {self.num_base_chunks} base chunks cannot form {self.num_subgraphs} "
                             "subgraphs")
        if self.reads not in ("earlier", "all"):
            raise GraphError(f"regrouping: reads must be 'earlier' or 'all', got {self.reads!r}")
        if self.base_order is not None and tuple(self.base_order.shape) != (n,):
            raise GraphError(f"regrouping: base_order must list the {n} vertices, got shape "
                             f"{tuple(self.base_order.shape)}")

    @property
    def num_base_chunks(self) -> int:
        return len(self.base_bounds) - 1

    @property
    def num_subgraphs(self) -> int:
        return len(self.bounds) - 1

    def chunk_order(self, epoch: int) -> torch.Tensor:
        """The shuffled base chunks of ``epoch`` (the same on every rank)."""
        gen = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + int(epoch))
        return torch.randperm(self.num_base_chunks, generator=gen)

    def order(self, epoch: int) -> torch.Tensor:
        """Position -> vertex id in ``epoch``: the shuffled base chunks, concatenated."""
        b = self.base_bounds
        if self.base_order is not None:
            return torch.cat([self.base_order[b[c]:b[c + 1]] for c in self.chunk_order(epoch).tolist()])
        return torch.cat([torch.arange(b[c], b[c + 1]) for c in self.chunk_order(epoch).tolist()])

    def subgraph(self, order: torch.Tensor, j: int, scales: Optional[dict[tuple[str, bool], NormScales]] = None
                 ) -> tuple[LocalGraph, torch.Tensor]:
        """Subgraph ``j`` of the vertex order ``order``: its vertices, their in-edges from subgraphs
        ``0..j`` (every subgraph when :attr:`reads` is ``"all"``; sources numbered in that order),
        and those edges' ids in the whole graph.
        ``scales``: the normalization scales by the whole graph's vertex ids
        (default: ``scales(order)``, computed again on every call)."""
        scales = scales if scales is not None else self.scales(order)
        return chunk_subgraph(self.graph, self.bounds, j, self._reads(j), scales, order)

    def _reads(self, j: int) -> range:
        return range(self.num_subgraphs) if self.reads == "all" else range(j + 1)

    def scales(self, order: Optional[torch.Tensor]) -> dict[tuple[str, bool], NormScales]:
        """The normalization scales of the propagations (:attr:`norms`) in an epoch's vertex
        ``order``, by the whole graph's vertex ids: those of the graph of the epoch's kept edges
        (their degrees); ``order=None`` or :attr:`reads` ``"all"``: the whole graph's."""
        g = self.graph
        if order is None or self.reads == "all":
            return propagation_scales(g, self.norms)
        kept = self._kept(order)
        indptr = torch.zeros(g.num_nodes + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(g.dst.cpu()[kept], minlength=g.num_nodes), 0, out=indptr[1:])
        epoch_graph = Graph(indptr, g.indices.cpu()[kept], g.num_nodes, validate=False,
                            edge_weight=None if g.edge_weight is None else g.edge_weight.cpu()[kept])
        return propagation_scales(epoch_graph, self.norms)

    def kept_edges(self, epoch: int) -> torch.Tensor:
        """Which edges of the whole graph ``epoch`` trains (bool per edge, CSR order)."""
        if self.reads == "all":
            return torch.ones(self.graph.num_edges, dtype=torch.bool)
        return self._kept(self.order(epoch))

    def _kept(self, order: torch.Tensor) -> torch.Tensor:
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel())
        unit = torch.searchsorted(torch.as_tensor(self.bounds), position, right=True) - 1
        return unit[self.graph.indices.cpu()] <= unit[self.graph.dst.cpu()]

    def keep_probability(self) -> float:
        """The probability that an edge between two base chunks is trained in an epoch, when the
        subgraphs are exactly ``k = M / S`` base chunks (module docstring; 1 when :attr:`reads`
        is ``"all"``)."""
        if self.reads == "all":
            return 1.0
        m, k = self.num_base_chunks, self.num_base_chunks / self.num_subgraphs
        if m == 1:
            return 1.0
        same = (k - 1) / (m - 1)
        return same + (1 - same) / 2


@dataclass
class EpochInputs:
    """One rank's training inputs in one epoch: per subgraph ``{name: value}`` (looked up like
    ``RankProgram.chunk_inputs``); for a rank that scores rows, the vertices it scores (``owned``,
    in subgraph order), where each subgraph's rows start among them (``offsets``, like
    ``StepInputs.chunk_offsets``) and their labels and training mask (``None`` on other ranks);
    ``sizes``: the epoch's values of the plan's per-step sizes (none: the subgraphs keep fixed
    sizes); ``slots``: the vertex ids of every subgraph in this epoch (where the runtime's
    per-vertex historical embeddings of a subgraph's rows are)."""

    chunk_inputs: dict[int, dict[str, Any]]
    owned: Optional[torch.Tensor] = None
    offsets: Optional[tuple[int, ...]] = None
    labels: Optional[torch.Tensor] = None
    train_mask: Optional[torch.Tensor] = None
    sizes: dict[str, int] = field(default_factory=dict)
    slots: Optional[tuple[torch.Tensor, ...]] = None


@dataclass
class RegroupedInputs:
    """One rank's per-epoch model inputs under a :class:`ChunkRegrouping`.

    ``needs``: subgraph -> ``{input name: kind}`` (:data:`INPUT_KINDS`) that the rank's stages read;
    ``scored``: the subgraphs whose output rows the rank scores (its loss rows; empty for a rank
    without the model's output). The graph a rank's regrouping carries holds only what these need
    (:meth:`for_rank`).
    """

    regrouping: ChunkRegrouping
    needs: dict[int, dict[str, str]]
    scored: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for j, per in self.needs.items():
            if not 0 <= j < self.regrouping.num_subgraphs:
                raise GraphError(f"regrouped inputs: subgraph {j} of {self.regrouping.num_subgraphs}")
            bad = sorted(k for k in per.values() if k not in INPUT_KINDS)
            if bad:
                raise GraphError(f"regrouped inputs: unknown input kind(s) {bad}; valid: {', '.join(INPUT_KINDS)}")

    @classmethod
    def for_rank(cls, regrouping: ChunkRegrouping, needs: dict[int, dict[str, str]],
                 scored: tuple[int, ...] = ()) -> "RegroupedInputs":
        """A rank's inputs, its copy of the graph stripped of what its stages never read (features
        unless a stage reads them, labels and masks unless it scores rows, normalizations unless it
        reads graph slices), so that a plan does not ship the whole graph to every rank."""
        kinds = {k for per in needs.values() for k in per.values()}
        g = regrouping.graph
        keep_x = "features" in kinds or "nnz" in kinds
        keep_rows = bool(scored)
        graph = Graph(g.indptr, g.indices, g.num_nodes, edge_weight=g.edge_weight, x=g.x if keep_x else None,
                      y=g.y if keep_rows else None, train_mask=g.train_mask if keep_rows else None,
                      num_classes=g._num_classes, name=g.name, validate=False)
        coef = "graph" in kinds
        return cls(ChunkRegrouping(graph, regrouping.base_bounds, regrouping.bounds, regrouping.seed,
                                   regrouping.norms if coef else (), regrouping.base_order, regrouping.reads),
                   needs, tuple(scored))

    def epoch(self, epoch: int, device: Optional[torch.device] = None) -> EpochInputs:
        """The inputs of ``epoch`` (on ``device`` when given)."""
        rg = self.regrouping
        order = rg.order(epoch)
        b = rg.bounds
        out: dict[int, dict[str, Any]] = {}
        graphs = any(k == "graph" for per in self.needs.values() for k in per.values())
        scales = rg.scales(order) if graphs else None
        for j, per in sorted(self.needs.items()):
            ids = order[b[j]:b[j + 1]]
            d: dict[str, Any] = {}
            sub: Optional[LocalGraph] = None
            eids: Optional[torch.Tensor] = None
            for name, kind in per.items():
                if kind == "graph" and sub is None:
                    sub, eids = rg.subgraph(order, j, scales)
                elif kind in ("E", "E+V") and eids is None:  # the edge ids alone: no graph slice
                    eids = chunk_edges(rg.graph, b, j, rg._reads(j), order)
                if kind == "graph":
                    d[name] = sub
                elif kind == "features":
                    d[name] = slice_rows(rg.graph.x, ids) if rg.graph.x is not None else None
                else:
                    d[name] = dropout_positions(kind, rg.graph, ids, eids)
            out[j] = d
        if device is not None and device.type != "cpu":
            out = {j: {k: v.to(device) if hasattr(v, "to") else v for k, v in d.items()} for j, d in out.items()}
        slots = tuple(order[b[j]:b[j + 1]] for j in range(rg.num_subgraphs))
        if device is not None and device.type != "cpu":
            slots = tuple(s.to(device) for s in slots)
        if not self.scored:
            return EpochInputs(out, slots=slots)
        per_subgraph = [order[b[j]:b[j + 1]] if j in self.scored else order[:0] for j in range(rg.num_subgraphs)]
        owned = torch.cat(per_subgraph)
        offsets = [0]
        for ids in per_subgraph:
            offsets.append(offsets[-1] + int(ids.numel()))

        def rows(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else (t[owned] if device is None else t[owned].to(device))
        return EpochInputs(out, owned, tuple(offsets), rows(rg.graph.y), rows(rg.graph.train_mask), slots=slots)
