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
(:mod:`gnncompile.passes.chunked`): a chunk's output is sent (eager ``SEND``) as soon as it is
computed, so the next task's rank works on chunk ``k`` while this one computes chunk ``k + 1``.

Parameters live on the ranks of the task that uses them (``RankProgram.param_owner``).

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
from typing import Any, Optional, Union

import torch

from ..cost_models.formulas import task_gpu_split
from ..cost_models.hardware import DeviceSpec
from ..errors import PlanningError
from ..graph.core import Graph, GraphStats
from ..graph.regroup import ChunkRegrouping, RegroupedInputs
from ..graph.shard import dropout_positions, slice_rows
from ..ir.plan import AllReduce, DevicePlan, OptimizerStep, Plan, RankProgram
from ..ir.tpgraph import TPGraph
from .chunked import Chunking, Group, Placement, Task, chunk_bounds, chunk_edge_ids, chunk_graph, chunk_reads, \
    emit_programs, propagation_coefficients, stage_groups, stage_reads, with_reads
from .data import _propagation_norms, check_options, mask_counts, replicate_dropout_masks, \
    row_mixing_relaxations
from .free import insert_frees
from ..frontend.ops import dropout_rows
from .lower import Decisions, StagedModel, call_arguments, requires_grad_values, source_input, \
    split_stages
from .recompute import insert_recomputation

__all__ = ["TaskOptions", "task_decisions", "place_tasks", "lower_task"]

REGIMES = ("shared", "one per rank", "hybrid")
DEPENDENCIES = ("exact", "cached", "skip-later", "regrouped")


