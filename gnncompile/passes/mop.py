"""The ``mop`` strategy (MixGCN): mixture of parallelism on a mixture of accelerators; exact.

MixGCN §3.1.2 (MoP, Algorithm 2): neighbour aggregation is feature-parallel (every aggregation
device holds the whole graph and a slice of the feature columns), node update is vertex-parallel
(every update device holds whole rows of a block of vertices), with all-to-all shuffles between the
two. That layout alone is the ``tensor`` plan (NeutronTP §3 describes the same split), so ``mop``
is MoP *with* MoA, §3.2: the aggregation (P, sparse) and update (T, dense) work run on **disjoint
device groups** — ``sparse_ranks`` ranks for P, the rest for T — and the graph streams through them
in ``chunks`` (the fine-grain pipeline of §3.2.2, Fig. 5b–d): the T group updates chunk k and sends
its column slices to the P group; the P group aggregates a chunk of destinations as soon as every
chunk its in-edges read has arrived and sends the result back; gradients flow the same way in
reverse. The dependencies are exact (a chunk waits for what it reads), so the trained model is the
single-device one.

Node reordering (§3.2.2): with ``reorder="rcm"`` the vertices are renumbered by reverse
Cuthill–McKee before chunking (:mod:`gnncompile.graph.reorder`), shrinking the graph bandwidth
``b``: chunk ``j`` then reads chunks ``j-w..j+w`` only (``w`` ≈ b / chunk size), so the P group can
start after ``w + 1`` chunks instead of all of them. Proposition 3.5: with ``s`` chunks, idleness is
eliminated when ``(n - b) / 2n >= 1 / s``. The plan records the lag (``info["pipeline_lag"]``, the
most chunks ahead any chunk reads) and ``b``.

Decisions: P outputs ``cols`` on the sparse group, everything else ``rows`` on the dense group
(:func:`gnncompile.passes.tensor.tensor_decisions` with one layout per stage); conversions are
point-to-point messages per chunk (:func:`gnncompile.passes.schedule.insert_messages`). Parameters
live on the dense group (one gradient all-reduce over it); the sparse group holds no parameters.

Supported: models whose propagations aggregate element-wise and read a value the dense group
computes (GCN, GraphSAGE, GIN, GCNII, APPNP: its mix after every step is a dense op). A model whose
output is a propagation (README's ``MyGCN``) ends in an identity stage on the dense group
(:func:`gather_output`): the loss is computed there, from the rows the sparse group sends, as it
sends every other propagation's. Refused with :class:`~gnncompile.errors.PlanningError`:
edge-wise ops (attention: MixGCN §5 names it a limitation of MoP), chained propagations without a
T op between them (SGC, decoupled models: a propagation reading another's output), recomputation,
sparse input features read by a propagation.

Communication per step: every conversion moves each vertex's row once between the groups per
direction, ``|V| x D`` elements (MixGCN Proposition 3.4: ``O(|V|)``, independent of the number of
devices), forward and backward when the value needs a gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch

from ..errors import PlanningError
from ..graph.core import Graph, GraphStats
from ..graph.reorder import bandwidth, permute, rcm_order
from ..graph.shard import dropout_positions, slice_rows
from ..ir.plan import RankSizes, Schedule, converted_name
from ..ir.symbolic import Lin
from ..ir.tpgraph import TPGraph, TPInfo
from .chunked import Chunking, Group, Placement, chunk_bounds, chunk_graph, chunk_reads, propagation_scales, \
    stage_groups, stage_reads, with_reads
from .driver import Job, Lowered, RankLowering
from .infra import graph_pass
from .lower import StagedModel, dropout_p, propagation_norms, requires_grad_values, source_input, split_stages, \
    value_dims
from .schedule import compute_deps, count_messages, insert_messages, list_schedule
from .strategy import Strategy, StrategyOptions, option
from .tensor import tensor_decisions

__all__ = ["MopOptions", "lower_mop", "gather_output", "REORDERINGS", "STRATEGY"]

REORDERINGS = ("none", "rcm")


@dataclass(frozen=True)
class MopOptions(StrategyOptions):
    """Options of the ``mop`` strategy (``seed``, ``semantics``, ``dropout``: :class:`StrategyOptions`)."""

    strategy = "mop"

    chunks: int = option(1, "Pipeline granularity: vertex chunks streamed between the sparse and dense groups "
                            "(1: the naive MoA workflow of MixGCN Fig. 5a).", kind="positive_int",
                         cli="vertex chunks pipelined between the sparse and dense groups")
    sparse_ranks: Optional[int] = option(None, "Ranks of the aggregation (P) group, the rest update (T); default "
                                               "half (MixGCN pairs one sparse with one dense accelerator).",
                                         kind="optional_positive_int",
                                         cli="ranks aggregating (the rest run the dense updates; half when not given)")
    reorder: str = option("none", "'rcm' renumbers vertices by reverse Cuthill-McKee before chunking (MixGCN "
                                  "§3.2.2).", kind="choice", choices=REORDERINGS)

    @classmethod
    def space(cls, semantics: str, fixed: dict[str, Any],
              num_ranks: Optional[int] = None) -> list[dict[str, Any]]:
        # the naive workflow and a fine-grain pipeline over RCM-reordered chunks (MixGCN Fig. 5a / 5d)
        rest = dict(fixed)
        chunks = [rest.pop("chunks")] if "chunks" in rest else [1, 8]
        reorder = [rest.pop("reorder")] if "reorder" in rest else None
        return [{**rest, "chunks": k, "reorder": ro, "semantics": semantics}
                for k in chunks for ro in reorder or (["rcm"] if k > 1 else ["none"])]


@dataclass(frozen=True)
class TwoGroups:
    """The dense (``rows``) and sparse (``cols``) groups of a ``mop`` plan."""

    rows: tuple[int, ...]
    cols: tuple[int, ...]

    def placement(self, groups: dict[int, str]) -> Placement:
        """Stages labelled ``rows`` on the dense group, ``cols`` on the sparse one; the dense group
        holds the features (and sends what a propagation reads of them)."""
        return Placement((Group("dense", self.rows, "rows"), Group("sparse", self.cols, "cols")),
                         {s: 0 if lab == "rows" else 1 for s, lab in groups.items()}, input_group=0)

    def sub_rows(self, chunking: Chunking, k: int) -> list[tuple[int, int]]:
        return Group("dense", self.rows, "rows").sub_rows(chunking, k)


def _groups(num_ranks: int, options: MopOptions) -> TwoGroups:
    if num_ranks < 2:
        raise PlanningError(f"strategy 'mop' needs at least 2 ranks (a sparse and a dense group), got {num_ranks}; "
                            "use strategy='tensor' for MoP without separate accelerators")
    p = options.sparse_ranks if options.sparse_ranks is not None else num_ranks // 2
    if not 1 <= p <= num_ranks - 1:
        raise PlanningError(f"mop: sparse_ranks must be in 1..{num_ranks - 1} for {num_ranks} ranks, got {p}")
    return TwoGroups(rows=tuple(range(p, num_ranks)), cols=tuple(range(p)))


def _check_model(tp: TPGraph, staged: StagedModel, groups: dict[int, str]) -> dict[int, set[str]]:
    """Refusals of the module docstring; returns each cols stage's converted source inputs."""
    nodes = {n.name: n for n in tp.graph.nodes}
    req = requires_grad_values(tp)
    sources: dict[int, set[str]] = {}
    for st in staged.stages:
        if groups[st.index] != "cols":
            continue
        for op in st.ops:
            n = nodes[op]
            if n.meta["tp"].kind != "P":
                raise PlanningError(f"strategy 'mop': op {op!r} ({n.meta['tp'].kind}) landed on the sparse group")
            if any(a.op == "get_attr" and a.name in req for a in n.all_input_nodes):
                raise PlanningError(f"strategy 'mop': propagation {op!r} uses trainable parameters")
            src = source_input(n)
            conv = converted_name(src.name, "cols") if src is not None else None
            if conv is None or conv not in st.inputs:
                raise PlanningError(f"strategy 'mop': propagation {op!r} reads {src.name if src else '?'!r}, the "
                                    "output of another propagation (chained propagations: APPNP, SGC, decoupled "
                                    "models) — not supported yet; use strategy='tensor'")
            sources.setdefault(st.index, set()).add(conv)
    out = staged.output
    if out not in staged.stage_of or groups[staged.stage_of[out]] != "rows":
        # lower_mop runs gather_output first, so the output is a dense stage's: a graph reaching here
        # was split without it
        raise PlanningError("strategy 'mop': the model's output is a propagation, which the dense group must "
                            "receive in a stage of its own (gather_output); use strategy='tensor'")
    return sources


