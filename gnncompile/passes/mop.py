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
point-to-point messages per chunk (:mod:`gnncompile.passes.chunked`). Parameters live on the dense
group (one gradient all-reduce over it); the sparse group holds no parameters.

Supported: models whose propagations aggregate element-wise and read a value the dense group
computes (GCN, GraphSAGE, GIN, GCNII). Refused with :class:`~gnncompile.errors.PlanningError`:
edge-wise ops (attention: MixGCN §5 names it a limitation of MoP), chained propagations without a
T op between them (APPNP, SGC, decoupled models: a propagation reading another's output), a model
whose output is a propagation, recomputation, sparse input features read by a propagation.

Communication per step: every conversion moves each vertex's row once between the groups per
direction, ``|V| x D`` elements (MixGCN Proposition 3.4: ``O(|V|)``, independent of the number of
devices), forward and backward when the value needs a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch

from ..errors import PlanningError
from ..graph.core import Graph, GraphStats
from ..graph.reorder import bandwidth, permute, rcm_order
from ..graph.shard import dropout_positions, slice_rows
from ..ir.plan import AllReduce, DevicePlan, OptimizerStep, Plan, RankProgram, converted_name
from ..ir.tpgraph import TPGraph
from .chunked import Chunking, Group, Placement, chunk_bounds, chunk_graph, chunk_reads, emit_programs, \
    propagation_coefficients, stage_groups, stage_reads, with_reads
from .data import _propagation_norms, check_options, mask_counts, replicate_dropout_masks, \
    row_mixing_relaxations
from .lower import StagedModel, requires_grad_values, source_input, split_stages
from .tensor import _dims, tensor_decisions

__all__ = ["MopOptions", "lower_mop", "REORDERINGS"]

REORDERINGS = ("none", "rcm")


@dataclass(frozen=True)
class MopOptions:
    """Options of the ``mop`` strategy.

    ``chunks``: pipeline granularity (vertex chunks streamed between the groups; 1: the naive
    MoA workflow of Fig. 5a). ``sparse_ranks``: ranks of the aggregation (P) group, the rest update
    (T); default half (MixGCN pairs one sparse with one dense accelerator). ``reorder``: ``"rcm"``
    renumbers vertices by reverse Cuthill–McKee before chunking. ``seed``, ``semantics``,
    ``dropout`` as for :class:`~gnncompile.passes.data.DataOptions`.
    """

    seed: int = 0
    semantics: str = "exact"
    dropout: str = "replicated"
    chunks: int = 1
    sparse_ranks: Optional[int] = None
    reorder: str = "none"

    def __post_init__(self) -> None:
        check_options(self.semantics, self.dropout)
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise PlanningError(f"mop: chunks must be a positive integer, got {self.chunks!r}")
        if self.sparse_ranks is not None and (not isinstance(self.sparse_ranks, int) or self.sparse_ranks < 1):
            raise PlanningError(f"mop: sparse_ranks must be a positive integer, got {self.sparse_ranks!r}")
        if self.reorder not in REORDERINGS:
            raise PlanningError(f"mop: unknown reorder {self.reorder!r}; valid: {', '.join(REORDERINGS)}")

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": "mop", "seed": self.seed, "semantics": self.semantics, "dropout": self.dropout,
                "chunks": self.chunks, "sparse_ranks": self.sparse_ranks, "reorder": self.reorder}


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
    for n in tp.graph.nodes:
        t = n.meta.get("tp")
        if t is not None and t.kind == "E":
            raise PlanningError(f"strategy 'mop' does not support edge-wise op {n.name!r}: MixGCN's MoP aggregates "
                                "element-wise only (attention needs whole rows per edge, MixGCN §5); use strategy="
                                "'tensor' or 'data'")
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
    if out in staged.stage_of and groups[staged.stage_of[out]] != "rows":
        raise PlanningError("strategy 'mop': the model's output is a propagation; not supported yet (use 'tensor')")
    return sources


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