@dataclass(frozen=True)
class TaskOptions:
    """Options of the ``task`` strategy.

    ``seed``, ``semantics``, ``dropout`` as for :class:`~gnncompile.passes.data.DataOptions`.
    ``chunks``: vertex chunks streamed through the tasks (default: at least 4, a multiple of the
    group sizes, :func:`_default_chunks`). ``p_ranks``: ranks for the P tasks (NeutronTask Eq. 7's
    ``N_p``; default from the cost model).
    """

    seed: int = 0
    semantics: str = "exact"
    dropout: str = "replicated"
    chunks: Optional[int] = None
    p_ranks: Optional[int] = None
    #: task-decoupled training (NeutronTask §5.1, Fig. 8b): the ``decouple`` pass's model, every T
    #: task first, then the propagations, each its own P task; relaxed unless the model is linear
    decouple: bool = False
    #: recompute T segments in backward instead of keeping their intermediates (§5.1, Fig. 8c)
    recompute: bool = False
    #: ``"exact"``: a chunk's propagation waits for every chunk its in-edges read. Relaxed, so
    #: that the pipeline never waits for a chunk that is not computed yet (NeutronTask's vertex
    #: dependency management): ``"regrouped"`` is Algorithm 1 in full: before every epoch the
    #: ``chunks * subgraph_chunks`` base chunks are shuffled and regrouped into ``chunks``
    #: subgraphs (:mod:`gnncompile.graph.regroup`), a subgraph's propagation skips the in-edges from
    #: later subgraphs (an epoch trains on the graph of its kept edges, normalized over them), and
    #: evaluation reads every edge; ``"skip-later"`` skips the in-edges from
    #: later chunks of the fixed order every epoch; ``"cached"`` reads later chunks from the
    #: previous step's copy instead (zeros at the first step; no gradient flows to it)
    dependencies: str = "exact"
    #: ``dependencies="regrouped"``: base chunks per subgraph (Algorithm 1's ``k = M / S``;
    #: default 2)
    subgraph_chunks: Optional[int] = None

    def __post_init__(self) -> None:
        check_options(self.semantics, self.dropout, recompute=self.recompute, decouple=self.decouple)
        if self.dependencies not in DEPENDENCIES:
            raise PlanningError(f"task: dependencies must be one of {', '.join(DEPENDENCIES)}, got "
                                f"{self.dependencies!r}")
        if self.dependencies != "exact" and self.semantics == "exact":
            raise PlanningError(f"task: dependencies={self.dependencies!r} changes what a chunk's propagation reads "
                                "(a relaxation); pass semantics='relaxed'")
        if self.subgraph_chunks is not None and self.dependencies != "regrouped":
            raise PlanningError(f"task: subgraph_chunks applies to dependencies='regrouped' (random regrouping of "
                                f"chunks), not {self.dependencies!r}")
        for name in ("chunks", "p_ranks", "subgraph_chunks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise PlanningError(f"task: {name} must be a positive int, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": "task", "seed": self.seed, "semantics": self.semantics, "dropout": self.dropout,
                "chunks": self.chunks, "p_ranks": self.p_ranks, "decouple": self.decouple,
                "recompute": self.recompute, "dependencies": self.dependencies,
                "subgraph_chunks": self.subgraph_chunks}


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
    from ..cost_models.model import op_time

    sizes = {"nodes": stats.num_nodes, "edges": stats.num_edges, "src": stats.num_nodes,
             "all_nodes": stats.num_nodes, "halo": 0}
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
def lower_task(tp: TPGraph, tp_eval: TPGraph, model: torch.nn.Module, graph: Union[Graph, GraphStats],
               num_ranks: int, options: TaskOptions, device: Optional[DeviceSpec] = None) -> Plan:
    """Lower ``tp`` / ``tp_eval`` to a ``task`` plan over ``num_ranks`` ranks (module docstring).

    ``device``: the device whose cost model sets Eq. 7's split (default: an A100; the planner
    passes the cluster's)."""
    relaxations = row_mixing_relaxations(tp, "task", options.semantics, each="chunk", unit="chunk")
    if options.decouple:
        from .tensor import _decoupled

        tp, tp_eval, relaxation = _decoupled(tp, tp_eval, options.semantics, "task", "NeutronTask §5.1")
        if relaxation:
            relaxations.append(relaxation)
    concrete = isinstance(graph, Graph)
    stats = graph.stats() if concrete else graph
    dropout_inputs: dict[str, str] = {}
    if concrete and options.dropout == "replicated":
        tp, dropout_inputs = replicate_dropout_masks(tp, graph)
    infos = {n.name: n.meta["tp"] for n in tp.graph.nodes if "tp" in n.meta}
    if options.recompute:
        tp = insert_recomputation(tp, share_parameters=True)

    def split(t: TPGraph) -> tuple[StagedModel, dict[int, str], dict[int, set[str]]]:
        d = task_decisions(t)
        st = split_stages(t, d)
        labels = {s: ("rows" if lab == "rows" else "cols") for s, lab in stage_groups(st, d.layout_of).items()}
        return st, labels, _check_model(t, st, labels)

    staged, labels, sources = split(tp)
    staged_eval, labels_eval, sources_eval = split(tp_eval)
    if labels_eval != labels:
        raise PlanningError(f"strategy 'task': the evaluation model splits into other tasks ({labels_eval}) than "
                            f"the training model ({labels})")
    if concrete and graph.x is not None and graph.x.layout != torch.strided and \
            any(c.value == "x" for c in staged.conversions):
        raise PlanningError("strategy 'task': a propagation reads the sparse input features directly; densify them "
                            "(graph.dense_features()) or use strategy='data'")
    if device is None:
        from ..cost_models.hardware import DEVICES

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
    dims = _dims(staged)
    dims_eval = _dims(staged_eval)
    needs = requires_grad_values(staged.tp)
    # list-schedule with the tasks' per-chunk times
    cost = {Task(b, s, k): times[s] / K / 2 for s in times for k in range(K) for b in (False, True)}
    train_progs, order = emit_programs(staged, place, chunking, reads, dims, needs, training=True, cost=cost,
                                       stale=stale_reads)
    eval_progs, _ = emit_programs(staged_eval, place, eval_chunking, reads_eval, dims_eval, set(), training=False)

    # parameters: on the ranks of the task using them; all-reduced inside hybrid groups
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    by_name = dict(zip(names, params))
    param_dtype = str(params[0].dtype).replace("torch.", "") if params else "float32"
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
    owner = {n: place.groups[next(iter(gs))].members[0] for n, gs in users.items()}
    for gi, g in enumerate(place.groups):
        numel = sum(by_name[n].numel() for n in local[gi] if by_name[n].requires_grad)
        for r in g.members:
            if len(g.members) > 1 and numel:
                train_progs[r].append(AllReduce("grads", g.members, numel=numel, dtype=param_dtype))
            train_progs[r].append(OptimizerStep())

    out_group = place.stage_group[staged.stage_of[staged.output]]
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
            stages = tuple(replace(with_reads(s, reads.get(s.index, {}), g.name, stale_reads.get(s.index)),
                                   runs=tuple(mine) if len(g.members) > 1 else ()) for s in staged.stages
                           if place.stage_group[s.index] == gi)
            reads_x = any(u == "x" or u.startswith("x@") for st in stages for u in st.inputs)
            sizes = {"nodes": rows, "edges": edges, "halo": 0, "src": stats.num_nodes if is_p else rows,
                     "all_nodes": stats.num_nodes if is_p else rows, "chunks": max(len(mine), 1),
                     "feature_rows": (stats.num_nodes if is_p else rows) if reads_x else 0,
                     "trains": rows if gi == out_group else 0,
                     # the rank holds its own tasks' parameters (with their gradients and Adam moments)
                     "params": sum(by_name[n].numel() for n in local[gi] if by_name[n].requires_grad)}
            ranks.append(DevicePlan(rank=r, stages=stages, instructions=tuple(train_progs[r]), sizes=sizes,
                                    modules=staged.modules))
    ranks.sort(key=lambda dp: dp.rank)
    # release each stored value after its last use (and its sends' completion): without it every
    # cross-task tensor stays on both the producer and the consumer for the whole step
    ranks = insert_frees(ranks, keep={"g", "x", *dropout_inputs, staged.output})
    numel = sum(p.numel() for p in params if p.requires_grad)
    info = {
        "graph": str(stats), "model": type(model).__name__, "output": staged.output,
        # model inputs a propagation reads are given to its ranks directly (``x@cols``: rows of x)
        "inputs": ["g", "x", *dropout_inputs, *sorted({c.output for c in staged.conversions + staged_eval.conversions
                                                        if c.value in {"x", *dropout_inputs}})],
        "params": numel,
        "param_tensors": sum(1 for p in params if p.requires_grad), "param_dtype": param_dtype,
        "features": stats.num_features, "classes": stats.num_classes,
        "regime": regime, "t_ranks": n_t, "p_ranks": n_p, "tasks": len(staged.stages),
        "groups": {g.name: list(g.members) for g in place.groups},
        "task_seconds": {str(s): t for s, t in times.items()}, "task_order": [str(t) for _, t in order],
        "pipeline_lag": chunking.lag(),
        "owned_rows": [dp.sizes["nodes"] if place.stage_group.get(dp.stages[0].index) == out_group else 0
                       for dp in ranks],
        "halo_rows": [0] * num_ranks,
    }
    plan = Plan(strategy="task", semantics="relaxed" if relaxations else "exact",
                options={**options.to_dict(), "chunks": K, "p_ranks": n_p,
                         "subgraph_chunks": _subgraph_chunks(options) if regrouped else None},
                cluster=f"{num_ranks} local ranks",
                ranks=ranks, schedule=f"task pipeline ({regime}, {K} chunks, list-scheduled)",
                relaxations=tuple(relaxations), info=info)
    from ..ir.verify_plan import verify_plan

    report = verify_plan(plan, inputs=info["inputs"], check_types=False)  # gc.plan checks the chosen one fully
    plan.predictions = {"bytes_sent": [int(round(b)) for b in report.bytes_sent],
                        "bytes_received": [int(round(b)) for b in report.bytes_recv]}
    if concrete:
        plan.program = _rank_programs(graph, tp, tp_eval, staged, staged_eval, reads, reads_eval, eval_progs, ranks,
                                      place, graph_chunking, dropout_inputs, options, names, params, local, owner,
                                      out_group, infos)
    return plan