def _ends_in_propagation(tp: TPGraph) -> bool:
    """Whether ``tp`` returns the result of a P op."""
    value = next(n for n in tp.graph.nodes if n.op == "output").args[0]
    info = value.meta.get("tp") if isinstance(value, torch.fx.Node) else None
    return isinstance(info, TPInfo) and info.kind == "P"


@graph_pass(exact=True)
def gather_output(tp: TPGraph) -> TPGraph:
    """End a model whose output is a propagation (README's ``MyGCN``) in an identity T op.

    ``mop`` computes the loss on the dense group, from a dense stage's output: a propagation's
    result lives on the sparse group (its feature columns), so its rows must reach the dense group
    as the input of a stage, as every other propagation's result does. A copy (``clone``) of the
    output is that stage: the sparse group sends the output's chunks to the dense ranks like any
    aggregation's result (the bytes of the last propagation's ``cols -> rows`` messages; the copy
    costs one read and one write of the output on the dense rank).

    Requires:
        A verified TPGraph returning one tensor.
    Ensures:
        When the returned value is computed by a P op: the graph returns ``<output>_rows``, a
        ``clone`` of it annotated T (the next layer, the output's rows, dims and dtype, no FLOPs, a
        read and a write of the value, nothing saved). Otherwise the graph is unchanged.
    Preserves:
        The function and every gradient, bit for bit (a copy; its backward passes the gradient on).
    """
    graph = tp.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    value = out_node.args[0]
    if not _ends_in_propagation(tp):
        return tp
    info = value.meta["tp"]
    with graph.inserting_before(out_node):
        gathered = graph.create_node("call_method", "clone", (value,), name=f"{value.name}_rows")
    size = info.rows * (math.prod(info.dims) * torch.empty(0, dtype=getattr(torch, info.dtype or "float32"))
                        .element_size()) if info.rows is not None else Lin()
    gathered.meta["tp"] = TPInfo(kind="T", layer=info.layer + 1, rows=info.rows, dims=info.dims, dtype=info.dtype,
                                 bytes_read=size, bytes_written=size, op="clone (the output, gathered to rows)")
    out_node.args = (gathered,)
    tp.recompile()
    return tp


