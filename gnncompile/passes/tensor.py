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
all-gathered to ``replicated``; then every rank runs the E ops (``gather_src + gather_dst``,
LeakyReLU, ``edge_softmax``, dropout) on all edges and holds the same ``alpha``: a dropout of alpha
draws the whole tensor's mask from the seed every rank shares (``dropout="replicated"``,
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
from typing import Any, Optional, Union

import torch
import torch.fx

from ..errors import PassError, PlanningError
from ..graph.core import Graph, GraphStats
from ..graph.shard import dropout_positions, slice_rows
from ..frontend.ops import dropout_rows, masked_propagate, propagate
from ..ir.plan import AllGather, AllReduce, AllToAll, DevicePlan, Instruction, OptimizerStep, Plan, RankProgram, \
    converted_name
from ..ir.tpgraph import TPGraph, TPInfo
from .chunked import Chunking, Group, Task, chunk_bounds, chunk_graph, chunk_reads, propagation_coefficients, \
    collective_chunk_program, list_schedule, stage_deps, stage_groups, stage_reads, with_reads
from .data import _propagation_norms, check_options, mask_counts, replicate_dropout_masks, \
    row_mixing_relaxations
from .lower import Conversion, Decisions, StagedModel, call_arguments, forward_schedule, sequential_schedule, \
    source_input, split_stages
from .decouple import decouple, plan_decoupling
from .free import insert_frees
from .recompute import insert_recomputation

__all__ = ["TensorOptions", "tensor_decisions", "chunked_decisions", "column_splits", "row_blocks", "lower_tensor"]


@dataclass(frozen=True)
class TensorOptions:
    """Options of the ``tensor`` strategy (``seed``, ``semantics``, ``dropout``, ``recompute`` as for
    :class:`~gnncompile.passes.data.DataOptions`; there is no partitioner: vertex blocks are
    contiguous and every rank holds the whole graph)."""

    seed: int = 0
    semantics: str = "exact"
    dropout: str = "replicated"
    recompute: bool = False
    #: NeutronTP §4.1 generalized decoupling (the ``decouple`` pass): all T ops first on rows, one
    #: conversion, the L propagations on columns, one conversion back: 4 collectives per step
    #: whatever L is. Relaxed unless the model is linear after its first transformation.
    decouple: bool = False
    #: NeutronTP §4.2 chunk-based task scheduling and inter-chunk pipelining: the vertices are cut
    #: into ``chunks`` contiguous chunks of destinations, every rank owns a balanced slice of each
    #: chunk's rows, and every conversion runs as one all-to-all per chunk, posted as soon as the
    #: chunk is computed. ``1``: one whole-graph all-to-all per conversion (NeutronTP §3)
    chunks: int = 1

    def __post_init__(self) -> None:
        check_options(self.semantics, self.dropout, recompute=self.recompute, decouple=self.decouple)
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise PlanningError(f"tensor: chunks must be a positive integer, got {self.chunks!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": "tensor", "seed": self.seed, "semantics": self.semantics, "dropout": self.dropout,
                "recompute": self.recompute, "decouple": self.decouple, "chunks": self.chunks}