def _subgraph_chunks(options: TaskOptions) -> int:
    """Base chunks per subgraph under ``dependencies="regrouped"`` (default 2)."""
    return options.subgraph_chunks if options.subgraph_chunks is not None else 2


def _dims(staged: StagedModel) -> dict[str, tuple[tuple[int, ...], str]]:
    """Per-vertex shape and dtype of every value a stage reads or writes."""
    out = {}
    for n in staged.tp.graph.nodes:
        t = n.meta.get("tp")
        if t is not None and n.op != "get_attr":
            out[n.name] = (tuple(t.dims), t.dtype or "float32")
    return out


def _dropout_draws(staged: StagedModel, spaces: dict[str, str], infos: dict[str, Any]
                   ) -> tuple[tuple[int, int, tuple[int, ...], str, float], ...]:
    """Every replicated dropout of the training model in single-device order, as
    ``(stage, ordinal in stage, full shape, dtype, p)`` (``RankProgram.dropout_draws``); dropouts
    inside recomputed segments included (a replay in backward looks its mask up again at the same
    position, :class:`~gnncompile.passes.recompute.Recompute`). ``infos``: value name ->
    ``TPInfo`` of the model before recomputation (segment bodies carry none)."""
    from .recompute import Recompute

    out = []
    ordinal: dict[int, int] = {}
    modules = dict(staged.tp.named_modules())

    def visit(nodes: Any, stage_of: Any) -> None:
        for n in nodes:
            if n.op == "call_module" and isinstance(modules.get(n.target), Recompute):
                visit(modules[n.target].body.graph.nodes, lambda _: stage_of(n))
                continue
            if n.op != "call_function" or n.target is not dropout_rows:
                continue
            args = call_arguments(n)
            p = float(args["p"])
            if p == 0.0:
                continue  # draws nothing
            s = stage_of(n)
            k = ordinal.get(s, 0)
            ordinal[s] = k + 1
            x = args["x"]
            t = x.meta["tp"] if "tp" in x.meta else infos[x.name]
            index = args["index"]
            # a sparse input's mask is over its stored values (``nnz`` space): one draw per value
            per_row = () if spaces.get(getattr(index, "name", ""), "") == "nnz" else tuple(t.dims)
            out.append((s, k, (int(args["num_rows"]),) + per_row, t.dtype or "float32", p))

    visit(staged.tp.graph.nodes, lambda n: staged.stage_of[n.name])
    return tuple(out)


