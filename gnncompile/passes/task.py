"""The ``task`` strategy (NeutronTask): T tasks and P tasks on different GPUs, chunks pipelined; exact.

NeutronTask §4.1: instead of cutting the graph over the GPUs, place the *tasks* of each layer — the
dense NN work (T) and the graph propagation (P, with GAT's edge ops) — on different GPUs, and
stream the graph through them in chunks (§4.2, Fig. 5): a GPU holds only the intermediate data of
its own tasks and no neighbour replicas of another GPU's vertices.

Tasks are the stages of a split with one kind per stage (:mod:`gnncompile.passes.lower` with
``pure_stages``): T ops in ``rows`` stages, P and E ops in ``cols`` stages (the labels only decide
where stages end; every group here holds whole feature rows). With ``S`` tasks and ``n`` ranks, the
three regimes of §4.1:

- ``n < S`` (*shared*): ``N_p`` ranks run the P tasks and ``N_t = n - N_p`` the T tasks
  (NeutronTask Eq. 7–8, ``N_p = n T_p / (T_p + T_t)`` with ``T_t``, ``T_p`` the cost model's time
  of all T / P tasks on the cluster's device; ``p_ranks`` overrides it). Each kind's tasks are cut
  into contiguous runs of balanced time, one run per rank (Algorithm 2: GPUs ``< q`` run T tasks);
- ``n == S`` (*one task per rank*), in task order;
- ``n > S`` (*hybrid*, §4.3, Fig. 7): one group of ranks per task, ``N_t`` / ``N_p`` ranks spread
  over the T / P tasks in proportion to their time; inside a group the chunks are dealt round
  robin (chunk ``k`` runs on member ``k mod size``: data parallelism between chunks, NeutronTask
  sets the chunk count to a multiple of the group size) and the group's parameters are
  all-reduced over its members.

Chunks (§4.2): the vertices are cut into ``chunks`` contiguous ranges. A P task on chunk ``j``
reads the source rows of every chunk its in-edges reach (exact mode: it waits until each of them
was produced and received); T tasks read their own chunk. Tasks are list-scheduled
(:mod:`gnncompile.passes.schedule`): a chunk's output is sent (eager ``SEND``) as soon as it is
computed, so the next task's rank works on chunk ``k`` while this one computes chunk ``k + 1``.

Parameters live on the ranks of the task that uses them (``RankProgram.placement``).

Supported: GCN, GraphSAGE, GIN, GCNII, GAT (edge ops run with the propagation); chained
propagations (SGC, APPNP, decoupled models) are tasks of their own. Options: task-decoupled
training (``decouple``, §5.1, Fig. 8b) with recomputation of T segments in backward
(``recompute``, Fig. 8c); relaxed vertex dependency management (``dependencies``, Algorithm 1:
``"regrouped"`` chunks shuffled into subgraphs every epoch, :mod:`gnncompile.graph.regroup`;
``"skip-later"``; ``"cached"``). Refused with :class:`~gnncompile.errors.PlanningError`: edge
values crossing tasks (a decoupled GAT), a parameter shared by two tasks, row-mixing T ops under
``semantics="exact"``, sparse input features read by a propagation, fewer than 2 ranks.

Communication per step (§5.1): every task boundary moves each vertex's row once forward and once
backward (when it needs a gradient): ``(2L - 1) |V| d`` per direction for an ``L``-layer model
whose layers alternate T and P tasks, plus the hybrid groups' gradient all-reduces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from ..cost_models.formulas import task_gpu_split
from ..cost_models.hardware import DEVICES, DeviceSpec
from ..cost_models.model import op_time
from ..errors import PlanningError
from ..graph.core import Graph, GraphStats
from ..graph.regroup import ChunkRegrouping, RegroupedInputs
from ..graph.shard import dropout_positions, slice_rows
from ..ir.plan import Backward, Forward, RankSizes, Schedule
from ..ir.tpgraph import TPGraph
from .chunked import Chunking, Group, Placement, chunk_bounds, chunk_edge_ids, chunk_graph, chunk_reads, \
    propagation_coefficients, stage_groups, stage_reads, with_reads
from .driver import Job, Lowered, RankLowering
from .lower import Decisions, StagedModel, propagation_norms, requires_grad_values, source_input, split_stages, \
    value_dims
from .schedule import compute_deps, insert_messages, list_schedule
from .strategy import Strategy, StrategyOptions, option, product

__all__ = ["TaskOptions", "task_decisions", "place_tasks", "lower_task", "STRATEGY"]

REGIMES = ("shared", "one per rank", "hybrid")
DEPENDENCIES = ("exact", "cached", "skip-later", "regrouped")


@dataclass(frozen=True)
class TaskOptions(StrategyOptions):
    """Options of the ``task`` strategy (``seed``, ``semantics``, ``dropout``: :class:`StrategyOptions`)."""

    strategy = "task"

    chunks: Optional[int] = option(None, "Vertex chunks streamed through the tasks (default: at least 4, a multiple "
                                         "of the group sizes).", kind="optional_positive_int", neutral=1,
                                   cli="vertex chunks streamed through the tasks")
    p_ranks: Optional[int] = option(None, "Ranks for the P tasks (NeutronTask Eq. 7's N_p; default from the cost "
                                          "model).", kind="optional_positive_int",
                                    cli="ranks for the P tasks (default: from the cost model, NeutronTask Eq 7)")
    decouple: bool = option(False, "Task-decoupled training (NeutronTask §5.1, Fig. 8b): the decouple pass's model, "
                                   "every T task first, then the propagations, each its own P task; relaxed unless "
                                   "the model is linear.", kind="bool", pinned=True,
                            cli="decoupled model, all T ops then all propagations (NeutronTask §5.1; relaxed for "
                                "non-linear models)")
    recompute: bool = option(False, "Recompute T segments in backward instead of keeping their intermediates "
                                    "(NeutronTask §5.1, Fig. 8c).", kind="bool", pinned=True,
                             cli="recompute T segments in backward instead of keeping their intermediates")
    dependencies: str = option(
        "exact", "'exact': a chunk's propagation waits for every chunk its in-edges read. Relaxed (NeutronTask's "
                 "vertex dependency management; needs semantics='relaxed'): 'regrouped' is Algorithm 1 in full "
                 "(every epoch the chunks * subgraph_chunks base chunks are shuffled into chunks subgraphs, whose "
                 "propagations skip the in-edges from later subgraphs; evaluation reads every edge); 'skip-later' "
                 "skips the in-edges from later chunks of the fixed order; 'cached' reads later chunks from the "
                 "previous step's copy (zeros at the first step; no gradient flows to it).",
        kind="choice", choices=DEPENDENCIES,
        cli="exact, or relaxed (NeutronTask Algorithm 1): regrouped, skip-later or cached")
    subgraph_chunks: Optional[int] = option(None, "dependencies='regrouped': base chunks per subgraph (Algorithm "
                                                  "1's k = M / S; default 2).", kind="optional_positive_int",
                                            cli="with dependencies regrouped: chunks per subgraph (2 when not given)")

    def check(self) -> None:
        if self.dependencies != "exact" and self.semantics == "exact":
            raise PlanningError(f"task: dependencies={self.dependencies!r} changes what a chunk's propagation reads "
                                "(a relaxation); pass semantics='relaxed'")
        if self.subgraph_chunks is not None and self.dependencies != "regrouped":
            raise PlanningError(f"task: subgraph_chunks applies to dependencies='regrouped' (random regrouping of "
                                f"chunks), not {self.dependencies!r}")

    @classmethod
    def space(cls, semantics: str, fixed: dict[str, Any]) -> list[dict[str, Any]]:
        # task-decoupled training changes non-linear models: a candidate only where relaxations are allowed
        decouple = [False, True] if semantics == "relaxed" else [False]
        return product({"recompute": [False, True], "decouple": decouple}, fixed, semantics=semantics)


def task_decisions(tp: TPGraph) -> Decisions:
    """T ops labelled ``rows``, P and E ops ``cols``, one label per stage (stages become tasks).

    A propagation reading another propagation's output on its source side (chained propagations:
    decoupled models, SGC) starts a new task: it is labelled ``cols/1``, ``cols/2``... by chain depth,
    so that it reads every chunk of the previous one across the task boundary."""
    layout: dict[str, str] = {}
    needs: dict[tuple[str, str], str] = {}
    depth: dict[str, int] = {}
    for n in tp.graph.nodes:
        t = n.meta.get("tp")
        if t is None or t.kind not in ("T", "P", "E"):
            continue
        if t.kind in ("P", "E"):
            src = source_input(n)
            d = max((depth[p.name] for p in n.all_input_nodes if p.name in depth), default=0)
            if src is not None and src.name in depth:
                d = depth[src.name] + 1  # chained: a new task
            depth[n.name] = d
            layout[n.name] = "cols" if d == 0 else f"cols/{d}"
            for p in n.all_input_nodes:
                if p.name == "g" or p.op == "get_attr":
                    continue
                if not layout.get(p.name, "rows").startswith("cols"):
                    needs[(n.name, p.name)] = "cols"
        else:
            for p in n.all_input_nodes:
                if layout.get(p.name, "").startswith("cols"):
                    needs[(n.name, p.name)] = "rows"
    # a model ending in a propagation (decoupled models) computes its loss on the P task's ranks
    return Decisions(layout=layout, needs=needs, default_layout="rows", output_layout=None, pure_stages=True)


def _check_model(tp: TPGraph, staged: StagedModel, labels: dict[int, str]) -> dict[int, set[str]]:
    """Refusals of the module docstring; returns each P task's converted source inputs."""
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
            if name not in st.inputs:  # task_decisions starts a new task at every chained propagation
                raise PlanningError(f"strategy 'task': {op!r} reads {src.name!r} on the source side from inside its "
                                    "own task; its other chunks would not be computed yet")
            sources.setdefault(st.index, set()).add(name)
    producer = {o: s.index for s in staged.stages for o in s.outputs}
    for st in staged.stages:
        for u in st.inputs:
            node = nodes.get(u)
            info = node.meta.get("tp") if node is not None else None
            if u in producer and info is not None and getattr(info, "space", "V") != "V":
                raise PlanningError(f"strategy 'task': {u!r} ({info.space}-space: one value per edge) is computed in "
                                    f"task {producer[u]} and read in task {st.index}; edge values cannot cross tasks "
                                    "(per-chunk edge sets differ) — e.g. a decoupled GAT; use strategy='data'")
    return sources


