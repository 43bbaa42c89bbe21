"""Chunk geometry and group placement: the data of the strategies that stream the graph in chunks.

The shared decisions of the strategies that cut the vertices into chunks: NeutronTP's chunked
feature parallelism (``tensor`` with ``chunks``), MixGCN's mixture of accelerators with its
fine-grain pipeline (``mop``, §3.2.2: a dense group and a sparse group) and NeutronTask's task
placement with its chunk pipeline (``task``, §4.1–4.3: a group per run of tasks) and GNNPipe's
layer pipeline (``layer``: a rank per run of consecutive tasks). A strategy module
decides the stages (:class:`~gnncompile.passes.lower.Decisions` with ``pure_stages``), the
:class:`Placement` (which :class:`Group` runs every stage, and how a group shares a chunk: ``rows``
split, ``cols`` split, or whole ``chunks`` dealt round robin) and the chunking; this module holds

1. the **chunks** (:class:`Chunking`: contiguous ranges of a vertex order, optionally a reordering
   such as reverse Cuthill–McKee) and, for every chunk of destinations, the chunks its in-edges
   read (:func:`chunk_reads`): a propagation's chunk ``j`` waits for exactly those chunks of its
   source value (exact dependencies: nothing is skipped or stale); per stage, which inputs read
   across chunks (:func:`stage_reads`);
2. each chunk's **graph slice** (:func:`chunk_graph`): the chunk's destinations and their
   in-edges, sources renumbered into the order the stage concatenates its source chunks (ascending;
   self loops read the chunk's own rows at its offset), normalization scales of the whole
   graph;
3. the **blocks** a group's member holds and reads of a chunk's value (:func:`held_block`,
   :func:`needed_block`), whose intersections are the point-to-point messages that
   :func:`gnncompile.passes.schedule.insert_messages` adds to the list-scheduled compute: a value
   read by a stage of another group moves, per chunk, as the intersection of the block each
   producer rank holds (its rows, or its columns, of the chunk) with the block each consumer rank
   reads (its rows, every row for a propagation's sources, or its columns): ``SEND v ck [slab] ->q``
   / ``RECV v ck (name[slab]) <-p``. Rows -> columns is the all-to-all of feature parallelism;
   rows -> rows between whole-chunk groups moves each row once;
4. what the **stage pipelines over rank groups** (``task``, ``layer``) share: balanced contiguous
   runs of stages (:func:`contiguous_runs`), the stages' cost-model times (:func:`stage_times`),
   the propagations' cross-chunk source inputs and the refusals they imply
   (:func:`pipeline_sources`), reads from an earlier step's copy (:func:`historical_reads`),
   parameters held per group (:func:`group_parameters`) and each rank's per-chunk step inputs
   (:class:`ChunkInputs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch

from ..cost_models.model import op_time
from ..cost_models.specs import DeviceSpec
from ..errors import PlanningError
from ..graph.core import Graph, GraphStats, NormScales
from ..graph.regroup import ChunkRegrouping, RegroupedInputs
from ..graph.shard import LocalGraph, chunk_edges, chunk_subgraph, dropout_positions, propagation_scales, \
    slice_rows
from ..ir.plan import RankSizes, StageSpec
from ..ir.tpgraph import TPGraph
from .driver import Job
from .lower import Decisions, StagedModel, propagation_norms, source_input, split_stages

__all__ = ["Chunking", "chunk_bounds", "chunk_reads", "chunk_graph", "chunk_edge_ids", "propagation_scales",
           "GROUP_LAYOUTS", "Group", "Placement", "Block", "held_block", "needed_block", "intersect", "slab",
           "stage_groups", "stage_reads", "with_reads", "historical_reads", "contiguous_runs", "stage_times",
           "pipeline_sources", "crossing_values", "PipelineSplit", "split_pipeline", "group_parameters", "ChunkInputs"]


def chunk_bounds(num_nodes: int, num_chunks: int) -> tuple[int, ...]:
    """Boundaries of ``num_chunks`` contiguous chunks of ``num_nodes`` vertices (sizes within one)."""
    if not 1 <= num_chunks <= max(num_nodes, 1):
        raise PlanningError(f"chunks must be in 1..{num_nodes} (the number of vertices), got {num_chunks}")
    sizes = [num_nodes // num_chunks + (1 if q < num_nodes % num_chunks else 0) for q in range(num_chunks)]
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return tuple(out)


def chunk_reads(graph: Graph, bounds: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """For every chunk ``j`` of destinations: the chunks its in-edges' sources lie in, ``j``
    included (its own rows: self loops), in ascending order (chunks reading the same set read the
    same concatenation, which the runtime then builds once per step)."""
    b = torch.as_tensor(list(bounds), dtype=torch.int64)
    indptr, indices = graph.indptr.cpu(), graph.indices.cpu()
    out = []
    for j in range(len(bounds) - 1):
        src = indices[int(indptr[bounds[j]]):int(indptr[bounds[j + 1]])]
        chunks = torch.unique(torch.searchsorted(b, src, right=True) - 1).tolist()
        out.append(tuple(sorted(set(chunks) | {j})))
    return tuple(out)


@dataclass(frozen=True)
class Chunking:
    """Contiguous chunks of a vertex order and what each chunk's propagation reads.

    ``bounds``: chunk ``k`` is positions ``[bounds[k], bounds[k+1])`` of the order; ``order``:
    position -> vertex id (``None``: the identity); ``reads[j]``: the chunks chunk ``j``'s in-edges
    read, ``j`` included, ascending.
    """

    bounds: tuple[int, ...]
    reads: tuple[tuple[int, ...], ...]
    order: Optional[torch.Tensor] = field(default=None, compare=False)

    @property
    def num_chunks(self) -> int:
        return len(self.bounds) - 1

    def size(self, k: int) -> int:
        return self.bounds[k + 1] - self.bounds[k]

    def vertices(self, lo: int, hi: int) -> torch.Tensor:
        """Vertex ids at positions ``[lo, hi)`` of the order."""
        return torch.arange(lo, hi) if self.order is None else self.order[lo:hi]

    def lag(self) -> int:
        """How many chunks ahead a chunk's propagation reads at most (the pipeline's lag)."""
        return max((max(r) - j for j, r in enumerate(self.reads)), default=0)


def chunk_graph(graph: Graph, chunking: Chunking, j: int, scales: dict[tuple[str, bool], NormScales]) -> LocalGraph:
    """Chunk ``j``'s destinations with their in-edges from the chunks ``reads[j]`` (all of them
    unless a relaxed chunking dropped some); sources numbered in ``reads[j]`` order (the chunk's own
    rows at ``own_offset``).

    ``graph`` is in the chunking's vertex order; ``scales`` its normalization scales (what the
    model's propagations use), sliced to the chunk's vertices
    (:func:`~gnncompile.graph.shard.chunk_subgraph`).
    """
    return chunk_subgraph(graph, chunking.bounds, j, chunking.reads[j], scales)[0]


def chunk_edge_ids(graph: Graph, chunking: Chunking, j: int) -> torch.Tensor:
    """Ids in ``graph`` (its own vertex ids, which ``chunking.order`` orders) of the in-edges of chunk
    ``j``'s destinations whose sources lie in ``reads[j]``, in the edge order of chunk ``j``'s graph."""
    return chunk_edges(graph, chunking.bounds, j, chunking.reads[j], chunking.order)


# --------------------------------------------------------------------------- placement
#: How a group's members share a chunk: ``rows`` (each member computes a balanced slice of every
#: chunk's vertices), ``cols`` (each member computes every vertex of every chunk for a slice of the
#: last dimension), ``chunks`` (whole chunks dealt round robin: member ``k mod t`` runs chunk ``k``).
GROUP_LAYOUTS = ("rows", "cols", "chunks")


@dataclass(frozen=True)
class Group:
    """Ranks that run some stages together, and how they share the chunks (:data:`GROUP_LAYOUTS`)."""

    name: str
    members: tuple[int, ...]
    layout: str = "rows"

    def __post_init__(self) -> None:
        if self.layout not in GROUP_LAYOUTS:
            raise PlanningError(f"group {self.name!r}: layout must be one of {GROUP_LAYOUTS}, got {self.layout!r}")
        if not self.members:
            raise PlanningError(f"group {self.name!r} has no ranks")

    def runners(self, k: int) -> tuple[int, ...]:
        """Indices of the members that run chunk ``k``."""
        return (k % len(self.members),) if self.layout == "chunks" else tuple(range(len(self.members)))

    def sub_rows(self, chunking: Chunking, k: int) -> list[tuple[int, int]]:
        """Chunk ``k``'s positions computed by each member (empty where the member does not run it)."""
        lo, hi = chunking.bounds[k], chunking.bounds[k + 1]
        t = len(self.members)
        if self.layout == "cols":
            return [(lo, hi)] * t
        if self.layout == "chunks":
            return [(lo, hi) if i == k % t else (lo, lo) for i in range(t)]
        n = hi - lo
        out = []
        for i in range(t):
            m = n // t + (1 if i < n % t else 0)
            out.append((lo, lo + m))
            lo += m
        return out

    def col_splits(self, width: int) -> list[tuple[int, int]]:
        """Each member's slice of a last dimension of ``width`` (all of it unless ``cols``)."""
        p = len(self.members)
        if self.layout != "cols":
            return [(0, width)] * p
        out, lo = [], 0
        for q in range(p):
            m = width // p + (1 if q < width % p else 0)
            out.append((lo, lo + m))
            lo += m
        return out


