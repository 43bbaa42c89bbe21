"""The ``layer`` strategy (GNNPipe): runs of consecutive layers on different ranks, chunks pipelined; exact.

GNNPipe §3.2–3.4: instead of cutting the graph over the GPUs (``data``), cut the *model*: each rank
holds a run of consecutive layers (a pipeline stage) for every vertex, and the vertices stream
through the stages in chunks, so that only a stage's last hidden state crosses ranks: ``2 (S - 1) N
H`` bytes per step for ``S`` stages whatever the graph (a model carrying more across a boundary,
GCNII's initial residual ``x0`` or a skip connection, sends those values too).

The model's operators are cut into tasks as :mod:`gnncompile.passes.task` cuts them (T ops, and
each propagation with its edge ops in a task of its own, so that a propagation's chunk ``j`` can
read the chunks its in-edges reach), but no task boundary converts anything: every rank holds whole
feature rows. The tasks, in model order, are cut into ``S`` = ranks contiguous runs of balanced
cost-model time (:func:`~gnncompile.passes.chunked.contiguous_runs`), one run per rank. The vertices
are cut into ``chunks`` contiguous chunks (default ``4 M`` for ``M`` ranks, GNNPipe's). Exact semantics: a chunk's
propagation waits for every chunk its in-edges read, computed this step (the dependency rule of
``task``); the step is list-scheduled (:mod:`gnncompile.passes.schedule`: forwards first, chunk by
chunk, GPipe-like), values crossing ranks move as point-to-point chunk messages, gradients back.
One step equals single-device training. Because a layer's propagation needs the previous layer on
every chunk its in-edges reach, exact mode mostly serializes the stages on a graph without
locality; GNNPipe's relaxed mode (historical embeddings) is what overlaps them.

Parameters live on the rank of the stage using them (a parameter shared by two stages is refused).
Refused with :class:`~gnncompile.errors.PlanningError`: more ranks than tasks, edge values crossing
stages, a propagation reading its source from its own task, row-mixing T ops under
``semantics="exact"``. Sparse input features stay sparse (each rank slices its chunks' rows).

``recompute=True`` checkpoints the T segments (:func:`~gnncompile.passes.recompute.insert_recomputation`).
A segment with several outputs (GraphSAGE's hidden state feeding both of the next layer's linear
maps, GCNII, ResGCN) returns a tuple read by ``getitem``; a tuple never crosses stages, so where
sinking a dense op would move such a ``getitem`` away from its segment, the tasks are cut without
sinking (:func:`~gnncompile.passes.chunked.split_pipeline`): every element then crosses as the value
it is (e.g. GraphSAGE's root term ``lin_r(h)`` instead of ``h`` read again by a later task).

Relaxed (``history=True``, ``semantics="relaxed"``, recorded in ``plan.relaxations``): GNNPipe's
historical embeddings (§3.3): a chunk's propagation reads the chunks computed this step fresh and
the later ones from the copy the reading rank kept of an earlier step (zeros before the first; the
runtime keeps one row per vertex), so chunk ``j`` of a stage waits only for chunks ``<= j`` of the
previous one and the stages overlap. GNNPipe's three techniques (§3.4): ``shuffle=True`` draws the
chunks' processing order again every step (seeded, the same on every rank; every slot then reads
every slot, :class:`~gnncompile.graph.regroup.ChunkRegrouping` with ``reads="all"``);
``history_refresh=a`` keeps each copy for ``a`` steps (fixed history, refreshed at the steps ``a,
2a, ...``); and no historical gradients: a stale read sends no gradient, unless
``historical_gradients=True`` (the ablation) adds what its readers computed to the chunk's gradient
of the next step. Evaluation reads every chunk fresh.

Chunks: ``chunking="contiguous"`` ranges of vertex ids, or ``"metis"``, GNNPipe's locality-aware
chunking: METIS parts of the graph, the vertices renumbered part by part (the plan keeps the
permutation: ``Chunking.order``; features, dropout masks and scored rows keep the original ids, so
exact plans stay exact), so that most in-edges stay inside their chunk and few reads are stale.

Hybrid with graph parallelism (§3.5, ``stages=S``): ``S`` groups of ``G = ranks / S`` consecutive
ranks, each group a stage; the graph is cut into ``G`` partitions (METIS, or vertex ranges) and
each partition into ``chunks / G`` chunks, numbered so that member ``i`` of every group runs
partition ``i``'s chunks (the members with the same index form a pure layer pipeline over their
partition). A chunk read across partitions inside a stage is sent by the member running it (the
graph communication, at chunk granularity), the parameter gradients are summed inside each group.
``G = 1`` is the pure layer pipeline; ``S = 1`` is chunked graph parallelism. Bytes: ``2 alpha_h L N
H + 2 (S - 1) N H`` (:func:`~gnncompile.cost_models.formulas.comm_layer_hybrid`) with ``alpha_h``
counted in whole chunks, plus the group's gradient all-reduce.

Schedules: the step is list-scheduled in GPipe's order (every forward first where dependencies
allow) or, with ``schedule="1f1b"``, a ready backward before a ready forward. Since a chunk's
backward waits for the backwards of the later chunks its in-edges reach, 1F1B reorders only the
dense tail of a run (e.g. the output layer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from ..cost_models.hardware import DEVICES
from ..errors import PlanningError
from ..graph.core import Graph
from ..graph.partition import partition
from ..graph.regroup import ChunkRegrouping
from ..graph.reorder import permute
from ..ir.plan import Backward, Forward, RankSizes, Schedule
from ..ir.tpgraph import TPGraph
from .chunked import ChunkInputs, Chunking, Group, Placement, chunk_bounds, chunk_edge_ids, chunk_reads, \
    contiguous_runs, group_parameters, historical_reads, split_pipeline, stage_reads, stage_times, with_reads
from .driver import Job, Lowered, RankLowering
from .lower import Decisions, propagation_norms, requires_grad_values, value_dims
from .schedule import compute_deps, count_messages, gpipe, insert_messages, list_schedule, one_f_one_b
from .strategy import ANY, Strategy, StrategyOptions, option, product
from .task import task_decisions

__all__ = ["LayerOptions", "CHUNKINGS", "SCHEDULES", "hybrid_chunking", "layer_decisions", "place_layers", "metis_chunking", "lower_layer", "STRATEGY"]

CHUNKINGS = ("contiguous", "metis")
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class LayerOptions(StrategyOptions):
    """Options of the ``layer`` strategy (``seed``, ``semantics``, ``dropout``: :class:`StrategyOptions`)."""

    strategy = "layer"

    chunks: Optional[int] = option(None, "Vertex chunks streamed through the stages (default: 4 per rank, "
                                         "GNNPipe's K = 4M).", kind="optional_positive_int", neutral=1, pinned=True,
                                   cli="vertex chunks streamed through the stages (default 4 per rank)")
    chunking: str = option("contiguous", "How the vertices are cut into chunks: 'contiguous' ranges of vertex ids, "
                                         "or 'metis' (GNNPipe's locality-aware chunking: METIS parts, the vertices "
                                         "renumbered part by part, so that most in-edges stay inside a chunk).",
                           kind="choice", choices=CHUNKINGS, neutral=ANY, pinned=True,
                           cli="contiguous vertex ranges, or metis parts (GNNPipe's locality-aware chunks)")
    stages: Optional[int] = option(None, "Pipeline stages S (GNNPipe's hybrid, §3.5): S groups of G = ranks / S "
                                         "ranks, each group a stage running graph parallelism over G partitions "
                                         "(member i of every group holds partition i, whose chunks it runs); "
                                         "default: one stage per rank (G = 1, pure layer pipelining).",
                                   kind="optional_positive_int", pinned=True,
                                   cli="pipeline stages S: S groups of ranks/S ranks (default: one stage per rank)")
    schedule: str = option("gpipe", "The pipeline's order: 'gpipe' (every forward before the backwards where "
                                    "dependencies allow) or '1f1b' (a ready backward before a ready forward). A "
                                    "chunk's backward waits for the backwards of the later chunks its in-edges "
                                    "reach, so 1F1B changes the order only where a run ends in dense ops.",
                           kind="choice", choices=SCHEDULES, pinned=True,
                           cli="gpipe, or 1f1b (a ready backward first)")
    recompute: bool = option(False, "Recompute T segments in backward instead of keeping their intermediates.",
                             kind="bool", pinned=True,
                             cli="recompute T segments in backward instead of keeping their intermediates")
    history: bool = option(False, "GNNPipe's historical embeddings (relaxed; needs semantics='relaxed'): a chunk's "
                                  "propagation reads the chunks not computed yet this step from their last stored "
                                  "copy (zeros before the first) and sends them no gradient, so the stages overlap.",
                           kind="bool", cli="historical embeddings for chunks not computed yet (GNNPipe; relaxed)")
    history_refresh: Optional[int] = option(None, "With history: the stored copies are refreshed every this many "
                                                  "steps (GNNPipe's fixed history, alpha; default 1: every step).",
                                            kind="optional_positive_int",
                                            cli="with --history: refresh the historical embeddings every N steps")
    shuffle: bool = option(False, "With history: GNNPipe's chunk shuffling, the chunks' processing order drawn again "
                                  "every step (seeded, the same on every rank), so that no chunk always reads more "
                                  "historical neighbours than another.", kind="bool", pinned=True,
                           cli="with --history: shuffle the chunks' processing order every step (GNNPipe)")
    historical_gradients: bool = option(False, "With history: the gradients to chunks read from history are added "
                                               "to those chunks' gradients of the next step instead of being "
                                               "dropped (GNNPipe drops them; this is its ablation).", kind="bool",
                                        pinned=True,
                                        cli="with --history: use historical gradients instead of dropping them")

    def check(self) -> None:
        if self.history and self.semantics == "exact":
            raise PlanningError("layer: history=True reads chunks not computed yet from earlier steps (a "
                                "relaxation); pass semantics='relaxed'")
        for name in ("history_refresh", "shuffle", "historical_gradients"):
            if getattr(self, name) not in (None, False) and not self.history:
                raise PlanningError(f"layer: {name} applies to history=True (historical embeddings)")

    @classmethod
    def space(cls, semantics: str, fixed: dict[str, Any],
              num_ranks: Optional[int] = None) -> list[dict[str, Any]]:
        history = [False, True] if semantics == "relaxed" else [False]
        # one stage per rank, and hybrids of up to 4 partitions per stage; 2 or 4 chunks per rank
        stages: list[Optional[int]] = [None]
        chunks: list[Optional[int]] = [None]
        if num_ranks is not None:
            stages += [num_ranks // g for g in (2, 4) if num_ranks % g == 0 and num_ranks // g >= 2]
            chunks.append(2 * num_ranks)
        return product({"recompute": [False, True], "history": history, "stages": stages, "chunks": chunks}, fixed,
                       semantics=semantics)


def layer_decisions(tp: TPGraph) -> Decisions:
    """:func:`~gnncompile.passes.task.task_decisions`' tasks without conversions: every value keeps
    whole feature rows, so a task boundary on one rank is only a stage boundary, and across ranks a
    chunk message of the value itself. Dense ops sink to the stage of their first user (GCNII's
    ``alpha * x0`` beside its layer: ``x0`` crosses, once per rank)."""
    return replace(task_decisions(tp), needs={}, sink=True)


def place_layers(times: dict[int, float], num_stages: int, group_size: int = 1) -> Placement:
    """One group of ``group_size`` consecutive ranks per run of consecutive tasks, the ``num_stages``
    runs balancing the tasks' times; a group deals whole chunks (member ``k mod G`` runs chunk ``k``)."""
    stages = sorted(times)
    if num_stages > len(stages):
        raise PlanningError(f"strategy 'layer': {num_stages} pipeline stages but the model has {len(stages)} tasks "
                            f"(T ops and propagations), at most one stage per task; use at most {len(stages)} "
                            "stages (stages=S with S groups of ranks/S ranks: GNNPipe's hybrid)")
    groups, stage_group = [], {}
    for r, (a, b) in enumerate(contiguous_runs([times[s] for s in stages], num_stages)):
        for s in stages[a:b]:
            stage_group[s] = r
        members = tuple(range(r * group_size, (r + 1) * group_size))
        groups.append(Group(f"L[{stages[a]}..{stages[b - 1]}]", members, "chunks"))
    return Placement(tuple(groups), stage_group)