def lower_mop(tp: TPGraph, tp_eval: TPGraph, model: torch.nn.Module, graph: Union[Graph, GraphStats],
              num_ranks: int, options: MopOptions) -> Plan:
    """Lower ``tp`` / ``tp_eval`` to a ``mop`` plan over ``num_ranks`` ranks (module docstring)."""
    two = _groups(num_ranks, options)
    relaxations = row_mixing_relaxations(tp, "mop", options.semantics, each="dense rank and chunk", unit="chunk")
    concrete = isinstance(graph, Graph)
    stats = graph.stats() if concrete else graph
    dropout_inputs: dict[str, str] = {}
    if concrete and options.dropout == "replicated":
        tp, dropout_inputs = replicate_dropout_masks(tp, graph, "mop", ("V", "nnz"))

    def split(t: TPGraph) -> tuple[StagedModel, dict[int, str], dict[int, set[str]]]:
        d = replace(tensor_decisions(t), pure_stages=True)
        st = split_stages(t, d)
        groups = stage_groups(st, d.layout_of)
        return st, groups, _check_model(t, st, groups)

    staged, groups, sources = split(tp)
    staged_eval, groups_eval, sources_eval = split(tp_eval)
    if concrete and graph.x is not None and graph.x.layout != torch.strided and \
            any(c.value == "x" for c in staged.conversions):
        raise PlanningError("strategy 'mop': a propagation reads the sparse input features directly; densify them "
                            "(graph.dense_features()) or use strategy='data'")
    chunking, ordered, order_info = _chunking(graph, options)
    K = chunking.num_chunks
    reads = stage_reads(staged, groups, chunking, sources)
    reads_eval = stage_reads(staged_eval, groups_eval, chunking, sources_eval)
    dims = {c.value: _dims(staged.tp, c.value) for c in staged.conversions}
    dims_eval = {c.value: _dims(staged_eval.tp, c.value) for c in staged_eval.conversions}
    for v, (d, _) in {**dims, **dims_eval}.items():
        if len(d) != 1:
            raise PlanningError(f"strategy 'mop': value {v!r} has per-vertex shape {d}; only [V, D] values are "
                                "split by columns")

    train_progs, order = emit_programs(staged, two.placement(groups), chunking, reads, dims, set(), training=True)
    eval_progs, _ = emit_programs(staged_eval, two.placement(groups_eval), chunking, reads_eval, dims_eval, set(),
                                  training=False)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    numel = sum(p.numel() for p in params if p.requires_grad)
    param_dtype = str(params[0].dtype).replace("torch.", "") if params else "float32"
    for r in two.rows:
        if len(two.rows) > 1 and numel:
            train_progs[r].append(AllReduce("grads", two.rows, numel=numel, dtype=param_dtype))
    for r in range(num_ranks):
        train_progs[r].append(OptimizerStep())

    def stages_of(st: StagedModel, g: dict[int, str], rd: dict, which: str) -> tuple:
        return tuple(with_reads(s, rd.get(s.index, {}), which) for s in st.stages if g[s.index] == which)

    ranks = []
    for r in range(num_ranks):
        which = "cols" if r in two.cols else "rows"
        if which == "cols":
            sizes = {"nodes": stats.num_nodes, "edges": stats.num_edges, "halo": 0, "src": stats.num_nodes,
                     "all_nodes": stats.num_nodes, "col_share_ppm": round(1e6 / len(two.cols)), "chunks": K,
                     "feature_rows": 0, "trains": 0}
        else:
            i = two.rows.index(r)
            rows = sum(hi - lo for k in range(K) for lo, hi in [two.sub_rows(chunking, k)[i]])
            sizes = {"nodes": rows, "edges": 0, "halo": 0, "src": rows, "chunks": K}
        ranks.append(DevicePlan(rank=r, stages=stages_of(staged, groups, reads, which),
                                instructions=tuple(train_progs[r]), sizes=sizes, modules=staged.modules))
    lag = chunking.lag()
    info = {
        "graph": str(stats), "model": type(model).__name__, "output": staged.output,
        "inputs": ["g", "x", *dropout_inputs], "params": numel,
        "param_tensors": sum(1 for p in params if p.requires_grad), "param_dtype": param_dtype,
        "features": stats.num_features, "classes": stats.num_classes,
        "sparse_ranks": list(two.cols), "dense_ranks": list(two.rows),
        "owned_rows": [ranks[r].sizes["nodes"] if r in two.rows else 0 for r in range(num_ranks)],
        "halo_rows": [0] * num_ranks,
        "pipeline_lag": lag, "task_order": [str(t) for _, t in order], **order_info,
    }
    plan = Plan(strategy="mop", semantics="relaxed" if relaxations else "exact",
                options={**options.to_dict(), "chunks": K}, cluster=f"{num_ranks} local ranks", ranks=ranks,
                schedule=f"chunk pipeline ({K} chunks, list-scheduled)", relaxations=tuple(relaxations), info=info)
    from ..ir.verify_plan import verify_plan

    report = verify_plan(plan, inputs=info["inputs"], check_types=False)  # gc.plan checks the chosen one fully
    plan.predictions = {"bytes_sent": [int(round(b)) for b in report.bytes_sent],
                        "bytes_received": [int(round(b)) for b in report.bytes_recv]}
    if concrete:
        plan.program = _rank_programs(graph, ordered, tp, tp_eval, staged, staged_eval, groups, groups_eval, reads,
                                      reads_eval, eval_progs, ranks, two, chunking, dropout_inputs, options, names,
                                      params, stages_of)
    return plan