@dataclass(frozen=True)
class Placement:
    """Which group runs every stage.

    ``input_group``: the group holding the model's vertex inputs (features), which sends their
    converted copies; ``None``: a rank reading a model input gets its block of it directly.
    """

    groups: tuple[Group, ...]
    stage_group: dict[int, int]
    input_group: Optional[int] = None

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for g in self.groups:
            if seen & set(g.members):
                raise PlanningError(f"group {g.name!r} shares ranks {sorted(seen & set(g.members))} with another group")
            seen |= set(g.members)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for g in self.groups for r in g.members))

    def resource(self, t: Any) -> Any:
        """What task ``t`` (a Forward or Backward) occupies: its group, or the member of a ``chunks``
        group running its chunk."""
        gi = self.stage_group[t.stage]
        g = self.groups[gi]
        return (gi, t.chunk % len(g.members)) if g.layout == "chunks" else gi


#: A block of a chunk's value: positions ``[r0, r1)`` of the vertex order, last-dimension ``[c0, c1)``.
Block = tuple[int, int, int, int]


def held_block(g: Group, i: int, chunking: Chunking, k: int, width: int) -> Optional[Block]:
    """The block of chunk ``k`` that member ``i`` of ``g`` computes (``None``: a ``chunks`` group's
    member that does not run chunk ``k``; a ``rows`` member may hold an empty block)."""
    if i not in g.runners(k):
        return None
    r0, r1 = g.sub_rows(chunking, k)[i]
    c0, c1 = g.col_splits(width)[i]
    return (r0, r1, c0, c1)