# --------------------------------------------------------------------------- placement
def _runs(times: list[float], parts: int) -> list[tuple[int, int]]:
    """Cut ``times`` (in order) into ``parts`` contiguous non-empty runs minimizing the largest sum."""
    n = len(times)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    INF = math.inf
    best = [[INF] * (n + 1) for _ in range(parts + 1)]
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


def _spread(times: list[float], ranks: int) -> list[int]:
    """Ranks per task (each at least one) so that the largest time per rank is smallest (greedy)."""
    counts = [1] * len(times)
    for _ in range(ranks - len(times)):
        i = max(range(len(times)), key=lambda k: (times[k] / counts[k], -k))
        counts[i] += 1
    return counts


def place_tasks(labels: dict[int, str], times: dict[int, float], num_ranks: int,
                p_ranks: Optional[int] = None) -> tuple[Placement, str, tuple[int, int]]:
    """The groups of a ``task`` plan: ``(placement, regime, (N_t, N_p))`` (module docstring)."""
    stages = sorted(labels)
    S = len(stages)
    t_st = [s for s in stages if labels[s] == "rows"]
    p_st = [s for s in stages if labels[s] == "cols"]
    if num_ranks < 2:
        raise PlanningError(f"strategy 'task' needs at least 2 ranks (T and P tasks on different ranks), got "
                            f"{num_ranks}")
    if not p_st or not t_st:
        raise PlanningError("strategy 'task' needs a model with both T and P tasks")
    t_time, p_time = sum(times[s] for s in t_st), sum(times[s] for s in p_st)
    if p_ranks is not None:
        if not 1 <= p_ranks <= num_ranks - 1:
            raise PlanningError(f"task: p_ranks must be in 1..{num_ranks - 1} for {num_ranks} ranks, got {p_ranks}")
        n_t, n_p = num_ranks - p_ranks, p_ranks
    else:
        n_t, n_p = task_gpu_split(num_ranks, t_time, p_time)
    groups: list[Group] = []
    stage_group: dict[int, int] = {}
    if num_ranks < S:
        regime = "shared"
        # no kind gets more ranks than it has tasks
        n_p = min(max(n_p, num_ranks - len(t_st)), len(p_st))
        n_t = num_ranks - n_p
        rank = 0
        for kind, sts, parts in (("T", t_st, n_t), ("P", p_st, n_p)):
            for a, b in _runs([times[s] for s in sts], parts):
                for s in sts[a:b]:
                    stage_group[s] = len(groups)
                groups.append(Group(f"{kind}[{','.join(map(str, sts[a:b]))}]", (rank,), "chunks"))
                rank += 1
    else:
        regime = "one per rank" if num_ranks == S else "hybrid"
        n_p = min(max(n_p, len(p_st)), num_ranks - len(t_st))
        n_t = num_ranks - n_p
        size = dict(zip(t_st, _spread([times[s] for s in t_st], n_t)))
        size.update(zip(p_st, _spread([times[s] for s in p_st], n_p)))
        rank = 0
        for s in stages:
            stage_group[s] = len(groups)
            kind = "T" if labels[s] == "rows" else "P"
            groups.append(Group(f"{kind}[{s}]", tuple(range(rank, rank + size[s])), "chunks"))
            rank += size[s]
    return Placement(tuple(groups), stage_group), regime, (n_t, n_p)