def column_splits(width: int, n: int) -> list[int]:
    """``width`` columns over ``n`` ranks: the first ``width mod n`` ranks get one more."""
    return [width // n + (1 if q < width % n else 0) for q in range(n)]


def row_blocks(num_nodes: int, n: int) -> list[int]:
    """Vertex-block sizes of the ``rows`` layout (balanced to within one vertex)."""
    return column_splits(num_nodes, n)


def _edge_weight_input(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The ``edge_weight`` argument of a propagation (``None`` if it has none)."""
    if node.op != "call_function" or node.target not in (propagate, masked_propagate):
        return None
    arg = call_arguments(node).get("edge_weight")
    return arg if isinstance(arg, torch.fx.Node) else None


def tensor_decisions(tp: TPGraph) -> Decisions:
    """P outputs in ``cols``, E outputs ``replicated``, everything else in ``rows``; conversions where
    they meet.

    Raises :class:`PlanningError` for what the strategy does not support (module docstring).
    """
    layout: dict[str, str] = {}
    needs: dict[tuple[str, str], str] = {}
    graph_inputs = {n.name for n in tp.graph.nodes if n.op == "placeholder" and n.name == "g"}

    def edge_value_refused(p: torch.fx.Node, n: torch.fx.Node) -> PlanningError:
        return PlanningError(f"strategy 'tensor' does not support edge-wise op {p.name!r} feeding {n.name!r}: "
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
                    raise PlanningError(f"strategy 'tensor': edge-wise op {n.name!r} reads {p.name!r}, the output of a "
                                        "propagation (feature columns cannot be replicated); use strategy='data'")
                space = p.meta["tp"].space if isinstance(p.meta.get("tp"), TPInfo) else "?"
                if have == "rows" and space != "V":
                    raise PlanningError(f"strategy 'tensor': edge-wise op {n.name!r} reads {p.name!r}, whose rows are "
                                        f"{space!r}, not vertices; use strategy='data'")
                if have != "replicated":
                    needs[(n.name, p.name)] = "replicated"
        elif t.kind == "P":
            if not t.dims:
                raise PlanningError(f"strategy 'tensor': propagation {n.name!r} has per-vertex shape {t.dims}; "
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
                    raise PlanningError(f"strategy 'tensor': propagation {n.name!r} reads {p.name!r} besides its "
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


def _decoupled(tp: TPGraph, tp_eval: TPGraph, semantics: str, strategy: str = "tensor",
               source: str = "NeutronTP §4.1") -> tuple[TPGraph, TPGraph, str]:
    """``tp`` and ``tp_eval`` decoupled for ``strategy``, and the relaxation to record ("" when
    exact; ``source`` names the paper's section).

    Raises :class:`PlanningError` under ``semantics="exact"`` when decoupling changes the model.
    """
    plan = plan_decoupling(tp)
    if not plan.exact and semantics == "exact":
        raise PlanningError("decoupling changes this model (" + "; ".join(plan.reasons) + "); pass "
                            "semantics='relaxed' to train the decoupled model")
    try:
        out = (decouple(tp, semantics="relaxed", share_parameters=True),
               decouple(tp_eval, semantics="relaxed", share_parameters=True))
    except PassError as e:
        raise PlanningError(f"strategy {strategy!r} cannot decouple this model: {e}") from None
    what = "" if plan.exact else (f"decoupled propagation ({source}): the model becomes MLP then "
                                  f"{len(plan.propagations)} propagations")
    return out[0], out[1], what


def _dims(tp: TPGraph, value: str) -> tuple[tuple[int, ...], str]:
    """The per-vertex shape of ``value`` and its dtype."""
    node = next(n for n in tp.graph.nodes if n.name == value)
    t = node.meta["tp"]
    return tuple(t.dims), t.dtype or "float32"


def lower_tensor(tp: TPGraph, tp_eval: TPGraph, model: torch.nn.Module, graph: Union[Graph, GraphStats],
                 num_ranks: int, options: TensorOptions) -> Plan:
    """Lower ``tp`` and ``tp_eval`` to a ``tensor`` plan over ``num_ranks`` ranks (see the module docstring).

    With :class:`GraphStats` the plan is data only (printable, simulated), as for ``data``.
    """
    relaxations = row_mixing_relaxations(tp, "tensor", options.semantics) if num_ranks > 1 else []
    if options.decouple:
        tp, tp_eval, relaxation = _decoupled(tp, tp_eval, options.semantics)
        if relaxation:
            relaxations.append(relaxation)
    tensor_decisions(tp)  # refuses what the strategy does not support, before any rewriting
    if options.chunks > 1:
        return _lower_chunked(tp, tp_eval, model, graph, num_ranks, options, relaxations)
    concrete = isinstance(graph, Graph)
    stats = graph.stats() if concrete else graph
    n = num_ranks
    blocks = row_blocks(stats.num_nodes, n)
    starts = [sum(blocks[:r]) for r in range(n)]
    dropout_inputs: dict[str, str] = {}
    if concrete and options.dropout == "replicated":
        # V (and sparse feature) masks: the rank's rows; E / E+V masks (attention dropout): every
        # edge, since E ops are replicated
        tp, dropout_inputs = replicate_dropout_masks(tp, graph, "tensor", ("V", "nnz", "E", "E+V"))
    if options.recompute:
        tp = insert_recomputation(tp, share_parameters=True)
    decisions = tensor_decisions(tp)
    staged = split_stages(tp, decisions)
    staged_eval = split_stages(tp_eval, tensor_decisions(tp_eval))
    for st in (staged, staged_eval):
        for c in st.conversions:
            if c.kind in ("cols", "gathered") and concrete and c.value == "x" and graph.x is not None and \
                    graph.x.layout != torch.strided:
                raise PlanningError(f"strategy 'tensor': a {'propagation' if c.kind == 'cols' else 'edge-wise op'} "
                                    "reads the sparse input features directly; densify them "
                                    "(graph.dense_features()) or use strategy='data'")
    group = tuple(range(n))
    names = [name for name, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    numel = sum(p.numel() for p in params if p.requires_grad)
    param_dtype = str(params[0].dtype).replace("torch.", "") if params else "float32"

    def convert_for(rank: int, st: StagedModel):
        def convert(c: Conversion, grad: bool) -> list[Instruction]:
            dims, dtype = _dims(st.tp, c.value)
            if c.kind == "gathered":  # rows -> replicated: all-gather (backward: reduce-scatter)
                return [AllGather(value=c.value, chunk=0, group=group, shape=(stats.num_nodes, *dims), dtype=dtype,
                                  grad=grad)]
            # the columns are the last dimension (C of [V, H, C]); the others travel whole
            mid, cols = dims[:-1], column_splits(dims[-1], n)
            if c.kind == "cols":  # rows -> cols: send my rows of q's columns, receive q's rows of mine
                send = tuple((blocks[rank], *mid, cols[q]) for q in group)
                recv = tuple((blocks[q], *mid, cols[rank]) for q in group)
                src, dst = "rows", "cols"
            else:  # cols -> rows
                send = tuple((blocks[q], *mid, cols[rank]) for q in group)
                recv = tuple((blocks[rank], *mid, cols[q]) for q in group)
                src, dst = "cols", "rows"
            return [AllToAll(value=c.value, chunk=0, group=group, src_layout=src, dst_layout=dst, send_shapes=send,
                             recv_shapes=recv, dtype=dtype, grad=grad)]
        return convert

    def finish() -> list[Instruction]:
        ar = [AllReduce("grads", group, numel=numel, dtype=param_dtype)] if n > 1 and numel else []
        return ar + [OptimizerStep()]

    ranks = []
    for r in range(n):
        instrs = tuple(sequential_schedule(staged, convert_for(r, staged), finish))
        sizes = {"nodes": blocks[r], "edges": stats.num_edges, "halo": 0, "src": stats.num_nodes,
                 "all_nodes": stats.num_nodes, "col_share_ppm": round(1e6 / n)}
        ranks.append(DevicePlan(rank=r, stages=tuple(staged.stages), instructions=instrs, sizes=sizes,
                                modules=staged.modules))
    info = {
        "graph": str(stats), "model": type(model).__name__, "output": staged.output,
        "inputs": ["g", "x", *dropout_inputs], "owned_rows": blocks, "halo_rows": [0] * n,
        "params": numel, "param_tensors": sum(1 for p in params if p.requires_grad), "param_dtype": param_dtype,
        "features": stats.num_features, "classes": stats.num_classes,
        "layouts": {c.output: c.kind for c in staged.conversions},
    }
    plan = Plan(strategy="tensor", semantics="relaxed" if relaxations else "exact", options=options.to_dict(),
                cluster=f"{n} local ranks", ranks=ranks, schedule="sequential", relaxations=tuple(relaxations),
                info=info)
    from ..ir.verify_plan import verify_plan

    report = verify_plan(plan, inputs=info["inputs"], check_types=False)  # gc.plan checks the chosen one fully
    plan.predictions = {"bytes_sent": [int(round(b)) for b in report.bytes_sent],
                        "bytes_received": [int(round(b)) for b in report.bytes_recv]}
    if concrete:
        plan.program = _rank_programs(graph, staged, staged_eval, convert_for, dropout_inputs, options, names,
                                      params, ranks, blocks, starts)
    return plan


def _edge_rows(graph: Graph, space: str) -> int:
    """Rows of an E- or (E+V)-space value (replicated: a rank's dropout index is all of them)."""
    return graph.num_edges + (graph.num_nodes if space == "E+V" else 0)


def _rank_programs(graph: Graph, staged: StagedModel, staged_eval: StagedModel, convert_for: Any,
                   dropout_inputs: dict[str, str], options: TensorOptions, names: list[str],
                   params: list[torch.nn.Parameter], ranks: list[DevicePlan], blocks: list[int],
                   starts: list[int]) -> list[RankProgram]:
    counts = mask_counts(graph)
    programs = []
    n = len(blocks)
    for r in range(n):
        owned = torch.arange(starts[r], starts[r] + blocks[r])
        eval_instrs = tuple(forward_schedule(staged_eval, convert_for(r, staged_eval)))
        x = slice_rows(graph.x, owned) if graph.x is not None else None
        mask = {m: (getattr(graph, f"{m}_mask")[owned] if getattr(graph, f"{m}_mask") is not None else None)
                for m in ("train", "val", "test")}
        programs.append(RankProgram(
            rank=r, world_size=n, modules=staged.modules, stages=tuple(staged.stages), instructions=ranks[r].instructions,
            eval_modules=staged_eval.modules, eval_stages=tuple(staged_eval.stages), eval_instructions=eval_instrs,
            output=staged.output, eval_output=staged_eval.output,
            inputs={"g": graph, "x": x, **{k: dropout_positions(sp, graph, owned) if sp in ("V", "nnz") else
                                           torch.arange(_edge_rows(graph, sp)) for k, sp in dropout_inputs.items()}},
            same_seed=options.dropout == "replicated",
            halo=(tuple(torch.zeros(0, dtype=torch.long) for _ in range(n)), (0,) * n),
            labels=graph.y[owned] if graph.y is not None else None, masks=mask, counts=counts,
            params=params, param_names=names, owned=owned))
    return programs


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


def _lower_chunked(tp: TPGraph, tp_eval: TPGraph, model: torch.nn.Module, graph: Union[Graph, GraphStats],
                   num_ranks: int, options: TensorOptions, relaxations: list[str]) -> Plan:
    """The ``tensor`` plan with ``options.chunks`` chunks (NeutronTP §4.2, Algorithm 1).

    Chunk-based task scheduling (§4.2.1): the vertices are cut into ``K`` contiguous chunks of
    destinations (:func:`~gnncompile.passes.chunked.chunk_bounds`); every rank owns a balanced
    slice of every chunk's rows (NeutronTP distributes each chunk's vertex tasks evenly over the
    workers) and runs every chunk's propagation on its columns. Inter-chunk pipelining (§4.2.2):
    every conversion is one all-to-all per chunk, posted right after the chunk is computed
    (:func:`~gnncompile.passes.chunked.collective_chunk_program`); a propagation's chunk ``j``
    waits for exactly the chunks its in-edges read (exact) and each chunk's slices cross once,
    however many chunks read them, so a step moves the bytes of the unchunked plan. All ranks run
    the chunks in the same order (one list schedule), so their collectives line up.
    """
    concrete = isinstance(graph, Graph)
    stats = graph.stats() if concrete else graph
    n = num_ranks
    K = options.chunks
    dropout_inputs: dict[str, str] = {}
    if concrete and options.dropout == "replicated":
        tp, dropout_inputs = replicate_dropout_masks(tp, graph, "tensor", ("V", "nnz"))
    if options.recompute:
        tp = insert_recomputation(tp, share_parameters=True)

    def split(t: TPGraph) -> tuple[StagedModel, dict[int, str], dict[int, set[str]]]:
        d = chunked_decisions(t)
        st = split_stages(t, d)
        labels = {s: lab.split("/")[0] for s, lab in stage_groups(st, d.layout_of).items()}
        return st, labels, _chunk_sources(t, st, labels)

    staged, labels, sources = split(tp)
    staged_eval, labels_eval, sources_eval = split(tp_eval)
    if concrete and graph.x is not None and graph.x.layout != torch.strided and \
            any(c.value == "x" and c.kind == "cols" for c in staged.conversions):
        raise PlanningError("strategy 'tensor': a propagation reads the sparse input features directly; densify them "
                            "(graph.dense_features()) or use strategy='data'")
    bounds = chunk_bounds(stats.num_nodes, K)
    if concrete:
        chunking = Chunking(bounds, chunk_reads(graph, bounds))
    else:  # planned from statistics: every chunk reads every chunk (the worst case)
        chunking = Chunking(bounds, tuple(tuple(range(K)) for _ in range(K)))
    reads = stage_reads(staged, labels, chunking, sources)
    reads_eval = stage_reads(staged_eval, labels_eval, chunking, sources_eval)
    group = tuple(range(n))
    owners = Group("tensor", group, "rows")
    sub = [owners.sub_rows(chunking, m) for m in range(K)]  # sub[m][r]: rank r's positions of chunk m

    def schedule(st: StagedModel, lab: dict[int, str], rd: dict, training: bool) -> list[tuple[float, Task]]:
        # one resource (every rank runs every task); a conversion between two tasks costs as long
        # as a task, so that another chunk's ready task is placed between a chunk's all-to-all and
        # its consumer: the collective posted first runs while that task computes (Fig. 9c)
        deps = stage_deps(st, chunking, rd, training)
        return list_schedule(deps.keys(), lambda t: 0, deps, {},
                             delay=lambda d, t: 1.0 if lab[d.stage] != lab[t.stage] else 0.0)

    order = schedule(staged, labels, reads, True)
    order_eval = schedule(staged_eval, labels_eval, reads_eval, False)

    def convert_for(rank: int, st: StagedModel) -> Any:
        def convert(c: Conversion, m: int, grad: bool) -> list[Instruction]:
            dims, dtype = _dims(st.tp, c.value)
            mid, cols = dims[:-1], column_splits(dims[-1], n)
            rows = [hi - lo for lo, hi in sub[m]]
            if c.kind == "cols":  # my rows of the chunk, q's columns; q's rows of the chunk, my columns
                send = tuple((rows[rank], *mid, cols[q]) for q in group)
                recv = tuple((rows[q], *mid, cols[rank]) for q in group)
                src, dst = "rows", "cols"
            elif c.kind == "rows":
                send = tuple((rows[q], *mid, cols[rank]) for q in group)
                recv = tuple((rows[rank], *mid, cols[q]) for q in group)
                src, dst = "cols", "rows"
            else:
                raise PlanningError(f"strategy 'tensor' with chunks > 1: no chunk-level {c.kind!r} conversion "
                                    f"(of {c.value!r})")
            return [AllToAll(value=c.value, chunk=m, group=group, src_layout=src, dst_layout=dst, send_shapes=send,
                             recv_shapes=recv, dtype=dtype, grad=grad)]
        return convert

    names = [name for name, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    numel = sum(p.numel() for p in params if p.requires_grad)
    param_dtype = str(params[0].dtype).replace("torch.", "") if params else "float32"
    finish = ([AllReduce("grads", group, numel=numel, dtype=param_dtype)] if n > 1 and numel else []) + \
        [OptimizerStep()]
    stages = tuple(with_reads(s, reads.get(s.index, {}), labels[s.index]) for s in staged.stages)
    eval_stages = tuple(with_reads(s, reads_eval.get(s.index, {}), labels_eval[s.index]) for s in staged_eval.stages)
    ranks = []
    for r in range(n):
        instrs = collective_chunk_program(staged, chunking, reads, order, convert_for(r, staged), training=True)
        rows = sum(sub[m][r][1] - sub[m][r][0] for m in range(K))
        sizes = {"nodes": rows, "edges": stats.num_edges, "halo": 0, "src": stats.num_nodes,
                 "all_nodes": stats.num_nodes, "col_share_ppm": round(1e6 / n), "chunks": K}
        ranks.append(DevicePlan(rank=r, stages=stages, instructions=tuple(instrs + finish), sizes=sizes,
                                modules=staged.modules))
    # release every chunk after its last reader: a received chunk and the concatenation its
    # propagation reads would otherwise both live for the whole step
    ranks = insert_frees(ranks, keep={"g", "x", *dropout_inputs, staged.output})
    info = {
        "graph": str(stats), "model": type(model).__name__, "output": staged.output,
        "inputs": ["g", "x", *dropout_inputs], "owned_rows": [dp.sizes["nodes"] for dp in ranks],
        "halo_rows": [0] * n, "params": numel, "param_tensors": sum(1 for p in params if p.requires_grad),
        "param_dtype": param_dtype, "features": stats.num_features, "classes": stats.num_classes,
        "layouts": {c.output: c.kind for c in staged.conversions},
        "pipeline_lag": chunking.lag(), "task_order": [str(t) for _, t in order],
    }
    plan = Plan(strategy="tensor", semantics="relaxed" if relaxations else "exact", options=options.to_dict(),
                cluster=f"{n} local ranks", ranks=ranks,
                schedule=f"chunk pipeline ({K} chunks, chunk-level all-to-alls)", relaxations=tuple(relaxations),
                info=info)
    from ..ir.verify_plan import verify_plan

    report = verify_plan(plan, inputs=info["inputs"], check_types=False)  # gc.plan checks the chosen one fully
    plan.predictions = {"bytes_sent": [int(round(b)) for b in report.bytes_sent],
                        "bytes_received": [int(round(b)) for b in report.bytes_recv]}
    if concrete:
        norms = _propagation_norms(tp) | _propagation_norms(tp_eval)
        edge_coef, loop_coef = propagation_coefficients(graph, norms)
        graphs = {j: chunk_graph(graph, chunking, j, edge_coef, loop_coef) for j in range(K)}
        counts = mask_counts(graph)
        programs = []
        for r in range(n):
            per_chunk = [torch.arange(*sub[m][r]) for m in range(K)]
            owned = torch.cat(per_chunk)
            offsets = [0]
            for ids in per_chunk:
                offsets.append(offsets[-1] + int(ids.numel()))
            chunk_inputs = {m: {"g": graphs[m], "x": slice_rows(graph.x, ids) if graph.x is not None else None,
                                **{k: dropout_positions(sp, graph, ids) for k, sp in dropout_inputs.items()}}
                            for m, ids in enumerate(per_chunk)}
            eval_instrs = collective_chunk_program(staged_eval, chunking, reads_eval, order_eval,
                                                   convert_for(r, staged_eval), training=False)
            programs.append(RankProgram(
                rank=r, world_size=n, modules=staged.modules, stages=stages, instructions=ranks[r].instructions,
                eval_modules=staged_eval.modules, eval_stages=eval_stages, eval_instructions=tuple(eval_instrs),
                output=staged.output, eval_output=staged_eval.output, inputs={}, chunk_inputs=chunk_inputs,
                chunk_offsets=tuple(offsets), same_seed=options.dropout == "replicated", halo=((), ()),
                labels=graph.y[owned] if graph.y is not None else None,
                masks={m: (getattr(graph, f"{m}_mask")[owned] if getattr(graph, f"{m}_mask") is not None else None)
                       for m in ("train", "val", "test")},
                counts=counts, params=params, param_names=names, owned=owned))
        plan.program = programs
    return plan