def _chunking(graph: Union[Graph, GraphStats], options: MopOptions) -> tuple[Chunking, Optional[Graph], dict]:
    """The chunking (and the reordered graph) of ``graph``; a plan from statistics assumes the
    worst case (every chunk reads every chunk)."""
    if isinstance(graph, GraphStats):
        bounds = chunk_bounds(graph.num_nodes, options.chunks)
        K = len(bounds) - 1
        return Chunking(bounds, tuple(tuple(range(K)) for _ in range(K))), None, {}
    order = None
    ordered = graph
    info: dict[str, Any] = {}
    info["bandwidth"] = bandwidth(graph)
    if options.reorder == "rcm":
        order = rcm_order(graph)
        ordered = permute(graph, order)
        info["bandwidth_reordered"] = bandwidth(ordered)
    bounds = chunk_bounds(graph.num_nodes, options.chunks)
    return Chunking(bounds, chunk_reads(ordered, bounds), order), ordered, info


def _check(job: Job, options: MopOptions) -> None:
    """The refusals that do not depend on the lowering, before any pass runs (an edge-wise op
    first: no other option would make the model plannable)."""
    modules = dict(job.tp.named_modules())
    edge = [n.name for n in job.tp.graph.nodes if n.meta.get("tp") is not None and n.meta["tp"].kind == "E"
            and dropout_p(n, modules) is None]  # (a dropout of edge values: named by what made them)
    if edge:
        named = ", ".join(map(repr, edge[:4])) + (f" and {len(edge) - 4} more" if len(edge) > 4 else "")
        raise PlanningError(f"strategy 'mop' does not support edge-wise op{'s' if len(edge) > 1 else ''} {named}: "
                            "MixGCN's MoP aggregates element-wise only (attention needs whole rows per edge, MixGCN "
                            "§5); use strategy='tensor' or 'data'")
    _groups(job.num_ranks, options)


