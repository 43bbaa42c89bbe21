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
  a kind with more ranks than tasks (a decoupled model's one T task, its MLP) gets one group per
  task instead, its ranks spread by time and dealing the chunks round robin as in the hybrid regime
  (each member holds only its chunks' intermediates and dropout-mask rows). Without ``p_ranks``
  the split is Eq. 7's (P tasks at most one rank each: a P group's members would each receive the
  sources) or the one giving no kind more ranks than tasks, whichever has the smaller largest time
  per rank (the latter on a tie);
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

from ..cost_models.formulas import task_gpu_split
from ..cost_models.hardware import DEVICES
from ..errors import PlanningError
from ..graph.regroup import ChunkRegrouping
from ..ir.plan import Backward, Forward, RankSizes, Schedule
from ..ir.tpgraph import TPGraph
from .chunked import ChunkInputs, Chunking, Group, Placement, chunk_bounds, chunk_edge_ids, chunk_reads, \
    contiguous_runs, group_parameters, historical_reads, split_pipeline, stage_reads, stage_times, with_reads
from .driver import Job, Lowered, RankLowering
from .lower import Decisions, propagation_norms, requires_grad_values, source_input, value_dims
from .schedule import compute_deps, count_messages, insert_messages, list_schedule
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
    def space(cls, semantics: str, fixed: dict[str, Any],
              num_ranks: Optional[int] = None) -> list[dict[str, Any]]:
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


# --------------------------------------------------------------------------- placement
def _spread(times: list[float], ranks: int) -> list[int]:
    """Ranks per task (each at least one) so that the largest time per rank is smallest (greedy)."""
    counts = [1] * len(times)
    for _ in range(ranks - len(times)):
        i = max(range(len(times)), key=lambda k: (times[k] / counts[k], -k))
        counts[i] += 1
    return counts


def _kind_groups(stages: list[int], times: dict[int, float], ranks: int,
                 first: int) -> list[tuple[tuple[int, ...], list[int]]]:
    """The groups of one task kind on ``ranks`` ranks numbered from ``first``: ``(members, stages)``.
    Fewer ranks than tasks: contiguous runs of balanced time, one rank each (Algorithm 2); else one
    group per task, the ranks spread by time (hybrid groups dealing the chunks round robin)."""
    if ranks <= len(stages):
        return [((first + i,), stages[a:b]) for i, (a, b) in enumerate(contiguous_runs([times[s] for s in stages],
                                                                                       ranks))]
    out, rank = [], first
    for s, size in zip(stages, _spread([times[s] for s in stages], ranks)):
        out.append((tuple(range(rank, rank + size)), [s]))
        rank += size
    return out


def _bottleneck(t_st: list[int], p_st: list[int], times: dict[int, float], n_t: int, n_p: int) -> float:
    """The largest time per rank of a shared-regime placement with ``n_t`` T and ``n_p`` P ranks."""
    return max(sum(times[s] for s in run) / len(members)
               for sts, parts in ((t_st, n_t), (p_st, n_p)) for members, run in _kind_groups(sts, times, parts, 0))


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
        if p_ranks is None:
            # Eq. 7's split, or the one where no kind gets more ranks than tasks: whichever has the
            # smaller largest time per rank. Only T tasks get hybrid groups here (a P group's members
            # would each receive every source chunk they read: more traffic for the same rows)
            clamped = min(max(n_p, num_ranks - len(t_st)), len(p_st))
            eq7 = min(n_p, len(p_st))
            n_p = min((eq7, clamped), key=lambda q: (_bottleneck(t_st, p_st, times, num_ranks - q, q), q != clamped))
        n_t = num_ranks - n_p
        rank = 0
        for kind, sts, parts in (("T", t_st, n_t), ("P", p_st, n_p)):
            for members, run in _kind_groups(sts, times, parts, rank):
                for s in run:
                    stage_group[s] = len(groups)
                groups.append(Group(f"{kind}[{','.join(map(str, run))}]", members, "chunks"))
            rank += parts
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

    (staged, labels, sources), (staged_eval, labels_eval, sources_eval) = split_pipeline(job, task_decisions, "task",
                                                                                         "task")
    device = job.device
    if device is None:
        device = DEVICES["A100"]
    times = stage_times(staged, stats, device)
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
        inputs_read = {c.output for c in staged.conversions if c.value in ("x", *dropout_inputs)}
        chunking, reads, stale_reads = historical_reads(staged, labels, chunking, sources, inputs_read)
        if K > 1:
            relaxations.append("vertex dependency management (NeutronTask Algorithm 1): a chunk's propagation reads "
                               "later chunks from the previous step's copy")
    else:
        reads = stage_reads(staged, labels, chunking, sources)
    eval_chunking = exact_chunking if options.dependencies in ("cached", "regrouped") else chunking
    graph_chunking = eval_chunking  # what a chunk's graph slice holds (a cached read still has its edges)
    reads_eval = stage_reads(staged_eval, labels_eval, eval_chunking, sources_eval)
    dims = value_dims(staged.tp)
    dims_eval = value_dims(staged_eval.tp)
    needs = requires_grad_values(staged.tp)
    # a step too large to plan is refused before it is scheduled (the messages do not depend on the order)
    count_messages(staged, place, chunking, reads, dims, needs, stale=stale_reads)
    count_messages(staged_eval, place, eval_chunking, reads_eval, dims_eval, set(), training=False)
    # list-schedule with the tasks' per-chunk times
    cost = {t(s, k): times[s] / K / 2 for s in times for k in range(K) for t in (Forward, Backward)}
    order = list_schedule(compute_deps(staged, K, reads), place.resource, cost)
    order_eval = list_schedule(compute_deps(staged_eval, K, reads_eval, training=False), place.resource)
    train_progs = insert_messages(staged, order, place, chunking, reads, dims, needs, stale=stale_reads)
    eval_progs = insert_messages(staged_eval, order_eval, place, eval_chunking, reads_eval, dims_eval, set())

    # parameters: on the ranks of the task using them; all-reduced inside hybrid groups
    held, grad_groups = group_parameters(job, staged, place)

    out_group = place.stage_group[staged.stage_of[staged.output]]
    regrouping = None
    if concrete and regrouped:  # training inputs come per epoch; the program's are evaluation's
        regrouping = ChunkRegrouping(graph, chunk_bounds(graph.num_nodes, K * _subgraph_chunks(options)),
                                     graph_chunking.bounds, options.seed,
                                     tuple(sorted(propagation_norms(job.tp, job.tp_eval))))
    inputs = ChunkInputs(job, staged, staged_eval, graph_chunking, regrouping) if concrete else None
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
                              params=held[gi])
            step = inputs.rank(stages, eval_stages, mine, gi == out_group) if inputs is not None else {}
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
        "pipeline_lag": chunking.lag(), "regrouped": regrouped,
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


STRATEGY = Strategy("task", TaskOptions, lower_task, summary="NeutronTask: T and P tasks on separate ranks, "
                    "chunk-pipelined", row_mixing=("chunk", "chunk"), decouple_source="NeutronTask §5.1",
                    needs_device=True)