def needed_block(g: Group, i: int, chunking: Chunking, k: int, width: int, whole_chunk: bool) -> Block:
    """The block of chunk ``k`` member ``i`` of ``g`` reads: its rows (every row of the chunk for a
    propagation's source side, ``whole_chunk``, and in ``cols`` / ``chunks`` groups) and its columns."""
    if whole_chunk or g.layout != "rows":
        r0, r1 = chunking.bounds[k], chunking.bounds[k + 1]
    else:
        r0, r1 = g.sub_rows(chunking, k)[i]
    c0, c1 = g.col_splits(width)[i]
    return (r0, r1, c0, c1)


def intersect(a: Block, b: Block) -> Block:
    """The overlap of two blocks, clamped to an empty range where they do not overlap (an empty
    block is still a message: the receiver of an empty slice of rows takes part in the exchange)."""
    r0, c0 = max(a[0], b[0]), max(a[2], b[2])
    return (r0, max(r0, min(a[1], b[1])), c0, max(c0, min(a[3], b[3])))


def slab(block: Block, inter: Block) -> tuple[int, int, int]:
    """``inter`` as a ``(dim, start, stop)`` slab of ``block`` (dim 0 rows, 1 the last dimension)."""
    if (inter[2], inter[3]) == (block[2], block[3]):
        return (0, inter[0] - block[0], inter[1] - block[0])
    if (inter[0], inter[1]) == (block[0], block[1]):
        return (1, inter[2] - block[2], inter[3] - block[2])
    raise PlanningError(f"block {inter} of {block} is neither whole rows nor whole columns")