def task_times(staged: StagedModel, stats: GraphStats, device: DeviceSpec) -> dict[int, float]:
    """Forward + backward seconds of every task on the whole graph (NeutronTask Eq. 5–6 through the
    cost model's per-op times)."""
    sizes = RankSizes(nodes=stats.num_nodes, edges=stats.num_edges, src=stats.num_nodes, all_nodes=stats.num_nodes)
    return {st.index: sum(op_time(op, sizes, device) + op_time(op, sizes, device, backward=True) for op in st.costs)
            for st in staged.stages}


def _default_chunks(place: Placement, num_nodes: int) -> int:
    """At least 4 chunks, a multiple of every group's size when that stays small (each rank of a
    group then gets as many chunks), else of the largest group's size."""
    sizes = [len(g.members) for g in place.groups]
    lcm = 1
    for t in sizes:
        lcm = lcm * t // math.gcd(lcm, t)
    base = lcm if lcm <= 4 * max(sizes) else max(sizes)
    return max(1, min(base * math.ceil(4 / base), num_nodes))


# --------------------------------------------------------------------------- lowering
def lower_task(job: Job, options: TaskOptions) -> Lowered:
    """The ``task`` lowering of ``job`` (module docstring).

    ``job.device``: the device whose cost model sets Eq. 7's split (default: an A100; the planner
    passes the cluster's)."""
    graph, stats, num_ranks = job.graph, job.stats, job.num_ranks
    concrete, dropout_inputs, relaxations = job.concrete, job.dropout_inputs, job.relaxations

    def split(t: TPGraph) -> tuple[StagedModel, dict[int, str], dict[int, set[str]]]:
        d = task_decisions(t)
        st = split_stages(t, d)
        labels = {s: ("rows" if lab == "rows" else "cols") for s, lab in stage_groups(st, d.layout_of).items()}
        return st, labels, _check_model(t, st, labels)

    staged, labels, sources = split(job.tp)
    staged_eval, labels_eval, sources_eval = split(job.tp_eval)
    if labels_eval != labels:
        raise PlanningError(f"strategy 'task': the evaluation model splits into other tasks ({labels_eval}) than "
                            f"the training model ({labels})")
    job.refuse_sparse_features(staged)
    device = job.device
    if device is None:
        device = DEVICES["A100"]
    times = task_times(staged, stats, device)
    place, regime, (n_t, n_p) = place_tasks(labels, times, num_ranks, options.p_ranks)
    K = options.chunks if options.chunks is not None else _default_chunks(place, stats.num_nodes)
    biggest = max(len(g.members) for g in place.groups)
    if K < biggest:
        raise PlanningError(f"task: {K} chunk(s) for a group of {biggest} ranks ({regime} regime) would leave ranks "
                            f"idle; use chunks >= {biggest} (a multiple of the group sizes balances them)")
    bounds = chunk_bounds(stats.num_nodes, K)
    if concrete:
        chunking = Chunking(bounds, chunk_reads(graph, bounds))
    else:  # planned from statistics: every chunk reads every chunk (the worst case)
        chunking = Chunking(bounds, tuple(tuple(range(K)) for _ in range(K)))
    exact_chunking = chunking
    regrouped = options.dependencies == "regrouped"
    if regrouped:
        # subgraph j of an epoch's order reads subgraphs 0..j; which vertices they hold changes
        # every epoch, so the program reads all of them (a chunk's graph slice has the edges)
        base = K * _subgraph_chunks(options)
        if base > stats.num_nodes:
            raise PlanningError(f"task: {K} subgraphs of {_subgraph_chunks(options)} chunks need {base} base chunks, "
                                f"more than the graph's {stats.num_nodes} vertices")
        chunking = Chunking(bounds, tuple(tuple(range(j + 1)) for j in range(K)))
        if K > 1:
            relaxations.append(f"vertex dependency management (NeutronTask Algorithm 1): every epoch {base} chunks are "
                               f"shuffled into {K} subgraphs, whose propagations skip in-edges from later subgraphs "
                               "(an epoch trains on the graph of its kept edges); evaluation reads every edge")
    if options.dependencies == "skip-later":
        chunking = Chunking(bounds, tuple(tuple(k for k in r if k <= j) for j, r in enumerate(chunking.reads)))
        if K > 1:
            relaxations.append("vertex dependency management (NeutronTask Algorithm 1): a chunk's propagation skips "
                               "in-edges from later chunks")
    stale_reads: dict[int, dict[str, tuple[tuple[int, ...], ...]]] = {}
    if options.dependencies == "cached":
        fresh = Chunking(bounds, tuple(tuple(k for k in r if k <= j) for j, r in enumerate(chunking.reads)))
        later = tuple(tuple(k for k in r if k > j) for j, r in enumerate(chunking.reads))
        inputs_read = {c.output for c in staged.conversions if c.value in ("x", *dropout_inputs)}
        stale_reads = {s: {u: later for u in per if u not in inputs_read}
                       for s, per in stage_reads(staged, labels, chunking, sources).items()}
        if K > 1:
            relaxations.append("vertex dependency management (NeutronTask Algorithm 1): a chunk's propagation reads "
                               "later chunks from the previous step's copy")
        chunking = fresh
    reads = stage_reads(staged, labels, chunking, sources)
    if options.dependencies == "cached":
        for s_, per in stage_reads(staged, labels, exact_chunking, sources).items():
            for u, rd in per.items():  # model inputs are always there: read every chunk fresh
                if u not in stale_reads.get(s_, {}):
                    reads[s_][u] = rd
    eval_chunking = exact_chunking if options.dependencies in ("cached", "regrouped") else chunking
    graph_chunking = eval_chunking  # what a chunk's graph slice holds (a cached read still has its edges)
    reads_eval = stage_reads(staged_eval, labels_eval, eval_chunking, sources_eval)
    dims = value_dims(staged.tp)
    dims_eval = value_dims(staged_eval.tp)
    needs = requires_grad_values(staged.tp)
    # list-schedule with the tasks' per-chunk times
    cost = {t(s, k): times[s] / K / 2 for s in times for k in range(K) for t in (Forward, Backward)}
    order = list_schedule(compute_deps(staged, K, reads), place.resource, cost)
    order_eval = list_schedule(compute_deps(staged_eval, K, reads_eval, training=False), place.resource)
    train_progs = insert_messages(staged, order, place, chunking, reads, dims, needs, stale=stale_reads)
    eval_progs = insert_messages(staged_eval, order_eval, place, eval_chunking, reads_eval, dims_eval, set())

    # parameters: on the ranks of the task using them; all-reduced inside hybrid groups
    names, params = job.param_names, job.params
    by_name = dict(zip(names, params))
    users: dict[str, set[int]] = {}
    ident = {id(p): n for n, p in zip(names, params)}  # stage modules share the model's parameters
    for s, mod in staged.modules.items():
        for _, p in mod.named_parameters():
            if id(p) in ident:
                users.setdefault(ident[id(p)], set()).add(place.stage_group[s])
    for n, gs in users.items():
        if len(gs) > 1:
            raise PlanningError(f"strategy 'task': parameter {n!r} is used by tasks on different ranks "
                                f"({', '.join(place.groups[g].name for g in sorted(gs))}); shared parameters are not "
                                "supported")
    local: dict[int, list[str]] = {gi: sorted(n for n, gs in users.items() if gi in gs)
                                   for gi in range(len(place.groups))}
    grad_groups = [(g.members, sum(by_name[n].numel() for n in local[gi] if by_name[n].requires_grad))
                   for gi, g in enumerate(place.groups)]

    out_group = place.stage_group[staged.stage_of[staged.output]]
    inputs = _ChunkInputs(job, staged, staged_eval, graph_chunking, options) if concrete else None
    ranks = []
    for gi, g in enumerate(place.groups):
        is_p = any(labels[s] == "cols" for s, x in place.stage_group.items() if x == gi)
        for i, r in enumerate(g.members):
            mine = [k for k in range(K) if i in g.runners(k)]
            rows = sum(chunking.size(k) for k in mine)
            edges = 0
            if concrete and is_p:
                edges = sum(int(chunk_edge_ids(graph, chunking, k).numel()) for k in mine)
            elif is_p:
                edges = round(stats.num_edges * rows / max(stats.num_nodes, 1))
            runs = tuple(mine) if len(g.members) > 1 else ()
            stages = tuple(replace(with_reads(s, reads.get(s.index, {}), g.name, stale_reads.get(s.index)),
                                   runs=runs) for s in staged.stages if place.stage_group[s.index] == gi)
            eval_stages = tuple(replace(with_reads(s, reads_eval.get(s.index, {}), g.name), runs=runs)
                                for s in staged_eval.stages if place.stage_group[s.index] == gi)
            reads_x = any(u == "x" or u.startswith("x@") for st in stages for u in st.inputs)
            sizes = RankSizes(nodes=rows, edges=edges, src=stats.num_nodes if is_p else rows,
                              all_nodes=stats.num_nodes if is_p else rows, chunks=max(len(mine), 1),
                              feature_rows=(stats.num_nodes if is_p else rows) if reads_x else 0,
                              trains=rows if gi == out_group else 0,
                              # the rank holds its own tasks' parameters (with their gradients and Adam moments)
                              params=sum(by_name[n].numel() for n in local[gi] if by_name[n].requires_grad))
            step: dict[str, Any] = {}
            if inputs is not None:
                step = dict(inputs.rank(stages, eval_stages, mine, gi == out_group),
                            chunk_rows=tuple(chunking.size(k) for k in range(K)))
            ranks.append(RankLowering(rank=r, stages=stages, instructions=list(train_progs[r]), sizes=sizes,
                                      eval_stages=eval_stages, eval_instructions=tuple(eval_progs[r]), step=step))
    ranks.sort(key=lambda rl: rl.rank)
    info = {
        # model inputs a propagation reads are given to its ranks directly (``x@cols``: rows of x)
        "inputs": ["g", "x", *dropout_inputs, *sorted({c.output for c in staged.conversions + staged_eval.conversions
                                                        if c.value in {"x", *dropout_inputs}})],
        "regime": regime, "t_ranks": n_t, "p_ranks": n_p, "tasks": len(staged.stages),
        "groups": {g.name: list(g.members) for g in place.groups},
        "task_seconds": {str(s): t for s, t in times.items()}, "task_order": [str(t) for _, t in order],
        "pipeline_lag": chunking.lag(),
        "owned_rows": [rl.sizes.nodes if place.stage_group.get(rl.stages[0].index) == out_group else 0
                       for rl in ranks],
    }
    program = dict(groups=tuple(g.members for g in place.groups if len(g.members) > 1)) if concrete else {}
    # FREE releases each stored value after its last use (and its sends' completion): without it
    # every cross-task tensor stays on both the producer and the consumer for the whole step
    return Lowered(staged=staged, staged_eval=staged_eval, ranks=ranks, grad_groups=grad_groups,
                   schedule=Schedule("task pipeline", K, "list-scheduled", regime), info=info,
                   options={"chunks": K, "p_ranks": n_p,
                            "subgraph_chunks": _subgraph_chunks(options) if regrouped else None},
                   frees=True, program=program)