def lower_mop(job: Job, options: MopOptions) -> Lowered:
    """The ``mop`` lowering of ``job`` (module docstring)."""
    two = _groups(job.num_ranks, options)
    graph, stats, num_ranks = job.graph, job.stats, job.num_ranks
    # a model ending in a propagation: its rows reach the dense group as a stage's input
    if _ends_in_propagation(job.tp) or _ends_in_propagation(job.tp_eval):
        job.tp = gather_output(job.tp, share_parameters=True)
        job.tp_eval = gather_output(job.tp_eval, share_parameters=True)

    def split(t: TPGraph) -> tuple[StagedModel, dict[int, str], dict[int, set[str]]]:
        d = replace(tensor_decisions(t, "mop"), pure_stages=True)
        st = split_stages(t, d)
        groups = stage_groups(st, d.layout_of)
        return st, groups, _check_model(t, st, groups)

    staged, groups, sources = split(job.tp)
    staged_eval, groups_eval, sources_eval = split(job.tp_eval)
    job.refuse_sparse_features(staged)
    chunking, ordered, order_info = _chunking(graph, options)
    K = chunking.num_chunks
    reads = stage_reads(staged, groups, chunking, sources)
    reads_eval = stage_reads(staged_eval, groups_eval, chunking, sources_eval)
    all_dims, all_dims_eval = value_dims(staged.tp), value_dims(staged_eval.tp)
    dims = {c.value: all_dims[c.value] for c in staged.conversions}
    dims_eval = {c.value: all_dims_eval[c.value] for c in staged_eval.conversions}
    for v, (d, _) in {**dims, **dims_eval}.items():
        if len(d) != 1:
            raise PlanningError(f"strategy 'mop': value {v!r} has per-vertex shape {d}; only [V, D] values are "
                                "split by columns")

    place, place_eval = two.placement(groups), two.placement(groups_eval)
    # a step too large to plan is refused before it is scheduled (the messages do not depend on the order)
    count_messages(staged, place, chunking, reads, dims, set())
    count_messages(staged_eval, place_eval, chunking, reads_eval, dims_eval, set(), training=False)
    order = list_schedule(compute_deps(staged, K, reads), place.resource)
    order_eval = list_schedule(compute_deps(staged_eval, K, reads_eval, training=False), place_eval.resource)
    sizes = {r: _sizes(two, chunking, stats, r) for r in range(num_ranks)}
    train_progs = insert_messages(staged, order, place, chunking, reads, dims, set(), sizes=sizes)
    eval_progs = insert_messages(staged_eval, order_eval, place_eval, chunking, reads_eval, dims_eval, set())

    def stages_of(st: StagedModel, g: dict[int, str], rd: dict, which: str) -> tuple:
        return tuple(with_reads(s, rd.get(s.index, {}), which) for s in st.stages if g[s.index] == which)

    chunk_graphs: dict[int, Any] = {}
    if job.concrete:
        scales = propagation_scales(ordered, propagation_norms(job.tp, job.tp_eval))
        chunk_graphs = {j: chunk_graph(ordered, chunking, j, scales) for j in range(K)}
    ranks = []
    for r in range(num_ranks):
        which = "cols" if r in two.cols else "rows"
        step: dict[str, Any] = {}
        if which == "cols":
            if job.concrete:
                step = dict(inputs={}, chunk_inputs={j: {"g": chunk_graphs[j]} for j in range(K)}, halo=((), ()),
                            labels=None, masks={"train": None, "val": None, "test": None},
                            owned=torch.zeros(0, dtype=torch.long))
        elif job.concrete:
            step = _dense_step(job, two, chunking, two.rows.index(r))
        ranks.append(RankLowering(
            rank=r, stages=stages_of(staged, groups, reads, which), instructions=list(train_progs[r]), sizes=sizes[r],
            eval_stages=stages_of(staged_eval, groups_eval, reads_eval, which),
            eval_instructions=tuple(eval_progs[r]), step=step))
    info = {"sparse_ranks": list(two.cols), "dense_ranks": list(two.rows),
            "owned_rows": [ranks[r].sizes.nodes if r in two.rows else 0 for r in range(num_ranks)],
            "pipeline_lag": chunking.lag(), "task_order": [str(t) for _, t in order], **order_info}
    # parameters live on the dense group (one gradient all-reduce over it); FREE releases every
    # chunk after its last reader and its sends' completion
    return Lowered(staged=staged, staged_eval=staged_eval, ranks=ranks, grad_groups=[(two.rows, job.numel)],
                   schedule=Schedule("chunk pipeline", K, "list-scheduled"), info=info, options={"chunks": K},
                   frees=True, program=dict(groups=tuple(g for g in (two.rows, two.cols) if len(g) > 1)))