def stage_groups(staged: StagedModel, layout_of: Any) -> dict[int, str]:
    """The layout label (``rows`` / ``cols``) of every stage of a ``pure_stages`` split."""
    groups = {}
    for st in staged.stages:
        lays = {layout_of(op) for op in st.ops if op in staged.stage_of}
        if len(lays) != 1:
            raise PlanningError(f"stage {st.index} mixes layouts {sorted(lays)}; the chunked lowering needs one per "
                                "stage")
        groups[st.index] = lays.pop()
    return groups


def stage_reads(staged: StagedModel, groups: dict[int, str], chunking: Chunking,
                source_inputs: dict[int, set[str]]) -> dict[int, dict[str, tuple[tuple[int, ...], ...]]]:
    """Cross-chunk reads of every ``cols`` stage: the converted source values of its propagations."""
    out: dict[int, dict[str, tuple[tuple[int, ...], ...]]] = {}
    for st in staged.stages:
        if groups[st.index] != "cols":
            continue
        for v in source_inputs.get(st.index, set()):
            out.setdefault(st.index, {})[v] = chunking.reads
    return out


def with_reads(stage: StageSpec, reads: dict[str, tuple[tuple[int, ...], ...]], group: str,
               stale: Optional[dict[str, tuple[tuple[int, ...], ...]]] = None) -> StageSpec:
    """``stage`` carrying its cross-chunk reads (fresh, and stale ones), and its group."""
    from dataclasses import replace

    return replace(stage, reads=tuple(sorted(reads.items())), group=group,
                   stale=tuple(sorted((stale or {}).items())))


# --------------------------------------------------------------------------- stage pipelines over rank groups
def historical_reads(staged: StagedModel, labels: dict[int, str], chunking: Chunking, sources: dict[int, set[str]],
                     model_inputs: set[str]) -> tuple[Chunking, dict[int, dict[str, tuple[tuple[int, ...], ...]]],
                                                      dict[int, dict[str, tuple[tuple[int, ...], ...]]]]:
    """The reads of a pipeline whose propagations take the chunks not computed yet from the previous
    step's copy (relaxed: GNNPipe's historical embeddings, NeutronTask's cached neighbours):
    ``(fresh chunking, reads, stale reads)``. Chunk ``j`` reads the chunks ``<= j`` of ``chunking``'s
    reads fresh (its dependencies) and the later ones stale (no dependency, no gradient); a model
    input (``model_inputs``: there from the start) is read fresh on every chunk."""
    fresh = Chunking(chunking.bounds, tuple(tuple(k for k in r if k <= j) for j, r in enumerate(chunking.reads)),
                     chunking.order)
    later = tuple(tuple(k for k in r if k > j) for j, r in enumerate(chunking.reads))
    exact = stage_reads(staged, labels, chunking, sources)
    stale = {s: {u: later for u in per if u not in model_inputs} for s, per in exact.items()}
    reads = stage_reads(staged, labels, fresh, sources)
    for s, per in exact.items():
        for u, rd in per.items():
            if u not in stale.get(s, {}):
                reads[s][u] = rd
    return fresh, reads, stale


