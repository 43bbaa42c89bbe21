"""GSPLIT's offline splitting: presampling weights, the weighted partition, and split statistics.

GSPLIT (``../shared/papers/004_*.txt`` §4) splits every sampled mini-batch across ``d`` ranks by
one static vertex -> rank map ``f_G`` computed offline in two stages:

1. **Presampling** (:func:`presample`): run the training sampler for a few epochs and count, for
   every vertex ``v``, ``k_v`` = how many times it is sampled at a layer ``l > 0`` and, for every
   edge ``e``, ``k_e`` = how many times it is sampled (any layer), over ``N`` samples
   (mini-batches). The paper's weights are ``w_V(v) = k_v / N`` and ``w_E(e) = k_e / N``.
2. **Weighted min-edge-cut partitioning** (:func:`presampled_partition`, the paper's Eq. 2):
   METIS minimizing the cut's ``w_E`` while balancing ``w_V``. ``E[X_i] = L_i`` (expected sampled
   vertices at layers ``l > 0`` of split ``i`` = its load) and ``E[Y] = sum_{e in C} w_E(e)``
   (expected cross-split edges of a mini-batch), so the partition solves the mini-batch splitting
   problem (Eq. 1) in expectation.

Online, :func:`split_stats` measures what a split costs on one sampled batch under a vertex ->
part map: per layer and part the destinations computed, the source rows needed and the remote ones
(the per-layer shuffle, with the ``[P, P]`` rows-sent matrix), the edges and the cross-split edges.

Layer convention
----------------
The paper numbers *vertex* layers from the input: layer 0 holds the vertices whose input features
are loaded, layer ``L`` the targets. With our blocks (input first), block ``i``'s sources are layer
``i`` and its destinations layer ``i + 1``; so "sampled at a layer ``l > 0``" means "a destination of
some block", and ``k_v`` counts ``v`` once per block whose destinations contain it (the work of
computing ``v``'s hidden feature at that layer). Input-only appearances (block 0's sources) are
counted separately in :attr:`PresampleWeights.inputs` (the feature-loading load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from ..errors import GraphError, PlanningError
from .core import Graph
from .partition import Partition, _check_num_parts, _check_parts, partition
from .sampling import SampledBatch, _check_fanouts, _check_seeds, sample_blocks

__all__ = ["PresampleWeights", "presample", "presample_batches", "PRESAMPLED_BALANCE", "presampled_partition",
           "SplitStats", "split_stats"]


# ------------------------------------------------------------------------------------- presampling
@dataclass(frozen=True, eq=False)
class PresampleWeights:
    """Sampling counts of a presampling run; int64 CPU tensors.

    Attributes
    ----------
    vertex:
        ``[V]``: ``k_v``, the times ``v`` was a destination of a block (sampled at a layer ``l > 0``,
        see the module docstring), summed over layers and samples.
    edge:
        ``[E]``: ``k_e``, the times edge ``e`` (the graph's CSR edge id, aligned with
        ``graph.indices``) was sampled, summed over layers and samples.
    inputs:
        ``[V]``: the times ``v`` was a source of the input block (its features loaded).
    samples:
        ``N``, the number of mini-batches sampled.
    fanouts, batch_size, epochs:
        The sampling setting that produced the counts.

    The paper's weights are ``k / N`` (:attr:`vertex_weight`, :attr:`edge_weight`); METIS takes
    the integer counts, which are those weights scaled by the common factor ``N`` (exactly, with no
    rounding; the partition's objective and balance are invariant under a common scale).
    """

    vertex: Tensor
    edge: Tensor
    inputs: Tensor
    samples: int
    fanouts: tuple[int, ...]
    batch_size: int
    epochs: int

    def __post_init__(self) -> None:
        for name in ("vertex", "edge", "inputs"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.dim() != 1:
                raise GraphError(f"PresampleWeights.{name}: expected a 1-d int64 tensor, got {t.dtype} {list(t.shape)}")
        if self.inputs.numel() != self.vertex.numel():
            raise GraphError("PresampleWeights: vertex and inputs must have one entry per vertex")

    @property
    def num_nodes(self) -> int:
        return self.vertex.numel()

    @property
    def num_edges(self) -> int:
        return self.edge.numel()

    @property
    def vertex_weight(self) -> Tensor:
        """float64 ``[V]``: ``w_V(v) = k_v / N``, the expected times ``v`` is computed per mini-batch."""
        return self.vertex.to(torch.float64) / max(self.samples, 1)

    @property
    def edge_weight(self) -> Tensor:
        """float64 ``[E]``: ``w_E(e) = k_e / N``, the expected times ``e`` is sampled per mini-batch."""
        return self.edge.to(torch.float64) / max(self.samples, 1)

    def in_edge_load(self, graph: Graph) -> Tensor:
        """int64 ``[V]``: ``sum`` of ``k_e`` over each vertex's in-edges in ``graph`` (the graph
        presampled): the sampled edges it aggregated."""
        if graph.num_edges != self.num_edges or graph.num_nodes != self.num_nodes:
            raise GraphError(f"PresampleWeights.in_edge_load: weights are for {self.num_nodes} vertices and "
                             f"{self.num_edges} edges, the graph has {graph.num_nodes} and {graph.num_edges}")
        return torch.zeros(self.num_nodes, dtype=torch.int64).index_add_(0, graph.dst.detach().cpu(), self.edge)

    def __repr__(self) -> str:
        return (f"PresampleWeights(samples={self.samples}, epochs={self.epochs}, batch_size={self.batch_size}, "
                f"fanouts={list(self.fanouts)}, vertices sampled={int((self.vertex > 0).sum()):,}/{self.num_nodes:,}, "
                f"edges sampled={int((self.edge > 0).sum()):,}/{self.num_edges:,})")


def _check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise GraphError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)


def _targets(graph: Graph, targets: Any) -> Tensor:
    """The target ids (CPU int64): ``targets`` (ids or bool mask), else the train mask, else all vertices."""
    if targets is None:
        targets = graph.train_mask if graph.train_mask is not None else torch.arange(graph.num_nodes)
    return _check_seeds(targets, graph.num_nodes, torch.device("cpu"))


def presample_batches(graph: Graph, fanouts: Sequence[int], batch_size: int, *, epochs: int = 1,
                      targets: Any = None, seed: int = 0) -> Iterator[SampledBatch]:
    """The mini-batches :func:`presample` counts, in order, sampled lazily.

    Each epoch shuffles the targets (``targets``: distinct ids or a bool mask; default
    ``graph.train_mask``, else all vertices) and cuts them into mini-batches of ``batch_size``
    (the last one smaller unless ``batch_size`` divides them), each sampled with
    :func:`~gnncompile.graph.sampling.sample_blocks` and ``fanouts`` (input layer first), on the
    graph's device. A CPU generator seeded with ``seed`` shuffles, one on the graph's device seeded
    with ``seed + 1`` samples, so the sequence is reproducible.

    Raises :class:`GraphError` (when called, before the first batch) for bad fanouts, targets,
    ``batch_size`` or ``epochs``, or a rank's local graph instead of a whole graph.
    """
    fanouts = _check_fanouts(fanouts)
    batch_size = _check_positive_int(batch_size, "batch_size")
    epochs = _check_positive_int(epochs, "epochs")
    if graph.num_src != graph.num_nodes:
        raise GraphError(f"presample: graph {graph.name!r} is a local graph ({graph.num_src} sources, "
                         f"{graph.num_nodes} destinations); presample the whole graph")
    pool = _targets(graph, targets)
    return _batches(graph, pool, fanouts, batch_size, epochs, int(seed))


def _batches(graph: Graph, pool: Tensor, fanouts: list[int], batch_size: int, epochs: int, seed: int
             ) -> Iterator[SampledBatch]:
    device = graph.device
    shuffle_gen = torch.Generator().manual_seed(seed)
    sample_gen = torch.Generator(device=device).manual_seed(seed + 1)
    for _ in range(epochs):
        order = pool[torch.randperm(pool.numel(), generator=shuffle_gen)].to(device)
        for start in range(0, order.numel(), batch_size):
            yield sample_blocks(graph, order[start:start + batch_size], fanouts, generator=sample_gen)


def presample(graph: Graph, fanouts: Sequence[int], batch_size: int, *, epochs: int = 1,
              targets: Any = None, seed: int = 0) -> PresampleWeights:
    """Count how often every vertex and edge is sampled over ``epochs`` epochs of mini-batches.

    The batches are those of :func:`presample_batches` with the same arguments (see there for
    the targets, the epochs and the seeding). ``k_v`` counts ``v`` once per block whose
    destinations contain it (sampled at a layer ``l > 0``), ``k_e`` once per block that samples
    edge ``e``; the counting is vectorized (``index_add_`` per block on the graph's device).
    Raises as :func:`presample_batches`.
    """
    batches = presample_batches(graph, fanouts, batch_size, epochs=epochs, targets=targets, seed=seed)
    device = graph.device
    vertex = torch.zeros(graph.num_nodes, dtype=torch.int64, device=device)
    inputs = torch.zeros(graph.num_nodes, dtype=torch.int64, device=device)
    edge = torch.zeros(graph.num_edges, dtype=torch.int64, device=device)
    samples = 0
    for batch in batches:
        for i in range(batch.num_layers):
            dst = batch.dst_ids(i)
            vertex.index_add_(0, dst, torch.ones_like(dst))
            eids = batch.edge_ids[i]
            edge.index_add_(0, eids, torch.ones_like(eids))
        inputs.index_add_(0, batch.input_ids, torch.ones_like(batch.input_ids))
        samples += 1
    return PresampleWeights(vertex.cpu(), edge.cpu(), inputs.cpu(), samples, tuple(int(f) for f in fanouts),
                            int(batch_size), int(epochs))


#: Valid ``balance`` values of :func:`presampled_partition`.
PRESAMPLED_BALANCE = ("vertices", "edges", "both")


def presampled_partition(graph: Graph, num_parts: int, weights: PresampleWeights, *, edge_weights: bool = True,
                         balance: str = "vertices", seed: int = 0) -> Partition:
    """GSPLIT's global partitioning function: METIS on the presampling-weighted graph (Eq. 2).

    Edge weights are the counts ``k_e`` (the expected cross-split edges of a batch are the
    weighted cut); ``edge_weights=False`` drops them (the paper's *Node* baseline: METIS minimizes
    the plain edge cut). The balanced load (``balance``) is, per vertex:

    * ``"vertices"`` (the paper): ``k_v``, its expected computations at layers ``l > 0``;
    * ``"edges"``: the sum of ``k_e`` over its in-edges, its expected aggregated edges (the measure
      of the paper's Fig. 5);
    * ``"both"``: the two as two METIS constraints.

    Counts are the paper's ``k / N`` scaled by ``N`` (see :func:`partition` for how edge weights are
    symmetrized and zero weights dropped). :attr:`Partition.method` is ``"presampled-metis"``, with
    ``"-vertex"`` appended without edge weights and ``"-<balance>"`` for a balance other than
    ``"vertices"``. A load that is zero everywhere (nothing sampled) falls back to balancing vertex
    counts. Raises :class:`GraphError` when ``weights`` do not match the graph and
    :class:`PlanningError` for a bad ``balance`` or ``num_parts`` (see :func:`partition`).
    """
    if not isinstance(weights, PresampleWeights):
        raise GraphError(f"presampled_partition: expected PresampleWeights (from presample), got "
                         f"{type(weights).__name__}")
    if weights.num_nodes != graph.num_nodes or weights.num_edges != graph.num_edges:
        raise GraphError(f"presampled_partition: weights are for {weights.num_nodes} vertices and {weights.num_edges} "
                         f"edges, the graph has {graph.num_nodes} and {graph.num_edges}")
    if balance not in PRESAMPLED_BALANCE:
        raise PlanningError(f"presampled_partition: unknown balance {balance!r}; valid: "
                            f"{', '.join(map(repr, PRESAMPLED_BALANCE))}")
    columns = []
    if balance in ("vertices", "both"):
        columns.append(weights.vertex)
    if balance in ("edges", "both"):
        columns.append(weights.in_edge_load(graph))
    columns = [c for c in columns if int(c.sum()) > 0]
    vw = None if not columns else columns[0] if len(columns) == 1 else torch.stack(columns, dim=1)
    name = "presampled-metis" + ("" if edge_weights else "-vertex") + ("" if balance == "vertices" else f"-{balance}")
    return partition(graph, num_parts, "metis", seed=seed, vertex_weights=vw,
                     edge_weights=weights.edge if edge_weights else None, name=name)


# ------------------------------------------------------------------------------------- split statistics
def _imbalance(per_part: Tensor) -> float:
    """``max / mean`` of a ``[P]`` tensor (1.0 when the mean is 0)."""
    mean = float(per_part.to(torch.float64).mean()) if per_part.numel() else 0.0
    return float(per_part.max()) / mean if mean > 0 else 1.0


@dataclass(frozen=True, eq=False)
class SplitStats:
    """What splitting one sampled batch by a vertex -> part map costs, per layer and part.

    Every field is an int64 CPU tensor whose first axis is the block (GNN layer, input first).
    Vertex ``v`` of block ``i`` belongs to part ``parts[v]`` at every layer: that part computes its
    hidden feature (or loads its input features, block 0's sources).

    Attributes
    ----------
    dst:
        ``[L, P]``: block ``i``'s destinations owned by part ``p`` (the rows ``p`` computes).
    src:
        ``[L, P]``: distinct source rows part ``p`` needs at block ``i``: its own destinations (the
        first rows, as in a block) and the sources of their sampled in-edges.
    remote:
        ``[L, P]``: those owned by another part: the rows ``p`` receives in layer ``i``'s shuffle.
    owned_src:
        ``[L, P]``: block ``i``'s sources owned by ``p`` (at block 0: the input features ``p`` loads).
    edges:
        ``[L, P]``: block ``i``'s edges whose destination ``p`` owns (the edges ``p`` aggregates).
    cross:
        ``[L, P]``: of those, the edges whose source another part owns (cross-split edges).
    send:
        ``[L, P, P]``: ``send[i, q, p]`` = rows part ``q`` sends to part ``p`` at block ``i``
        (distinct vertices owned by ``q`` that ``p`` needs; zero diagonal); ``send[i].sum(0)`` is
        ``remote[i]``. The backward pass sends the same rows' gradients the other way.
    """

    dst: Tensor
    src: Tensor
    remote: Tensor
    owned_src: Tensor
    edges: Tensor
    cross: Tensor
    send: Tensor

    def __post_init__(self) -> None:
        shape = self.dst.shape
        if len(shape) != 2:
            raise GraphError(f"SplitStats.dst: expected shape [L, P], got {list(shape)}")
        for name in ("src", "remote", "owned_src", "edges", "cross"):
            t = getattr(self, name)
            if t.shape != shape or t.dtype != torch.int64:
                raise GraphError(f"SplitStats.{name}: expected int64 {list(shape)}, got {t.dtype} {list(t.shape)}")
        if self.send.shape != (shape[0], shape[1], shape[1]) or self.send.dtype != torch.int64:
            raise GraphError(f"SplitStats.send: expected int64 [{shape[0]}, {shape[1]}, {shape[1]}], "
                             f"got {self.send.dtype} {list(self.send.shape)}")
        if not torch.equal(self.send.sum(dim=1), self.remote):
            raise GraphError("SplitStats: remote must equal the column sums of send")

    @property
    def num_layers(self) -> int:
        return self.dst.shape[0]

    @property
    def num_parts(self) -> int:
        return self.dst.shape[1]

    def load(self, kind: str = "vertices") -> Tensor:
        """int64 ``[P]``: each part's work summed over layers: ``"vertices"`` computed (sampled
        vertices at layers ``l > 0``, the paper's ``X_i``), ``"edges"`` aggregated, or ``"inputs"``
        (input features loaded)."""
        if kind == "vertices":
            return self.dst.sum(dim=0)
        if kind == "edges":
            return self.edges.sum(dim=0)
        if kind == "inputs":
            return self.owned_src[0].clone()
        raise PlanningError(f"SplitStats.load: unknown kind {kind!r}; valid: 'vertices', 'edges', 'inputs'")

    def imbalance(self, kind: str = "vertices") -> float:
        """``max / mean`` over parts of :meth:`load` (1.0 for a perfectly balanced split)."""
        return _imbalance(self.load(kind))

    def layer_imbalance(self, kind: str = "vertices") -> list[float]:
        """``max / mean`` over parts per block: of ``dst`` (``"vertices"``) or ``edges``."""
        if kind not in ("vertices", "edges"):
            raise PlanningError(f"SplitStats.layer_imbalance: unknown kind {kind!r}; valid: 'vertices', 'edges'")
        t = self.dst if kind == "vertices" else self.edges
        return [_imbalance(row) for row in t]

    @property
    def total_edges(self) -> int:
        return int(self.edges.sum())

    @property
    def total_cross(self) -> int:
        """Cross-split edges of the whole batch (all layers)."""
        return int(self.cross.sum())

    @property
    def cross_ratio(self) -> float:
        """Cross-split edges / edges of the batch (0 for a batch without edges)."""
        return self.total_cross / self.total_edges if self.total_edges else 0.0

    @property
    def shuffle_rows(self) -> Tensor:
        """int64 ``[L]``: rows exchanged in each layer's all-to-all (one direction)."""
        return self.remote.sum(dim=1)

    def table(self) -> str:
        """One row per (layer, part): dst, src, remote, owned src, edges, cross; then the totals."""
        keys = ("dst", "src", "remote", "owned_src", "edges", "cross")
        header = ("layer", "part", *keys)
        rows = [(str(i), str(p), *(f"{int(getattr(self, k)[i, p]):,}" for k in keys))
                for i in range(self.num_layers) for p in range(self.num_parts)]
        widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(header)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append(f"imbalance (max/mean) vertices {self.imbalance():.3f}, edges {self.imbalance('edges'):.3f}; "
                     f"cross-split edges {self.total_cross:,} of {self.total_edges:,} ({100 * self.cross_ratio:.1f}%); "
                     f"shuffled rows per layer {self.shuffle_rows.tolist()}")
        return "\n".join(lines)

    __str__ = table

    def __repr__(self) -> str:
        return (f"SplitStats(layers={self.num_layers}, parts={self.num_parts}, imbalance={self.imbalance():.3f}, "
                f"cross_ratio={self.cross_ratio:.3f})")


def split_stats(batch: SampledBatch, parts: Any, num_parts: int) -> SplitStats:
    """The :class:`SplitStats` of ``batch`` split by ``parts`` (vertex -> part id in ``[0, num_parts)``).

    ``parts`` covers the whole graph the batch was sampled from (a :attr:`Partition.parts`, or any
    integer tensor); it is read on the batch's device. Vectorized per block (gathers, bincounts and
    one ``unique`` over the (part, source) pairs).
    """
    p = _check_num_parts(num_parts)
    t = parts if isinstance(parts, Tensor) else torch.as_tensor(np.asarray(parts))
    if t.dim() != 1:
        raise GraphError(f"parts: expected a 1-d vertex -> part map, got shape {list(t.shape)}")
    # the batch's ids index parts; check the values (and dtype) over the whole map
    parts_cpu = _check_parts(t, t.numel(), p)
    if not batch.blocks:
        raise GraphError("split_stats: the batch has no blocks")
    top = max((int(ids.max()) for ids in batch.src_ids if ids.numel()), default=-1)
    if top >= parts_cpu.numel():
        raise GraphError(f"parts: has {parts_cpu.numel()} entries but the batch samples vertex {top}")
    fields: dict[str, list[Tensor]] = {k: [] for k in ("dst", "src", "remote", "owned_src", "edges", "cross", "send")}
    for i, block in enumerate(batch.blocks):
        device = block.indptr.device
        part_of = parts_cpu.to(device)
        ids = batch.src_ids[i]
        n_dst, n_src = block.num_nodes, block.num_src
        owner = part_of.index_select(0, ids)  # [num_src], owner of every local source row
        dst_owner = owner[:n_dst]
        deg = block.indptr[1:] - block.indptr[:-1]
        edge_owner = torch.repeat_interleave(dst_owner, deg, output_size=block.num_edges)
        src_local = block.indices
        src_owner = owner.index_select(0, src_local)
        is_cross = edge_owner != src_owner
        # distinct (needing part, local source) pairs: the edges' sources and the part's own destinations
        keys = torch.cat([edge_owner * n_src + src_local, dst_owner * n_src + torch.arange(n_dst, device=device)])
        pairs = torch.unique(keys)
        needer, row = pairs // n_src, pairs % n_src
        row_owner = owner.index_select(0, row)
        fields["dst"].append(torch.bincount(dst_owner, minlength=p))
        fields["src"].append(torch.bincount(needer, minlength=p))
        fields["owned_src"].append(torch.bincount(owner, minlength=p))
        fields["edges"].append(torch.bincount(edge_owner, minlength=p))
        fields["cross"].append(torch.bincount(edge_owner[is_cross], minlength=p))
        far = row_owner != needer
        send = torch.bincount(row_owner[far] * p + needer[far], minlength=p * p).view(p, p)
        fields["send"].append(send)
        fields["remote"].append(send.sum(dim=0))
    return SplitStats(**{k: torch.stack(v).cpu() for k, v in fields.items()})
