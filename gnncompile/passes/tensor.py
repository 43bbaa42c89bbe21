"""The ``tensor`` strategy (NeutronTP): T ops on vertex rows, P ops on feature columns; exact.

NeutronTP §3.1–3.2 (tensor parallelism for GNNs): instead of cutting the graph, cut the features.
Every rank holds the whole graph; a P op (propagation) runs on all vertices for a slice of the
feature columns, so it needs no neighbour from another rank; a T op (dense, vertex-wise) runs on
whole feature rows of a block of vertices. Decisions (applied by :mod:`gnncompile.passes.lower`):

- P ops' outputs are in ``cols`` layout: ``[|V|, ..., d_r]``, rank r's slice of the *last*
  dimension (``D`` of a ``[V, D]`` value, ``C`` of GAT's ``[V, H, C]``; widths that do not divide by
  the rank count are split unevenly: the first ``D mod n`` ranks get one more column);
- E ops' outputs (edge-wise ops: attention scores, edge softmax, their dropout) are ``replicated``:
  every rank computes all of them, for every edge (see "Attention" below);
- every other value is in ``rows`` layout: rank r's contiguous block of vertices, ``[n_r, ...]``
  (blocks balanced to within one vertex, in vertex order);
- the vertex input a P op reads needs ``cols`` and a T op reading a P output needs ``rows``: the
  lowering inserts an all-to-all (``A2A v rows->cols``: NeutronTP's *split*; ``cols->rows``: its
  *gather*) whose backward is the inverse all-to-all of the gradient; a vertex value an E op reads
  needs ``replicated``: an all-gather (``AG v``, ``rows -> replicated``) whose backward is a
  sum-reduce-scatter;
- parameters are replicated; one gradient all-reduce per step.

The loss is the sum over the rank's training rows divided by the global count, as for ``data``:
exact. Not supported (refused with :class:`~gnncompile.errors.PlanningError`): an E op's result
read by anything but another E op or a propagation's ``edge_weight`` (GraphSAGE's max aggregation,
edge values in the loss), an E op reading a propagation's output (``cols`` has no conversion to
``replicated``), propagations reading other computed values besides their features and edge
weights, and sparse input features read directly by a propagation or an E op. A model whose output
is a propagation has it gathered back to rows for the loss.

Attention (GAT). ``h = lin(x).view(-1, H, C)`` and the propagation ``propagate(g, h, edge_weight=
alpha)`` run in ``cols`` split along ``C``: every rank keeps every head, so the propagation of its
``C``-slice needs the whole ``alpha`` ``[E', H]`` (``E' = E + V`` with self loops). The scores
``a_src = (h * att_src).sum(-1)`` and ``a_dst`` (``[V, H]``) are T ops on whole rows (``rows``), each
all-gathered to ``replicated``; then every rank runs the E ops (``edge_attention``, or the gathers,
LeakyReLU and ``edge_softmax`` it fuses, and dropout) on all edges and holds the same ``alpha``: a dropout of alpha
uses the whole tensor's mask, drawn from the seed every rank shares (``dropout="replicated"``,
:func:`~gnncompile.passes.data.replicate_dropout_masks`), so the masks agree across ranks and with
single-device training. Backward: rank r's propagation sees only its ``C``-slice, so the gradient
it sends into ``alpha`` is a partial sum over the ranks; the E ops' backward is linear in the
incoming gradient (their forward values are the same on every rank), so the gradients reaching the
replicated ``a_src``/``a_dst`` are partial sums too, and the all-gather's backward, a
sum-reduce-scatter keeping the rank's rows, makes them exact (parameters used by E ops, if any, get
partial gradients that the gradient all-reduce sums likewise).

Why this design (bytes, per GAT layer and rank, ``n`` ranks, ``s`` bytes per element): the
attention costs a forward all-gather of ``a_src`` and ``a_dst``, ``2 (n - 1) / n V H s``, and a
backward reduce-scatter of the same, on top of NeutronTP's split/gather of ``h`` and of the
propagation's output. The alternative, each rank computing ``alpha`` for its vertex block's
in-edges and exchanging edge coefficients, all-gathers ``(n - 1) / n E' H s`` per direction (and
still needs every ``a_src`` row). On ogbn-products (V = 2,449,029, E = 61,859,140, H = 8, float32,
n = 8) that is 137 MB per rank forward for the vertex scores against 1.80 GB for the edge
coefficients (``E' / 2V`` = 13x more); for a hidden width ``H C = 256`` the scores add ``n / C`` =
25% to the 549 MB of the layer's forward split/gather. Splitting the heads instead of ``C`` would
need no score exchange but cannot use more ranks than heads (GAT's output layer has one). The price
is redundant work: every rank runs the E ops on all ``E' H`` scores (a ``1 / C`` fraction of the
propagation's ``E' H C``).

``decouple=True`` (NeutronTP §4.1, generalized decoupling) lowers the ``decouple`` pass's model
instead: every T op first (rows), one conversion, the L propagations back to back (cols), one
conversion back: 4 collectives per step (2 forward, 2 backward) whatever L is. It changes the model
unless the layers are linear, so it is refused under ``semantics="exact"`` then, and recorded as a
relaxation otherwise. Row-mixing T ops
(BatchNorm) are refused under ``semantics="exact"`` as for ``data``.

``chunks=K > 1`` (NeutronTP §4.2, Algorithm 1; :func:`_lower_chunked`): chunk-based task
scheduling and inter-chunk pipelining. The vertices are cut into ``K`` contiguous chunks of
destinations; every rank owns a balanced slice of *every* chunk's rows (NeutronTP distributes each
chunk's vertex tasks over the workers) and every stage runs chunk by chunk; each conversion becomes
one all-to-all per chunk (``A2A h c3 rows->cols``), issued right after the chunk is computed and
waited for by its first reader (the runtime posts all-to-alls asynchronously), and a propagation's
chunk ``j`` runs once the chunks its in-edges read have been split (exact). A chunk's slices cross
once, however many chunks read them (§4.2.2's deduplication, at chunk granularity), so the bytes
per step are the unchunked plan's. Every rank follows one list schedule in which a conversion is
charged a task's time, so another chunk's ready task sits between an all-to-all and its reader:
the transfer overlaps that task (Fig. 9c). Chained propagations (decoupled models, SGC, APPNP) are
stages of their own that read every chunk of the previous propagation. Edge-wise ops (GAT) need
``chunks=1``.

Communication per step: every all-to-all moves ``(n - 1) / n`` of a ``|V| x D`` tensor in each
direction it runs (forward, and backward when the value needs a gradient): NeutronTP's
``2 V D`` per layer (:func:`gnncompile.cost_models.formulas.comm_tensor`), independent of the
graph's structure. Every all-gather (and its backward reduce-scatter) moves
``(n - 1) * V * H * s // n`` bytes per rank (ring convention): a GAT layer adds
``4 (n - 1) / n V H s`` per rank and step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.fx

from ..errors import PlanningError
from ..graph.shard import dropout_positions, slice_rows
from ..frontend.ops import dropout_rows, masked_propagate, propagate
from ..ir.plan import AllGather, AllToAll, Instruction, RankSizes, Schedule, converted_name
from ..ir.tpgraph import TPGraph, TPInfo
from .chunked import Chunking, Group, chunk_bounds, chunk_graph, chunk_reads, propagation_scales, \
    stage_groups, stage_reads, with_reads
from .driver import Job, Lowered, RankLowering
from .lower import Conversion, Decisions, StagedModel, call_arguments, propagation_norms, source_input, \
    split_stages, value_dims
from .schedule import Order, RankOutline, check_rank, compute_deps, insert_collectives, list_schedule
from .strategy import Strategy, StrategyOptions, option, product

__all__ = ["TensorOptions", "tensor_decisions", "chunked_decisions", "column_splits", "row_blocks", "lower_tensor",
           "STRATEGY"]


@dataclass(frozen=True)
class TensorOptions(StrategyOptions):
    """Options of the ``tensor`` strategy (``seed``, ``semantics``, ``dropout``: :class:`StrategyOptions`;
    there is no partitioner: vertex blocks are contiguous and every rank holds the whole graph)."""

    strategy = "tensor"

    recompute: bool = option(False, "Recompute the T segments between propagations in backward (exact).",
                             kind="bool", pinned=True,
                             cli="recompute T segments in backward instead of keeping their intermediates")
    decouple: bool = option(False, "NeutronTP §4.1 generalized decoupling (the decouple pass): all T ops first on "
                                   "rows, one conversion, the L propagations on columns, one conversion back: 4 "
                                   "collectives per step whatever L is. Relaxed unless the model is linear after "
                                   "its first transformation.", kind="bool", pinned=True,
                            cli="decoupled model, all T ops then all propagations (NeutronTP §4.1; relaxed for "
                                "non-linear models)")
    chunks: int = option(1, "NeutronTP §4.2 chunk pipeline: the vertices are cut into this many contiguous "
                            "chunks of destinations, every rank owns a balanced slice of each chunk's rows, and "
                            "every conversion runs as one all-to-all per chunk, posted as soon as the chunk is "
                            "computed; 1: one whole-graph all-to-all per conversion (NeutronTP §3).",
                         kind="positive_int", cli="vertex chunks, one all-to-all per chunk (NeutronTP §4.2)")

    @classmethod
    def space(cls, semantics: str, fixed: dict[str, Any],
              num_ranks: Optional[int] = None) -> list[dict[str, Any]]:
        # decoupling changes non-linear models: a candidate only where relaxations are allowed
        decouple = [False, True] if semantics == "relaxed" else [False]
        out = product({"recompute": [False, True], "decouple": decouple, "chunks": [1]}, fixed, semantics=semantics)
        if "chunks" not in fixed:  # NeutronTP §4.2's chunk pipeline, without recomputation (its T work is per chunk)
            out += product({"recompute": [False], "decouple": decouple, "chunks": [8]},
                           {k: v for k, v in fixed.items() if k != "recompute"}, semantics=semantics)
        return out


def column_splits(width: int, n: int) -> list[int]:
    """``width`` columns over ``n`` ranks: the first ``width mod n`` ranks get one more."""
    return [width // n + (1 if q < width % n else 0) for q in range(n)]


def row_blocks(num_nodes: int, n: int) -> list[int]:
    """Vertex-block sizes of the ``rows`` layout (balanced to within one vertex)."""
    return column_splits(num_nodes, n)


class _SharedShapes:
    """The all-to-all shape tuples of a lowering over ``n`` ranks, each built once and shared by every
    instruction that has it (``n`` shapes per instruction, on every rank: at 1024 ranks, copies
    would fill the host). The columns are the last dimension (C of [V, H, C]); the others travel whole."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._made: dict[tuple, Any] = {}

    def _get(self, key: tuple, make: Any) -> Any:
        out = self._made.get(key)
        if out is None:
            out = self._made[key] = make()
        return out

    def _get_for(self, rows: tuple, key: tuple, make: Any) -> Any:
        """:meth:`_get` for a key holding the tuple ``rows`` (one entry per rank), looked up by its
        identity: hashing it would cost ``n`` per instruction."""
        hit = self._made.get((id(rows),) + key)
        if hit is None or hit[0] is not rows:
            hit = self._made[(id(rows),) + key] = (rows, make())
        return hit[1]

    def cols(self, width: int) -> tuple[int, ...]:
        """Each rank's columns of a last dimension of ``width``."""
        return self._get(("cols", width), lambda: tuple(column_splits(width, self.n)))

    def my_rows(self, rows: int, dims: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """``rows`` rows of each rank's columns, rank by rank."""
        return self._get(("mine", rows, dims), lambda: tuple((rows, *dims[:-1], c) for c in self.cols(dims[-1])))

    def their_rows(self, rows: tuple[int, ...], cols: int, dims: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Each rank's rows (``rows[q]``) of ``cols`` columns, rank by rank."""
        return self._get_for(rows, ("theirs", cols, dims), lambda: tuple((r, *dims[:-1], cols) for r in rows))


def _edge_weight_input(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The ``edge_weight`` argument of a propagation (``None`` if it has none)."""
    if node.op != "call_function" or node.target not in (propagate, masked_propagate):
        return None
    arg = call_arguments(node).get("edge_weight")
    return arg if isinstance(arg, torch.fx.Node) else None


def tensor_decisions(tp: TPGraph, strategy: str = "tensor") -> Decisions:
    """P outputs in ``cols``, E outputs ``replicated``, everything else in ``rows``; conversions where
    they meet.

    Raises :class:`PlanningError` for what the strategy does not support (module docstring),
    naming ``strategy`` (``mop`` lowers with these decisions too).
    """
    layout: dict[str, str] = {}
    needs: dict[tuple[str, str], str] = {}
    graph_inputs = {n.name for n in tp.graph.nodes if n.op == "placeholder" and n.name == "g"}

    def edge_value_refused(p: torch.fx.Node, n: torch.fx.Node) -> PlanningError:
        return PlanningError(f"strategy {strategy!r} does not support edge-wise op {p.name!r} feeding {n.name!r}: "
                             "edge-wise results are replicated on every rank and may only feed other edge-wise "
                             "ops or a propagation's edge weights (GAT attention); use strategy='data'")

    for n in tp.graph.nodes:
        t = n.meta.get("tp")
        if n.op == "output":
            for p in n.all_input_nodes:
                if layout.get(p.name) == "replicated":
                    raise edge_value_refused(p, n)
            continue
        if t is None or t.kind not in ("T", "P", "E"):
            continue
        if t.kind == "E":
            layout[n.name] = "replicated"
            # a replicated dropout's row index is a model input, the whole tensor's rows on every rank
            index = call_arguments(n).get("index") if n.op == "call_function" and n.target is dropout_rows else None
            for p in n.all_input_nodes:
                if p.name in graph_inputs or p.op == "get_attr" or p is index:
                    continue
                have = layout.get(p.name, "rows")
                if have == "cols":
                    raise PlanningError(f"strategy {strategy!r}: edge-wise op {n.name!r} reads {p.name!r}, the output of a "
                                        "propagation (feature columns cannot be replicated); use strategy='data'")
                space = p.meta["tp"].space if isinstance(p.meta.get("tp"), TPInfo) else "?"
                if have == "rows" and space != "V":
                    raise PlanningError(f"strategy {strategy!r}: edge-wise op {n.name!r} reads {p.name!r}, whose rows are "
                                        f"{space!r}, not vertices; use strategy='data'")
                if have != "replicated":
                    needs[(n.name, p.name)] = "replicated"
        elif t.kind == "P":
            if not t.dims:
                raise PlanningError(f"strategy {strategy!r}: propagation {n.name!r} has per-vertex shape {t.dims}; "
                                    "only values with a feature dimension are split by columns")
            layout[n.name] = "cols"
            src = source_input(n)
            weight = _edge_weight_input(n)
            for p in n.all_input_nodes:
                if p.name in graph_inputs or p.op == "get_attr":
                    continue
                if p is weight and p is not src and layout.get(p.name) == "replicated":
                    continue  # edge weights computed by replicated E ops: read as they are
                if layout.get(p.name) == "replicated":
                    raise edge_value_refused(p, n)
                if p is not src:
                    raise PlanningError(f"strategy {strategy!r}: propagation {n.name!r} reads {p.name!r} besides its "
                                        "features (only edge weights computed by edge-wise ops are supported)")
                if layout.get(p.name, "rows") != "cols":
                    needs[(n.name, p.name)] = "cols"
        else:
            for p in n.all_input_nodes:
                if layout.get(p.name) == "cols":
                    needs[(n.name, p.name)] = "rows"
                elif layout.get(p.name) == "replicated":
                    raise edge_value_refused(p, n)
    # a model ending in a propagation (decoupled models do) has its output gathered back to rows
    return Decisions(layout=layout, needs=needs, default_layout="rows", output_layout="rows")


def _check(job: Job, options: TensorOptions) -> None:
    """Refuse what the strategy does not support, before any rewriting (the chunked lowering's
    refusal of edge-wise ops too, before an attention dropout's row space is refused)."""
    if options.chunks > 1:
        chunked_decisions(job.tp)
    else:
        tensor_decisions(job.tp)


def _dropout_spaces(options: TensorOptions) -> tuple[str, ...]:
    """V (and sparse feature) masks: the rank's rows; E / E+V masks (attention dropout): every edge,
    since E ops are replicated (whole-graph collectives only)."""
    return ("V", "nnz", "E", "E+V") if options.chunks == 1 else ("V", "nnz")


def _edge_rows(job: Job, space: str) -> int:
    """Rows of an E- or (E+V)-space value (replicated: a rank's dropout index is all of them)."""
    return job.stats.num_edges + (job.stats.num_nodes if space == "E+V" else 0)


def _owned_inputs(job: Job, owned: torch.Tensor) -> dict[str, Any]:
    """The features and dropout indices of the rows ``owned`` (a replicated E-space index: every edge)."""
    graph = job.graph
    return {"x": slice_rows(graph.x, owned) if graph.x is not None else None,
            **{k: dropout_positions(sp, graph, owned) if sp in ("V", "nnz") else torch.arange(_edge_rows(job, sp))
               for k, sp in job.dropout_inputs.items()}}


def lower_tensor(job: Job, options: TensorOptions) -> Lowered:
    """The ``tensor`` lowering of ``job`` (module docstring); ``chunks > 1``: :func:`_lower_chunked`."""
    if options.chunks > 1:
        return _lower_chunked(job, options)
    stats, n = job.stats, job.num_ranks
    blocks = row_blocks(stats.num_nodes, n)
    starts = [sum(blocks[:r]) for r in range(n)]
    staged = split_stages(job.tp, tensor_decisions(job.tp))
    staged_eval = split_stages(job.tp_eval, tensor_decisions(job.tp_eval))
    for st in (staged, staged_eval):
        job.refuse_sparse_features(st, ("cols",))
        job.refuse_sparse_features(st, ("gathered",), "an edge-wise op")
    group = tuple(range(n))

    shapes = _SharedShapes(n)
    block_rows = tuple(blocks)

    def convert_for(rank: int, st: StagedModel):
        dims_of = value_dims(st.tp)

        def convert(c: Conversion, chunk: int, grad: bool) -> list[Instruction]:
            dims, dtype = dims_of[c.value]
            if c.kind == "gathered":  # rows -> replicated: all-gather (backward: reduce-scatter)
                return [AllGather(value=c.value, chunk=0, group=group, shape=(stats.num_nodes, *dims), dtype=dtype,
                                  grad=grad)]
            # the columns are the last dimension (C of [V, H, C]); the others travel whole
            mine = shapes.my_rows(blocks[rank], dims)  # my rows of each q's columns
            theirs = shapes.their_rows(block_rows, shapes.cols(dims[-1])[rank], dims)  # q's rows of my columns
            if c.kind == "cols":  # rows -> cols: send my rows of q's columns, receive q's rows of mine
                send, recv, src, dst = mine, theirs, "rows", "cols"
            else:  # cols -> rows
                send, recv, src, dst = theirs, mine, "cols", "rows"
            return [AllToAll(value=c.value, chunk=0, group=group, src_layout=src, dst_layout=dst, send_shapes=send,
                             recv_shapes=recv, dtype=dtype, grad=grad)]
        return convert

    order = list_schedule(compute_deps(staged))
    order_eval = list_schedule(compute_deps(staged_eval, training=False))
    ranks = []
    for r in range(n):
        step: dict[str, Any] = {}
        if job.concrete:
            owned = torch.arange(starts[r], starts[r] + blocks[r])
            step = dict(inputs={"g": job.graph, **_owned_inputs(job, owned)},
                        halo=(tuple(torch.zeros(0, dtype=torch.long) for _ in range(n)), (0,) * n),
                        **job.scored_rows(owned))
        instructions = insert_collectives(staged, order, convert_for(r, staged))
        sizes = RankSizes(nodes=blocks[r], edges=stats.num_edges, src=stats.num_nodes, all_nodes=stats.num_nodes,
                          col_share_ppm=round(1e6 / n))
        if r == 0:  # the ranks run alike: the planner may rule the plan out from the first (most rows and columns)
            check_rank(RankOutline(r, tuple(staged.stages), tuple(instructions), sizes, frozenset(job.inputs)))
        ranks.append(RankLowering(
            rank=r, stages=tuple(staged.stages), instructions=instructions, sizes=sizes,
            eval_stages=tuple(staged_eval.stages),
            eval_instructions=tuple(insert_collectives(staged_eval, order_eval, convert_for(r, staged_eval))),
            step=step))
    info = {"owned_rows": blocks, "layouts": {c.output: c.kind for c in staged.conversions}}
    return Lowered(staged=staged, staged_eval=staged_eval, ranks=ranks, grad_groups=[(group, job.numel)],
                   schedule=Schedule(), info=info)


# --------------------------------------------------------------------------- chunked (NeutronTP §4.2)
def chunked_decisions(tp: TPGraph) -> Decisions:
    """:func:`tensor_decisions` with one layout per stage, for the chunked lowering.

    A propagation reading another propagation's output (chained propagations: decoupled models,
    SGC, APPNP) starts a stage of its own, labelled ``cols/1``, ``cols/2``... by chain depth, so that
    its chunk ``j`` reads every chunk of the previous one across the stage boundary. Edge-wise ops
    are refused: GAT's scores are all-gathered whole (``chunks=1``)."""
    d = tensor_decisions(tp)
    layout = dict(d.layout)
    depth: dict[str, int] = {}
    for n in tp.graph.nodes:
        lay = layout.get(n.name)
        if lay == "replicated":
            raise PlanningError(f"strategy 'tensor' with chunks > 1 does not support edge-wise op {n.name!r} "
                                "(attention scores are all-gathered whole); use chunks=1")
        if lay == "cols":
            src = source_input(n)
            k = depth[src.name] + 1 if src is not None and src.name in depth else 0
            depth[n.name] = k
            if k:
                layout[n.name] = f"cols/{k}"
    return replace(d, layout=layout, pure_stages=True)


def _chunk_sources(tp: TPGraph, staged: StagedModel, labels: dict[int, str]) -> dict[int, set[str]]:
    """Each ``cols`` stage's inputs read on the source side of its propagations (every chunk their
    in-edges reach)."""
    nodes = {n.name: n for n in tp.graph.nodes}
    sources: dict[int, set[str]] = {}
    for st in staged.stages:
        if labels[st.index] != "cols":
            continue
        for op in st.ops:
            src = source_input(nodes[op])
            if src is None:
                continue
            conv = converted_name(src.name, "cols")
            name = conv if conv in st.inputs else src.name
            if name not in st.inputs:
                raise PlanningError(f"strategy 'tensor': propagation {op!r} reads {src.name!r} from inside its own "
                                    "stage; its other chunks would not be computed yet")
            sources.setdefault(st.index, set()).add(name)
    return sources


def _lower_chunked(job: Job, options: TensorOptions) -> Lowered:
    """The ``tensor`` lowering with ``options.chunks`` chunks (NeutronTP §4.2, Algorithm 1).

    Chunk-based task scheduling (§4.2.1): the vertices are cut into ``K`` contiguous chunks of
    destinations (:func:`~gnncompile.passes.chunked.chunk_bounds`); every rank owns a balanced
    slice of every chunk's rows (NeutronTP distributes each chunk's vertex tasks evenly over the
    workers) and runs every chunk's propagation on its columns. Inter-chunk pipelining (§4.2.2):
    every conversion is one all-to-all per chunk, posted right after the chunk is computed
    (:func:`~gnncompile.passes.schedule.insert_collectives`); a propagation's chunk ``j``
    waits for exactly the chunks its in-edges read (exact) and each chunk's slices cross once,
    however many chunks read them, so a step moves the bytes of the unchunked plan. All ranks run
    the chunks in the same order (one list schedule), so their collectives line up.
    """
    graph, stats, n, K = job.graph, job.stats, job.num_ranks, options.chunks

    def split(t: TPGraph) -> tuple[StagedModel, dict[int, str], dict[int, set[str]]]:
        d = chunked_decisions(t)
        st = split_stages(t, d)
        labels = {s: lab.split("/")[0] for s, lab in stage_groups(st, d.layout_of).items()}
        return st, labels, _chunk_sources(t, st, labels)

    staged, labels, sources = split(job.tp)
    staged_eval, labels_eval, sources_eval = split(job.tp_eval)
    job.refuse_sparse_features(staged, ("cols",))
    bounds = chunk_bounds(stats.num_nodes, K)
    if job.concrete:
        chunking = Chunking(bounds, chunk_reads(graph, bounds))
    else:  # planned from statistics: every chunk reads every chunk (the worst case)
        chunking = Chunking(bounds, tuple(tuple(range(K)) for _ in range(K)))
    reads = stage_reads(staged, labels, chunking, sources)
    reads_eval = stage_reads(staged_eval, labels_eval, chunking, sources_eval)
    group = tuple(range(n))
    owners = Group("tensor", group, "rows")
    sub = [owners.sub_rows(chunking, m) for m in range(K)]  # sub[m][r]: rank r's positions of chunk m

    def schedule(st: StagedModel, lab: dict[int, str], rd: dict, training: bool) -> Order:
        # one resource (every rank runs every task); a conversion between two tasks costs as long
        # as a task, so that another chunk's ready task is placed between a chunk's all-to-all and
        # its consumer: the collective posted first runs while that task computes (Fig. 9c)
        return list_schedule(compute_deps(st, K, rd, training),
                             delay=lambda d, t: 1.0 if lab[d.stage] != lab[t.stage] else 0.0)

    order = schedule(staged, labels, reads, True)
    order_eval = schedule(staged_eval, labels_eval, reads_eval, False)

    shapes = _SharedShapes(n)
    chunk_rows = [tuple(hi - lo for lo, hi in sub[m]) for m in range(K)]

    def convert_for(rank: int, st: StagedModel) -> Any:
        dims_of = value_dims(st.tp)

        def convert(c: Conversion, m: int, grad: bool) -> list[Instruction]:
            dims, dtype = dims_of[c.value]
            rows = chunk_rows[m]
            mine = shapes.my_rows(rows[rank], dims)  # my rows of the chunk, each q's columns
            theirs = shapes.their_rows(rows, shapes.cols(dims[-1])[rank], dims)  # q's rows of the chunk, my columns
            if c.kind == "cols":
                send, recv, src, dst = mine, theirs, "rows", "cols"
            elif c.kind == "rows":
                send, recv, src, dst = theirs, mine, "cols", "rows"
            else:
                raise PlanningError(f"strategy 'tensor' with chunks > 1: no chunk-level {c.kind!r} conversion "
                                    f"(of {c.value!r})")
            return [AllToAll(value=c.value, chunk=m, group=group, src_layout=src, dst_layout=dst, send_shapes=send,
                             recv_shapes=recv, dtype=dtype, grad=grad)]
        return convert

    stages = tuple(with_reads(s, reads.get(s.index, {}), labels[s.index]) for s in staged.stages)
    eval_stages = tuple(with_reads(s, reads_eval.get(s.index, {}), labels_eval[s.index]) for s in staged_eval.stages)
    graphs: dict[int, Any] = {}
    if job.concrete:
        scales = propagation_scales(graph, propagation_norms(job.tp, job.tp_eval))
        graphs = {j: chunk_graph(graph, chunking, j, scales) for j in range(K)}
    ranks = []
    for r in range(n):
        step: dict[str, Any] = {}
        if job.concrete:
            per_chunk = [torch.arange(*sub[m][r]) for m in range(K)]
            step = dict(inputs={}, chunk_inputs={m: {"g": graphs[m], **_owned_inputs(job, ids)}
                                                  for m, ids in enumerate(per_chunk)},
                        halo=((), ()), **job.scored_rows(per_chunk))
        rows = sum(sub[m][r][1] - sub[m][r][0] for m in range(K))
        instructions = insert_collectives(staged, order, convert_for(r, staged), K, reads)
        sizes = RankSizes(nodes=rows, edges=stats.num_edges, src=stats.num_nodes, all_nodes=stats.num_nodes,
                          col_share_ppm=round(1e6 / n), chunks=K)
        if r == 0:  # the ranks run alike: the planner may rule the plan out from the first (most rows and columns)
            check_rank(RankOutline(r, stages, tuple(instructions), sizes, frozenset(job.inputs)))
        ranks.append(RankLowering(
            rank=r, stages=stages, instructions=instructions, sizes=sizes,
            eval_stages=eval_stages,
            eval_instructions=tuple(insert_collectives(staged_eval, order_eval, convert_for(r, staged_eval), K,
                                                       reads_eval)),
            step=step))
    info = {"owned_rows": [rl.sizes.nodes for rl in ranks], "layouts": {c.output: c.kind for c in staged.conversions},
            "pipeline_lag": chunking.lag(), "task_order": [str(t) for _, t in order]}
    # FREE releases every chunk after its last reader: a received chunk and the concatenation its
    # propagation reads would otherwise both live for the whole step
    return Lowered(staged=staged, staged_eval=staged_eval, ranks=ranks, grad_groups=[(group, job.numel)],
                   schedule=Schedule("chunk pipeline", K, "chunk-level all-to-alls"), info=info, frees=True)


STRATEGY = Strategy("tensor", TensorOptions, lower_tensor, summary="NeutronTP: T ops on vertex rows, P ops on "
                    "feature columns", check=_check, dropout_spaces=_dropout_spaces, row_mixing_single=False,
                    decouple_source="NeutronTP §4.1")