def contiguous_runs(times: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Cut ``times`` (in order) into ``parts`` contiguous non-empty runs ``[a, b)`` minimizing the
    largest sum (exact dynamic program, O(parts n^2))."""
    n = len(times)
    if not 1 <= parts <= n:
        raise PlanningError(f"cannot cut {n} stage(s) into {parts} non-empty runs")
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                v = max(best[p - 1][j], prefix[i] - prefix[j])
                if v < best[p][i]:
                    best[p][i], cut[p][i] = v, j
    out, i = [], n
    for p in range(parts, 0, -1):
        j = cut[p][i]
        out.append((j, i))
        i = j
    return out[::-1]


def stage_times(staged: StagedModel, stats: GraphStats, device: DeviceSpec) -> dict[int, float]:
    """Forward + backward seconds of every stage on the whole graph (the cost model's per-op times;
    NeutronTask Eq. 5–6 for tasks)."""
    sizes = RankSizes(nodes=stats.num_nodes, edges=stats.num_edges, src=stats.num_nodes, all_nodes=stats.num_nodes)
    return {st.index: sum(op_time(op, sizes, device) + op_time(op, sizes, device, backward=True) for op in st.costs)
            for st in staged.stages}


def pipeline_sources(tp: TPGraph, staged: StagedModel, labels: dict[int, str], strategy: str,
                     unit: str = "stage") -> dict[int, set[str]]:
    """Each propagation stage's (``cols`` label) inputs read on the source side (every chunk their
    in-edges reach), after the refusals of a stage pipeline: a propagation reading its source from
    inside its own stage (its other chunks would not be computed yet), an edge value (E-space)
    crossing stages (per-chunk edge sets differ) and a tuple crossing stages (only per-vertex
    tensors move in chunks), all :class:`PlanningError` naming ``strategy`` (and calling a stage
    ``unit``)."""
    nodes = {n.name: n for n in tp.graph.nodes}
    sources: dict[int, set[str]] = {}
    conv = {c.output for c in staged.conversions}
    for st in staged.stages:
        if labels[st.index] == "rows":
            continue
        for op in st.ops:
            src = source_input(nodes[op])
            if src is None:
                continue
            name = f"{src.name}@cols" if f"{src.name}@cols" in conv else src.name
            if name not in st.inputs:
                raise PlanningError(f"strategy {strategy!r}: {op!r} reads {src.name!r} on the source side from inside "
                                    f"its own {unit}; its other chunks would not be computed yet")
            sources.setdefault(st.index, set()).add(name)
    for u, made, read, space in crossing_values(tp, staged):
        info = nodes[u].meta["tp"]
        if space == "-":  # no per-vertex or per-edge rows: a tuple of several values (one op's outputs)
            raise PlanningError(f"strategy {strategy!r}: {u!r} ({info.op or 'an op'}) is a tuple of several values, "
                                f"computed in {unit} {made} and read in {unit} {read}; only tensors with one row "
                                f"per vertex can cross {unit}s (index the tuple where it is computed)")
        raise PlanningError(f"strategy {strategy!r}: {u!r} ({info.space}-space: one value per edge) is "
                            f"computed in {unit} {made} and read in {unit} {read}; edge values "
                            f"cannot cross {unit}s (per-chunk edge sets differ) — e.g. a decoupled GAT; use "
                            "strategy='data'")
    return sources


def crossing_values(tp: TPGraph, staged: StagedModel) -> list[tuple[str, int, int, str]]:
    """The values that are no per-vertex tensor (``V``-space) but cross stages: ``(value, producing
    stage, reading stage, row space)`` — edge values, and tuples (``-``: a recomputed segment's
    outputs before their ``getitem``)."""
    nodes = {n.name: n for n in tp.graph.nodes}
    producer = {o: s.index for s in staged.stages for o in s.outputs}
    out = []
    for st in staged.stages:
        for u in st.inputs:
            node = nodes.get(u)
            info = node.meta.get("tp") if node is not None else None
            if u in producer and info is not None and getattr(info, "space", "V") != "V":
                out.append((u, producer[u], st.index, info.space))
    return out


#: a stage pipeline's split of one model: the staged model, each stage's label (``rows``: T ops,
#: ``cols``: a propagation with its edge ops) and each propagation stage's cross-chunk source inputs
PipelineSplit = tuple[StagedModel, dict[int, str], dict[int, set[str]]]


def split_pipeline(job: Job, decide: Callable[[TPGraph], Decisions], strategy: str,
                   unit: str = "stage") -> tuple[PipelineSplit, PipelineSplit]:
    """The training and evaluation models of ``job`` cut into a stage pipeline's stages by
    ``decide``'s decisions (``pure_stages``): ``(training, evaluation)`` splits. Where the decisions
    sink dense ops (``layer``) and that would leave a tuple crossing stages (a ``getitem`` of a
    recomputed segment's outputs moved to its user's stage), the model is cut without sinking.
    Raises :class:`PlanningError` when the two split into different stages, or through
    :func:`pipeline_sources` and the job's refusal of sparse features a stage cannot take."""
    def cut(tp: TPGraph, sink: bool) -> tuple[Decisions, StagedModel]:
        d = decide(tp)
        d = d if sink else replace(d, sink=False)
        return d, split_stages(tp, d)

    def tuple_crosses(tp: TPGraph, st: StagedModel) -> bool:
        return any(space == "-" for _, _, _, space in crossing_values(tp, st))

    def split(tp: TPGraph, d: Decisions, st: StagedModel) -> PipelineSplit:
        labels = {s: ("rows" if lab == "rows" else "cols") for s, lab in stage_groups(st, d.layout_of).items()}
        return st, labels, pipeline_sources(tp, st, labels, strategy, unit)

    cuts = [cut(job.tp, True), cut(job.tp_eval, True)]
    if any(d.sink for d, _ in cuts) and any(tuple_crosses(tp, st) for tp, (_, st) in zip((job.tp, job.tp_eval), cuts)):
        # sinking moved a getitem of a tuple (a recomputed segment's several outputs,
        # insert_recomputation) to its user's later stage, so the tuple itself would cross stages:
        # keep every op where it is computed instead, in both models (the evaluation model's ops
        # then run where the training model's do, on the ranks holding their parameters)
        cuts = [cut(job.tp, False), cut(job.tp_eval, False)]
    train, evaluation = split(job.tp, *cuts[0]), split(job.tp_eval, *cuts[1])
    if evaluation[1] != train[1]:
        raise PlanningError(f"strategy {strategy!r}: the evaluation model splits into other tasks ({evaluation[1]}) "
                            f"than the training model ({train[1]})")
    job.refuse_sparse_features(train[0])
    return train, evaluation