def _sizes(two: TwoGroups, chunking: Chunking, stats: GraphStats, r: int) -> RankSizes:
    """Rank ``r``'s sizes: a sparse rank aggregates every vertex on its share of the columns, a dense
    rank updates its rows of every chunk."""
    K = chunking.num_chunks
    if r in two.cols:
        return RankSizes(nodes=stats.num_nodes, edges=stats.num_edges, src=stats.num_nodes, all_nodes=stats.num_nodes,
                         col_share_ppm=round(1e6 / len(two.cols)), chunks=K, feature_rows=0, trains=0)
    i = two.rows.index(r)
    rows = sum(hi - lo for k in range(K) for lo, hi in [two.sub_rows(chunking, k)[i]])
    return RankSizes(nodes=rows, src=rows, chunks=K)


def _dense_step(job: Job, two: TwoGroups, chunking: Chunking, i: int) -> dict[str, Any]:
    """The step inputs of the ``i``-th dense rank: its rows of every chunk (in the reordered numbering)."""
    graph, K = job.graph, chunking.num_chunks
    per_chunk = [chunking.vertices(*two.sub_rows(chunking, k)[i]) for k in range(K)]
    chunk_inputs = {k: {"x": slice_rows(graph.x, ids) if graph.x is not None else None,
                        **{name: dropout_positions(sp, graph, ids) for name, sp in job.dropout_inputs.items()}}
                    for k, ids in enumerate(per_chunk)}
    return dict(inputs={}, chunk_inputs=chunk_inputs, halo=((), ()), **job.scored_rows(per_chunk))


STRATEGY = Strategy("mop", MopOptions, lower_mop, summary="MixGCN: mixture of parallelism on sparse and dense "
                    "device groups, chunk-pipelined", check=_check, dropout_spaces=lambda options: ("V", "nnz"),
                    row_mixing=("dense rank and chunk", "chunk"))