def _induced(graph: Graph, ids: torch.Tensor) -> Graph:
    """The subgraph of ``graph`` induced by the vertices ``ids`` (renumbered ``0..len(ids)-1``)."""
    local = torch.full((graph.num_nodes,), -1, dtype=torch.int64)
    local[ids] = torch.arange(ids.numel())
    dst, src = local[graph.dst.cpu()], local[graph.indices.cpu()]
    keep = (dst >= 0) & (src >= 0)
    indptr = torch.zeros(ids.numel() + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(dst[keep], minlength=ids.numel()), 0, out=indptr[1:])
    order = torch.argsort(dst[keep], stable=True)
    return Graph(indptr, src[keep][order], int(ids.numel()), validate=False)


def hybrid_chunking(graph: Graph, parts: int, chunks: int, chunking: str, seed: int) -> tuple[Chunking, Graph]:
    """The chunks of GNNPipe's hybrid (§3.5): ``graph`` cut into ``parts`` partitions (METIS for
    ``chunking="metis"``, else contiguous vertex ranges), each cut into ``chunks / parts`` chunks
    (METIS parts of the partition, or contiguous ranges), numbered so that chunk ``k`` lies in
    partition ``k mod parts`` (the group member that runs it); the vertices are renumbered chunk by
    chunk. Returns the chunking and the renumbered graph."""
    n = graph.num_nodes
    if chunks % parts:
        raise PlanningError(f"layer: {chunks} chunks cannot be dealt evenly to groups of {parts} ranks; use a "
                            f"multiple of {parts}")
    per = chunks // parts
    if chunking == "metis":
        assign = torch.as_tensor(partition(graph, parts, "metis", seed=seed).parts, dtype=torch.int64)
        members = [torch.nonzero(assign == i).flatten() for i in range(parts)]
    else:
        b = chunk_bounds(n, parts)
        members = [torch.arange(b[i], b[i + 1]) for i in range(parts)]
    pieces: list[list[torch.Tensor]] = []
    for i, ids in enumerate(members):
        if ids.numel() < per:
            raise PlanningError(f"layer: partition {i} has {ids.numel()} vertices, fewer than its {per} chunks; use "
                                "fewer chunks")
        if chunking == "metis" and per > 1:
            sub = torch.as_tensor(partition(_induced(graph, ids), per, "metis", seed=seed).parts, dtype=torch.int64)
            got = [ids[sub == c] for c in range(per)]
            if any(p.numel() == 0 for p in got):
                raise PlanningError(f"layer: METIS left a chunk of partition {i} empty; use fewer chunks or "
                                    "chunking='contiguous'")
        else:
            cb = chunk_bounds(int(ids.numel()), per)
            got = [ids[cb[c]:cb[c + 1]] for c in range(per)]
        pieces.append(got)
    ordered_chunks = [pieces[k % parts][k // parts] for k in range(chunks)]
    order = torch.cat(ordered_chunks)
    bounds = [0]
    for c in ordered_chunks:
        bounds.append(bounds[-1] + int(c.numel()))
    renumbered = permute(graph, order)
    return Chunking(tuple(bounds), chunk_reads(renumbered, bounds), order), renumbered


def metis_chunking(graph: Graph, chunks: int, seed: int) -> tuple[Chunking, Graph]:
    """GNNPipe's locality-aware chunks: METIS parts of ``graph``, the vertices renumbered part by
    part (``Chunking.order``); returns the chunking and the renumbered graph. Raises
    :class:`PlanningError` when METIS leaves a part empty."""
    parts = torch.as_tensor(partition(graph, chunks, "metis", seed=seed).parts, dtype=torch.int64)
    sizes = torch.bincount(parts, minlength=chunks)
    if bool((sizes == 0).any()):
        raise PlanningError(f"layer: METIS left {int((sizes == 0).sum())} of {chunks} chunks empty on this "
                            f"{graph.num_nodes}-vertex graph; use fewer chunks or chunking='contiguous'")
    order = torch.argsort(parts, stable=True)
    bounds = (0, *torch.cumsum(sizes, 0).tolist())
    ordered = permute(graph, order)
    return Chunking(tuple(int(b) for b in bounds), chunk_reads(ordered, bounds), order), ordered


def _check(job: Job, options: LayerOptions) -> None:
    if job.num_ranks < 2:
        raise PlanningError(f"strategy 'layer' needs at least 2 ranks (stages on different ranks), got "
                            f"{job.num_ranks}")
    if options.stages is not None and job.num_ranks % options.stages:
        raise PlanningError(f"layer: {job.num_ranks} ranks cannot form {options.stages} equal stage groups; use a "
                            f"divisor of {job.num_ranks} for stages")
    if options.shuffle and options.stages is not None and options.stages < job.num_ranks:
        raise PlanningError("layer: chunk shuffling with the hybrid (stages < ranks) would move chunks between a "
                            "group's partitions every step, so every member would read every chunk; use it with one "
                            "stage per rank")


def lower_layer(job: Job, options: LayerOptions) -> Lowered:
    """The ``layer`` lowering of ``job`` (module docstring)."""
    graph, stats, n = job.graph, job.stats, job.num_ranks

    (staged, labels, sources), (staged_eval, labels_eval, sources_eval) = split_pipeline(job, layer_decisions, "layer")
    times = stage_times(staged, stats, job.device or DEVICES["A100"])
    S = options.stages if options.stages is not None else n
    G = n // S
    place = place_layers(times, S, G)
    K = options.chunks if options.chunks is not None else min(4 * n, stats.num_nodes)
    bounds = chunk_bounds(stats.num_nodes, K)
    ordered = graph
    if job.concrete and G > 1:
        chunking, ordered = hybrid_chunking(graph, G, K, options.chunking, options.seed)
    elif G > 1 and K % G:
        raise PlanningError(f"layer: {K} chunks cannot be dealt evenly to groups of {G} ranks; use a multiple of {G}")
    elif job.concrete and options.chunking == "metis":
        chunking, ordered = metis_chunking(graph, K, options.seed)
    elif job.concrete:
        chunking = Chunking(bounds, chunk_reads(graph, bounds))
    else:  # planned from statistics: every chunk reads every chunk (the worst case)
        chunking = Chunking(bounds, tuple(tuple(range(K)) for _ in range(K)))
    exact_chunking = chunking
    stale: dict[int, dict[str, tuple[tuple[int, ...], ...]]] = {}
    regrouping = None
    if options.history:
        if options.shuffle and K > 1:
            # the chunk in a slot changes every step: every slot reads every slot (the earlier ones
            # fresh, the later ones from history); a slot's graph slice holds its chunk's edges
            chunking = Chunking(chunking.bounds, tuple(tuple(range(K)) for _ in range(K)), chunking.order)
            if job.concrete:
                regrouping = ChunkRegrouping(graph, chunking.bounds, chunking.bounds, options.seed,
                                             tuple(sorted(propagation_norms(job.tp, job.tp_eval))), chunking.order,
                                             reads="all")
        chunking, reads, stale = historical_reads(staged, labels, chunking, sources, {"x", *job.dropout_inputs})
        if K > 1:
            job.relaxations.append(
                "historical embeddings (GNNPipe §3.3): a chunk's propagation reads the chunks not computed yet this "
                "step from their copy of an earlier step (zeros before the first), "
                + ("their gradients added to the next step's (historical gradients)" if options.historical_gradients
                   else "without gradient")
                + (f", refreshed every {options.history_refresh} steps" if (options.history_refresh or 1) > 1 else "")
                + ("; the chunks' processing order shuffled every step (chunk shuffling)" if regrouping is not None
                   or (options.shuffle and not job.concrete) else ""))
    else:
        reads = stage_reads(staged, labels, chunking, sources)
    reads_eval = stage_reads(staged_eval, labels_eval, exact_chunking, sources_eval)
    # a step too large to plan is refused before it is scheduled (the messages do not depend on the order)
    dims, dims_eval, needs = value_dims(staged.tp), value_dims(staged_eval.tp), requires_grad_values(staged.tp)
    count_messages(staged, place, chunking, reads, dims, needs, stale=stale)
    count_messages(staged_eval, place, exact_chunking, reads_eval, dims_eval, set(), training=False)
    cost = {t(s, k): times[s] / K / 2 for s in times for k in range(K) for t in (Forward, Backward)}
    order = list_schedule(compute_deps(staged, K, reads), place.resource, cost,
                          priority=one_f_one_b if options.schedule == "1f1b" else gpipe)
    order_eval = list_schedule(compute_deps(staged_eval, K, reads_eval, training=False), place.resource)
    train_progs = insert_messages(staged, order, place, chunking, reads, dims, needs, stale=stale)
    eval_progs = insert_messages(staged_eval, order_eval, place, exact_chunking, reads_eval, dims_eval, set())
    held, grad_groups = group_parameters(job, staged, place)

    out_group = place.stage_group[staged.stage_of[staged.output]]
    inputs = ChunkInputs(job, staged, staged_eval, exact_chunking, regrouping=regrouping,
                         ordered=ordered if exact_chunking.order is not None else None) if job.concrete else None
    ranks, owned_rows = [], [0] * n
    for gi, g in enumerate(place.groups):
        for i, r in enumerate(g.members):
            mine = [k for k in range(K) if k % G == i]  # member i holds partition i: its chunks
            runs = tuple(mine) if G > 1 else ()
            stages = tuple(replace(with_reads(s, reads.get(s.index, {}), g.name, stale.get(s.index)), runs=runs)
                           for s in staged.stages if place.stage_group[s.index] == gi)
            eval_stages = tuple(replace(with_reads(s, reads_eval.get(s.index, {}), g.name), runs=runs)
                                for s in staged_eval.stages if place.stage_group[s.index] == gi)
            propagates = any(labels[s.index] == "cols" for s in stages)
            reads_x = any(u == "x" for st in stages for u in st.inputs)
            rows = sum(exact_chunking.size(k) for k in mine)
            read = {m for k in mine for m in exact_chunking.reads[k]}
            edges = 0
            if propagates:
                edges = sum(int(chunk_edge_ids(graph, exact_chunking, k).numel()) for k in mine) \
                    if job.concrete else stats.num_edges // G
            sizes = RankSizes(nodes=rows, edges=edges, src=sum(exact_chunking.size(m) for m in read),
                              all_nodes=stats.num_nodes, chunks=K, feature_rows=rows if reads_x else 0,
                              trains=rows if gi == out_group else 0, params=held[gi])
            step = inputs.rank(stages, eval_stages, mine, gi == out_group) if inputs is not None else {}
            if step and options.history_refresh:
                step["history_refresh"] = options.history_refresh
            if step and options.historical_gradients:
                step["historical_gradients"] = True
            if gi == out_group:
                owned_rows[r] = rows
            ranks.append(RankLowering(rank=r, stages=stages, instructions=list(train_progs[r]), sizes=sizes,
                                      eval_stages=eval_stages, eval_instructions=tuple(eval_progs[r]), step=step))
    info = {
        "tasks": len(staged.stages), "groups": {g.name: list(g.members) for g in place.groups},
        "stage_seconds": {str(s): t for s, t in times.items()}, "task_order": [str(t) for _, t in order],
        "pipeline_lag": exact_chunking.lag(), "chunking": options.chunking,
        # chunk shuffling: every epoch's inputs are built in its step (ChunkRegrouping)
        "regrouped": bool(options.history and options.shuffle and K > 1),
        "chunk_rows": [exact_chunking.size(k) for k in range(K)],
        "owned_rows": owned_rows, "stages": S, "group_size": G,
    }
    # FREE releases each chunk after its last reader (and its sends' completion)
    return Lowered(staged=staged, staged_eval=staged_eval, ranks=ranks, grad_groups=grad_groups,
                   schedule=Schedule(("layer pipeline" if G == 1 else f"layer pipeline, {S} stages x {G} partitions")
                                     + (", 1F1B" if options.schedule == "1f1b" else ""),
                                     K, "list-scheduled"), info=info, options={"chunks": K, "stages": S},
                   frees=True, program=dict(groups=tuple(g.members for g in place.groups if len(g.members) > 1)))


STRATEGY = Strategy("layer", LayerOptions, lower_layer, summary="GNNPipe: runs of consecutive layers on separate "
                    "ranks, chunk-pipelined", check=_check, row_mixing=("chunk", "chunk"), needs_device=True)