def group_parameters(job: Job, staged: StagedModel,
                     place: Placement) -> tuple[list[int], list[tuple[tuple[int, ...], int]]]:
    """Parameters live on the group whose stages use them: ``(trainable elements each group holds,
    [(group's ranks, trainable elements)] for the gradient all-reduce inside each group)``.
    Raises :class:`PlanningError` for a parameter used by stages of two groups."""
    by_name = dict(zip(job.param_names, job.params))
    users: dict[str, set[int]] = {}
    for s, names in job.stage_parameters(staged).items():
        for n in names:
            users.setdefault(n, set()).add(place.stage_group[s])
    for n, gs in users.items():
        if len(gs) > 1:
            raise PlanningError(f"strategy {job.strategy!r}: parameter {n!r} is used by stages on different ranks "
                                f"({', '.join(place.groups[g].name for g in sorted(gs))}); shared parameters are not "
                                "supported")
    held = [sum(by_name[n].numel() for n, gs in users.items() if gi in gs and by_name[n].requires_grad)
            for gi in range(len(place.groups))]
    return held, [(g.members, held[gi]) for gi, g in enumerate(place.groups)]


class ChunkInputs:
    """The step inputs of a concrete stage pipeline's ranks: per chunk, the graph slice and the
    blocks of the model inputs its stages read; with a ``regrouping`` (NeutronTask Algorithm 1) the
    training inputs come per epoch (:class:`~gnncompile.graph.regroup.RegroupedInputs`)."""

    def __init__(self, job: Job, staged: StagedModel, staged_eval: StagedModel, chunking: Chunking,
                 regrouping: Optional[ChunkRegrouping] = None, ordered: Optional[Graph] = None) -> None:
        self.job, self.chunking, self.regrouping = job, chunking, regrouping
        #: the graph in the chunking's vertex order (the chunks' graph slices come from it)
        self.ordered = job.graph if ordered is None else ordered
        if chunking.order is not None and ordered is None:
            raise PlanningError("a reordered chunking needs the reordered graph")
        self.scales = propagation_scales(self.ordered, propagation_norms(job.tp, job.tp_eval))
        self.conv_out = {c.output: c.value for c in staged.conversions} | \
            {c.output: c.value for c in staged_eval.conversions}
        self.model_inputs = {"x", *job.dropout_inputs}
        self.graphs: dict[int, Any] = {}

    def block(self, name: str, k: int) -> Any:
        """Chunk ``k``'s block of the model input ``name`` (features or a dropout index), by the
        original vertex ids (the replicated dropout masks are over them)."""
        graph, chunking = self.job.graph, self.chunking
        ids = chunking.vertices(chunking.bounds[k], chunking.bounds[k + 1])
        if name == "x":
            return slice_rows(graph.x, ids) if graph.x is not None else None
        space = self.job.dropout_inputs[name]
        edge_ids = chunk_edge_ids(graph, chunking, k) if space in ("E", "E+V") else None
        return dropout_positions(space, graph, ids, edge_ids)

    def rank(self, stages: tuple, eval_stages: tuple, mine: list[int], scores: bool) -> dict[str, Any]:
        """The step inputs of a rank running ``stages`` on the chunks ``mine`` (``scores``: it computes
        the output, so it holds the labels and masks of its chunks' rows)."""
        job, chunking = self.job, self.chunking
        K = chunking.num_chunks
        chunk_inputs: dict[int, dict[str, Any]] = {}
        regroup = None
        if self.regrouping is not None:
            needs: dict[int, dict[str, str]] = {}
            for st in stages:
                for u in st.inputs:
                    base = self.conv_out.get(u, u)
                    kind = "graph" if u == "g" else "features" if base == "x" else job.dropout_inputs.get(base)
                    for k in mine if kind is not None else ():
                        for m in st.chunks_read(u, k) if st.reads else (k,):
                            needs.setdefault(m, {})[u] = kind
            regroup = RegroupedInputs.for_rank(self.regrouping, needs, tuple(mine) if scores else ())
        for group in (eval_stages,) if regroup is not None else (stages, eval_stages):
            for st in group:
                for u in st.inputs:
                    base = self.conv_out.get(u, u)
                    for k in mine:
                        for m in st.chunks_read(u, k) if st.reads else (k,):
                            d = chunk_inputs.setdefault(m, {})
                            if u == "g":
                                if m not in self.graphs:
                                    self.graphs[m] = chunk_graph(self.ordered, chunking, m, self.scales)
                                d["g"] = self.graphs[m]
                            elif base in self.model_inputs and u not in d:
                                d[u] = self.block(base, m)
        out: dict[str, Any] = dict(inputs={}, chunk_inputs=chunk_inputs, regroup=regroup, halo=((), ()),
                                   owned=torch.zeros(0, dtype=torch.long), labels=None,
                                   masks={"train": None, "val": None, "test": None},
                                   chunk_offsets=(0,) * (K + 1),  # a rank without rows to score: every chunk empty
                                   chunk_rows=tuple(chunking.size(k) for k in range(K)))
        if scores:
            per_chunk = [chunking.vertices(chunking.bounds[k], chunking.bounds[k + 1]) if k in mine
                         else torch.zeros(0, dtype=torch.long) for k in range(K)]
            out.update(job.scored_rows(per_chunk))
        return out