def _subgraph_chunks(options: TaskOptions) -> int:
    """Base chunks per subgraph under ``dependencies="regrouped"`` (default 2)."""
    return options.subgraph_chunks if options.subgraph_chunks is not None else 2


class _ChunkInputs:
    """The step inputs of a concrete ``task`` plan's ranks: per chunk, the graph slice and the blocks
    of the model inputs its stages read; under ``dependencies="regrouped"`` the training inputs
    come per epoch (:class:`~gnncompile.graph.regroup.RegroupedInputs`)."""

    def __init__(self, job: Job, staged: StagedModel, staged_eval: StagedModel, chunking: Chunking,
                 options: TaskOptions) -> None:
        self.job, self.chunking = job, chunking
        graph = job.graph
        K = chunking.num_chunks
        norms = propagation_norms(job.tp, job.tp_eval)
        self.coefficients = propagation_coefficients(graph, norms)
        self.conv_out = {c.output: c.value for c in staged.conversions} | \
            {c.output: c.value for c in staged_eval.conversions}
        self.model_inputs = {"x", *job.dropout_inputs}
        self.regrouping = None
        if options.dependencies == "regrouped":  # training inputs come per epoch; the program's are evaluation's
            self.regrouping = ChunkRegrouping(graph, chunk_bounds(graph.num_nodes, K * _subgraph_chunks(options)),
                                              chunking.bounds, options.seed, tuple(sorted(norms)))
        self.graphs: dict[int, Any] = {}

    def block(self, name: str, k: int) -> Any:
        """Chunk ``k``'s block of the model input ``name`` (features or a dropout index)."""
        graph, chunking = self.job.graph, self.chunking
        ids = torch.arange(chunking.bounds[k], chunking.bounds[k + 1])
        if name == "x":
            return slice_rows(graph.x, ids) if graph.x is not None else None
        return dropout_positions(self.job.dropout_inputs[name], graph, ids, chunk_edge_ids(graph, chunking, k))

    def rank(self, stages: tuple, eval_stages: tuple, mine: list[int], scores: bool) -> dict[str, Any]:
        """The step inputs of a rank running ``stages`` on the chunks ``mine`` (``scores``: it computes
        the output, so it holds the labels and masks of its chunks' rows)."""
        job, chunking, graph = self.job, self.chunking, self.job.graph
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
                                    self.graphs[m] = chunk_graph(graph, chunking, m, *self.coefficients)
                                d["g"] = self.graphs[m]
                            elif base in self.model_inputs and u not in d:
                                d[u] = self.block(base, m)
        out: dict[str, Any] = dict(inputs={}, chunk_inputs=chunk_inputs, regroup=regroup, halo=((), ()),
                                   owned=torch.zeros(0, dtype=torch.long), labels=None,
                                   masks={"train": None, "val": None, "test": None},
                                   chunk_offsets=(0,) * (K + 1))  # a rank without rows to score: every chunk empty
        if scores:
            per_chunk = [torch.arange(chunking.bounds[k], chunking.bounds[k + 1]) if k in mine
                         else torch.zeros(0, dtype=torch.long) for k in range(K)]
            out.update(job.scored_rows(per_chunk))
        return out


STRATEGY = Strategy("task", TaskOptions, lower_task, summary="NeutronTask: T and P tasks on separate ranks, "
                    "chunk-pipelined", row_mixing=("chunk", "chunk"), decouple_source="NeutronTask §5.1",
                    needs_device=True)