def _rank_programs(graph: Graph, tp: TPGraph, tp_eval: TPGraph, staged: StagedModel, staged_eval: StagedModel,
                   reads: dict, reads_eval: dict, eval_progs: dict, ranks: list[DevicePlan], place: Placement,
                   chunking: Chunking, dropout_inputs: dict[str, str], options: TaskOptions, names: list[str],
                   params: list[torch.nn.Parameter], local: dict[int, list[str]], owner: dict[str, int],
                   out_group: int, infos: dict[str, Any]) -> list[RankProgram]:
    counts = mask_counts(graph)
    K = chunking.num_chunks
    norms = _propagation_norms(tp) | _propagation_norms(tp_eval)
    edge_coef, loop_coef = propagation_coefficients(graph, norms)
    conv_out = {c.output: c.value for c in staged.conversions} | {c.output: c.value for c in staged_eval.conversions}
    model_inputs = {"x", *dropout_inputs}

    def block(name: str, k: int) -> Any:
        """Chunk ``k``'s block of the model input ``name`` (features or a dropout index)."""
        ids = torch.arange(chunking.bounds[k], chunking.bounds[k + 1])
        if name == "x":
            return slice_rows(graph.x, ids) if graph.x is not None else None
        return dropout_positions(dropout_inputs[name], graph, ids, chunk_edge_ids(graph, chunking, k))

    groups_list = tuple(g.members for g in place.groups if len(g.members) > 1)
    regrouping = None
    if options.dependencies == "regrouped":  # training inputs come per epoch; the program's are evaluation's
        regrouping = ChunkRegrouping(graph, chunk_bounds(graph.num_nodes, K * _subgraph_chunks(options)),
                                     chunking.bounds, options.seed, tuple(sorted(norms)))
    draws = _dropout_draws(staged, dropout_inputs, infos) if options.dropout == "replicated" else ()
    graphs: dict[int, Any] = {}
    programs = []
    n = len(ranks)
    for dp in ranks:
        r = dp.rank
        gi = next(i for i, g in enumerate(place.groups) if r in g.members)
        g = place.groups[gi]
        i = g.members.index(r)
        mine = [k for k in range(K) if i in g.runners(k)]
        eval_stages = tuple(replace(with_reads(s, reads_eval.get(s.index, {}), g.name),
                                    runs=tuple(mine) if len(g.members) > 1 else ()) for s in staged_eval.stages
                            if place.stage_group[s.index] == gi)
        chunk_inputs: dict[int, dict[str, Any]] = {}
        regroup = None
        if regrouping is not None:
            needs: dict[int, dict[str, str]] = {}
            for st in dp.stages:
                for u in st.inputs:
                    base = conv_out.get(u, u)
                    kind = "graph" if u == "g" else "features" if base == "x" else dropout_inputs.get(base)
                    for k in mine if kind is not None else ():
                        for m in st.chunks_read(u, k) if st.reads else (k,):
                            needs.setdefault(m, {})[u] = kind
            regroup = RegroupedInputs.for_rank(regrouping, needs, tuple(mine) if gi == out_group else ())
        for stages in (eval_stages,) if regroup is not None else (dp.stages, eval_stages):
            for st in stages:
                for u in st.inputs:
                    base = conv_out.get(u, u)
                    for k in mine:
                        for m in st.chunks_read(u, k) if st.reads else (k,):
                            d = chunk_inputs.setdefault(m, {})
                            if u == "g":
                                if m not in graphs:
                                    graphs[m] = chunk_graph(graph, chunking, m, edge_coef, loop_coef)
                                d["g"] = graphs[m]
                            elif base in model_inputs and u not in d:
                                d[u] = block(base, m)
        owned = torch.zeros(0, dtype=torch.long)
        offsets: tuple[int, ...] = ()
        labels = None
        masks: dict[str, Any] = {"train": None, "val": None, "test": None}
        if gi == out_group:
            per_chunk = [torch.arange(chunking.bounds[k], chunking.bounds[k + 1]) if k in mine
                         else torch.zeros(0, dtype=torch.long) for k in range(K)]
            owned = torch.cat(per_chunk)
            off = [0]
            for ids in per_chunk:
                off.append(off[-1] + int(ids.numel()))
            offsets = tuple(off)
            labels = graph.y[owned] if graph.y is not None else None
            masks = {m: (getattr(graph, f"{m}_mask")[owned] if getattr(graph, f"{m}_mask") is not None else None)
                     for m in ("train", "val", "test")}
        else:  # chunk offsets of a rank without rows to score: every chunk empty
            offsets = (0,) * (K + 1)
        programs.append(RankProgram(
            rank=r, world_size=n, modules=staged.modules, eval_modules=staged_eval.modules, output=staged.output,
            eval_output=staged_eval.output, instructions=dp.instructions, eval_instructions=tuple(eval_progs[r]),
            stages=dp.stages, eval_stages=eval_stages, same_seed=options.dropout == "replicated", halo=((), ()),
            counts=counts, params=params, param_names=names, groups=groups_list,
            param_rank=owner.get(names[0], 0) if names else 0, param_owner=dict(owner),
            local_params=tuple(local[gi]), dropout_draws=draws,
            chunk_rows=tuple(chunking.size(k) for k in range(K)), inputs={}, chunk_inputs=chunk_inputs,
            chunk_offsets=offsets, regroup=regroup,
            labels=labels, masks=masks, owned=owned))
    return programs