def _rank_programs(graph: Graph, ordered: Graph, tp: TPGraph, tp_eval: TPGraph, staged: StagedModel,
                   staged_eval: StagedModel, groups: dict, groups_eval: dict, reads: dict, reads_eval: dict,
                   eval_progs: dict, ranks: list[DevicePlan], two: TwoGroups, chunking: Chunking,
                   dropout_inputs: dict[str, str], options: MopOptions, names: list[str],
                   params: list[torch.nn.Parameter], stages_of: Any) -> list[RankProgram]:
    counts = mask_counts(graph)
    K = chunking.num_chunks
    norms = _propagation_norms(tp) | _propagation_norms(tp_eval)
    edge_coef, loop_coef = propagation_coefficients(ordered, norms)
    chunk_graphs = {j: chunk_graph(ordered, chunking, j, edge_coef, loop_coef) for j in range(K)}
    groups_list = tuple(g for g in (two.rows, two.cols) if len(g) > 1)
    programs = []
    n = len(ranks)
    for r in range(n):
        common = dict(rank=r, world_size=n, modules=staged.modules, eval_modules=staged_eval.modules,
                      output=staged.output, eval_output=staged_eval.output, instructions=ranks[r].instructions,
                      eval_instructions=tuple(eval_progs[r]), stages=ranks[r].stages,
                      same_seed=options.dropout == "replicated", halo=((), ()), counts=counts, params=params,
                      param_names=names, groups=groups_list, param_rank=two.rows[0])
        if r in two.cols:
            programs.append(RankProgram(
                **common, eval_stages=stages_of(staged_eval, groups_eval, reads_eval, "cols"),
                inputs={}, chunk_inputs={j: {"g": chunk_graphs[j]} for j in range(K)},
                labels=None, masks={"train": None, "val": None, "test": None},
                owned=torch.zeros(0, dtype=torch.long)))
            continue
        i = two.rows.index(r)
        per_chunk = [chunking.vertices(*two.sub_rows(chunking, k)[i]) for k in range(K)]
        owned = torch.cat(per_chunk) if per_chunk else torch.zeros(0, dtype=torch.long)
        offsets = [0]
        for ids in per_chunk:
            offsets.append(offsets[-1] + int(ids.numel()))
        chunk_inputs = {k: {"x": slice_rows(graph.x, ids) if graph.x is not None else None,
                            **{name: dropout_positions(sp, graph, ids) for name, sp in dropout_inputs.items()}}
                        for k, ids in enumerate(per_chunk)}
        mask = {m: (getattr(graph, f"{m}_mask")[owned] if getattr(graph, f"{m}_mask") is not None else None)
                for m in ("train", "val", "test")}
        programs.append(RankProgram(
            **common, eval_stages=stages_of(staged_eval, groups_eval, reads_eval, "rows"),
            inputs={}, chunk_inputs=chunk_inputs, chunk_offsets=tuple(offsets),
            labels=graph.y[owned] if graph.y is not None else None, masks=mask, owned=owned))
    return programs
